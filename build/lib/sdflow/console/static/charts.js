// The training loss curve as inline SVG: axes with a few ticks and a polyline.

import { s, fmtNumber } from "./dom.js";
import { niceTicks } from "./geometry.js";

const W = 520;
const H = 240;
const M = { top: 14, right: 16, bottom: 38, left: 58 };

/** loss: [[step, loss], ...] -> <svg data-testid="loss-curve" data-points="N">. */
export function lossCurve(loss) {
  const points = (Array.isArray(loss) ? loss : [])
    .filter((p) => Array.isArray(p) && Number.isFinite(Number(p[0])) && Number.isFinite(Number(p[1])))
    .map((p) => [Number(p[0]), Number(p[1])]);
  const svg = s("svg", {
    class: "loss-curve", "data-testid": "loss-curve", "data-points": points.length,
    viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
    "aria-label": `Training loss, ${points.length} points`,
  });
  const plotW = W - M.left - M.right;
  const plotH = H - M.top - M.bottom;
  svg.append(s("rect", { class: "plot-area", x: M.left, y: M.top, width: plotW, height: plotH }));
  if (!points.length) {
    svg.append(s("text", { class: "chart-empty", x: M.left + plotW / 2, y: M.top + plotH / 2,
      "text-anchor": "middle" }, "No loss values yet"));
    return svg;
  }

  const xs = points.map((p) => p[0]);
  const ys = points.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  if (y0 === y1) { const d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
  const yPad = (y1 - y0) * 0.05;
  y0 -= yPad; y1 += yPad;
  const sx = (v) => M.left + ((v - x0) / (x1 - x0)) * plotW;
  const sy = (v) => M.top + plotH - ((v - y0) / (y1 - y0)) * plotH;

  const axes = s("g", { class: "axes" });
  for (const t of niceTicks(x0, x1, 6).filter((t) => t >= x0 && t <= x1)) {
    const x = sx(t);
    axes.append(s("line", { class: "tick", x1: x, x2: x, y1: M.top + plotH, y2: M.top + plotH + 5 }),
      s("line", { class: "grid", x1: x, x2: x, y1: M.top, y2: M.top + plotH }),
      s("text", { x, y: M.top + plotH + 18, "text-anchor": "middle" }, fmtNumber(t)));
  }
  for (const t of niceTicks(y0, y1, 5).filter((t) => t >= y0 && t <= y1)) {
    const y = sy(t);
    axes.append(s("line", { class: "tick", x1: M.left - 5, x2: M.left, y1: y, y2: y }),
      s("line", { class: "grid", x1: M.left, x2: M.left + plotW, y1: y, y2: y }),
      s("text", { x: M.left - 8, y: y + 4, "text-anchor": "end" }, fmtNumber(t)));
  }
  axes.append(
    s("line", { class: "axis", x1: M.left, x2: M.left + plotW, y1: M.top + plotH, y2: M.top + plotH }),
    s("line", { class: "axis", x1: M.left, x2: M.left, y1: M.top, y2: M.top + plotH }),
    s("text", { class: "axis-label", x: M.left + plotW / 2, y: H - 4, "text-anchor": "middle" }, "step"),
    s("text", { class: "axis-label", x: 12, y: M.top + plotH / 2, "text-anchor": "middle",
      transform: `rotate(-90 12 ${M.top + plotH / 2})` }, "loss"));
  svg.append(axes);

  const coords = points.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
  svg.append(s("polyline", { class: "loss-line", points: coords }));
  if (points.length === 1) {
    svg.append(s("circle", { class: "loss-dot", cx: sx(points[0][0]), cy: sy(points[0][1]), r: 3 }));
  }
  const [lastStep, lastLoss] = points[points.length - 1];
  svg.append(s("title", {}, `step ${lastStep}: loss ${fmtNumber(lastLoss)}`));
  return svg;
}
