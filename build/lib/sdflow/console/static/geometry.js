// Small geometry helpers for the SVG drawings (graph edges, chart axes).

const r = (v) => Math.round(v * 10) / 10;

/** A smooth path through dagre's edge points (a uniform B-spline, like d3.curveBasis). */
export function edgePath(points) {
  const pts = points.filter((p) => Number.isFinite(p.x) && Number.isFinite(p.y));
  if (pts.length === 0) return "";
  if (pts.length < 3) return `M${pts.map((p) => `${r(p.x)},${r(p.y)}`).join(" L")}`;
  let d = `M${r(pts[0].x)},${r(pts[0].y)}`;
  const first = pts[0];
  const second = pts[1];
  d += ` L${r((5 * first.x + second.x) / 6)},${r((5 * first.y + second.y) / 6)}`;
  for (let i = 2; i <= pts.length; i += 1) {
    const p0 = pts[i - 2];
    const p1 = pts[i - 1];
    const p2 = i < pts.length ? pts[i] : pts[i - 1];
    d += ` C${r((2 * p0.x + p1.x) / 3)},${r((2 * p0.y + p1.y) / 3)}` +
      ` ${r((p0.x + 2 * p1.x) / 3)},${r((p0.y + 2 * p1.y) / 3)}` +
      ` ${r((p0.x + 4 * p1.x + p2.x) / 6)},${r((p0.y + 4 * p1.y + p2.y) / 6)}`;
  }
  const last = pts[pts.length - 1];
  d += ` L${r(last.x)},${r(last.y)}`;
  return d;
}

/** dagre gives a cluster's centre and size; SVG wants its top-left corner. */
export function clusterBox(node) {
  return { x: node.x - node.width / 2, y: node.y - node.height / 2,
    width: node.width, height: node.height };
}

/** About `count` round tick values covering [lo, hi]. */
export function niceTicks(lo, hi, count = 5) {
  if (!Number.isFinite(lo) || !Number.isFinite(hi)) return [];
  if (hi === lo) { hi = lo + 1; }
  const span = hi - lo;
  const raw = span / Math.max(1, count);
  const mag = 10 ** Math.floor(Math.log10(raw));
  const norm = raw / mag;
  const step = (norm >= 5 ? 10 : norm >= 2 ? 5 : norm >= 1 ? 2 : 1) * mag;
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    ticks.push(Number(v.toPrecision(12)));
  }
  return ticks;
}
