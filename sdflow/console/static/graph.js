// The run's state graph: dagre lays it out top to bottom (like the Step Functions console),
// SVG draws it. A Map state whose states name it as `parent` is a cluster: its header (name +
// counts) is a node at the top of the cluster, and a join point at the bottom is where the
// flow leaves it. Layout runs only when the graph changes; paint() only updates statuses/text.

import dagre from "./vendor/dagre.esm.js";
import { s, setAttr, setText, fmtDuration } from "./dom.js";
import { edgePath, clusterBox } from "./geometry.js";

export const FONT_FAMILY = 'system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif';
const NAME_FONT = `600 13px ${FONT_FAMILY}`;
const SUB_FONT = `11px ${FONT_FAMILY}`;
const BOX_H = 48;
const HEADER_H = 42;
const TERMINAL_R = 20;
const MAX_LABEL = 36;

const START = "\u0001start";
const END = "\u0001end";
const headerId = (name) => `\u0001header\u0001${name}`;
const joinId = (name) => `\u0001join\u0001${name}`;

let canvas = null;
function textWidth(text, font) {
  canvas = canvas || document.createElement("canvas");
  const ctx = canvas.getContext("2d");
  if (!ctx) return String(text).length * 7.5;
  ctx.font = font;
  return ctx.measureText(String(text)).width;
}

export function graphSignature(graph) {
  if (!graph) return "null";
  return JSON.stringify([graph.start_at,
    (graph.states || []).map((st) => [st.name, st.type, st.parent, !!st.end, !!st.distributed]),
    (graph.edges || []).map((e) => [e.source, e.target, e.kind, e.label])]);
}

function stateSub(st, rec) {
  const parts = [st.type];
  if (rec && rec.duration_s !== null && rec.duration_s !== undefined) {
    parts.push(fmtDuration(rec.duration_s));
  }
  if (rec && rec.attempts > 1) parts.push(`${rec.attempts} attempts`);
  return parts.join(" · ");
}

function mapSub(st, mapRun, rec) {
  const kind = st.distributed ? "Distributed Map" : "Map";
  const c = mapRun && mapRun.counts;
  if (!c) return rec && rec.duration_s != null ? `${kind} · ${fmtDuration(rec.duration_s)}` : kind;
  const parts = [`${kind} · ${c.succeeded}/${c.total} succeeded`];
  if (c.failed) parts.push(`${c.failed} failed`);
  if (c.empty) parts.push(`${c.empty} held no image`);
  if (c.running) parts.push(`${c.running} running`);
  return parts.join(" · ");
}

/** A Distributed Map's inner state as its children ran it (API.md map_runs[*].inner), or null. */
function innerOf(mapRuns, st) {
  const inner = st.parent && mapRuns[st.parent] ? mapRuns[st.parent].inner : null;
  return inner && inner.states && inner.states[st.name] ? { ...inner.states[st.name], of: inner } : null;
}

function innerSub(st, inner) {
  const c = inner.counts || {};
  const n = Object.values(c).reduce((a, b) => a + Number(b || 0), 0);
  const read = Number(inner.of.sampled || 0);
  const total = Number(inner.of.total || 0);
  const parts = [st.type, read < total ? `${n} of ${read} children read` : `${n} of ${total} children`];
  if (c.failed) parts.push(`${c.failed} failed`);
  if (c.running) parts.push(`${c.running} running`);
  if (c.aborted) parts.push(`${c.aborted} aborted`);
  return parts.join(" · ");
}

const isTerminal = (st) => st.end || st.type === "Succeed" || st.type === "Fail";

export class RunGraph {
  /** host: the element the SVG goes in; onSelect(stateName) on click / Enter. */
  constructor(host, onSelect) {
    this.host = host;
    this.onSelect = onSelect;
    this.sig = null;
    this.nodes = new Map(); // state name -> {g, sub, title, st}
    this.edges = [];        // {path, source, target}
    this.selected = null;
    this.uid = `g${Math.random().toString(36).slice(2, 8)}`;
  }

  update(graph, states, mapRuns) {
    const sig = graphSignature(graph);
    if (sig !== this.sig) {
      this.sig = sig;
      this.layout(graph || { states: [], edges: [] });
    }
    this.paint(states || {}, mapRuns || {});
  }

  select(name) {
    this.selected = name;
    for (const [key, rec] of this.nodes) rec.g.classList.toggle("selected", key === name);
  }

  layout(graph) {
    const states = graph.states || [];
    const byName = new Map(states.map((st) => [st.name, st]));
    const clusters = new Set(states.filter((st) => st.type === "Map" &&
      states.some((c) => c.parent === st.name)).map((st) => st.name));
    const into = (n) => (clusters.has(n) ? headerId(n) : n);
    const outOf = (n) => (clusters.has(n) ? joinId(n) : n);

    const g = new dagre.graphlib.Graph({ compound: true, multigraph: true });
    g.setGraph({ rankdir: "TB", nodesep: 30, ranksep: 34, edgesep: 16, marginx: 16, marginy: 12 });
    g.setDefaultEdgeLabel(() => ({}));

    for (const st of states) {
      if (clusters.has(st.name)) {
        const widest = Math.max(textWidth(st.name, NAME_FONT),
          textWidth(mapSub(st, { counts: { succeeded: 8888, total: 8888, failed: 888, running: 888 } }),
            SUB_FONT));
        g.setNode(st.name, { kind: "cluster", st });
        g.setNode(headerId(st.name), { kind: "header", st, width: widest + 32, height: HEADER_H });
        g.setNode(joinId(st.name), { kind: "join", width: 8, height: 8 });
        g.setParent(headerId(st.name), st.name);
        g.setParent(joinId(st.name), st.name);
      } else {
        const inDistributed = st.parent && byName.get(st.parent) && byName.get(st.parent).distributed;
        const widestSub = inDistributed ? `${st.type} · 88 of 88 children read · 88 failed`
          : `${st.type} · 00 min 00 s`;
        const width = Math.max(150, textWidth(st.name, NAME_FONT) + 32, textWidth(widestSub, SUB_FONT) + 32);
        g.setNode(st.name, { kind: "state", st, width, height: BOX_H });
      }
    }
    for (const st of states) {
      if (st.parent && clusters.has(st.parent)) g.setParent(st.name, st.parent);
    }

    const edges = [];
    const addEdge = (v, w, info) => {
      if (!g.hasNode(v) || !g.hasNode(w)) return;
      const label = info.text ? { width: textWidth(info.text, SUB_FONT) + 10, height: 16, labelpos: "c" } : {};
      const id = `e${edges.length}`;
      g.setEdge(v, w, { ...label, minlen: 1 }, id);
      edges.push({ v, w, id, ...info });
    };

    if (graph.start_at && byName.has(graph.start_at)) {
      g.setNode(START, { kind: "start", width: TERMINAL_R * 2, height: TERMINAL_R * 2 });
      addEdge(START, into(graph.start_at), { kind: "start" });
    }
    (graph.edges || []).forEach((e) => {
      if (!byName.has(e.source) || !byName.has(e.target)) return;
      const full = e.label || (e.kind === "default" ? "Default" : null);
      const text = full && full.length > MAX_LABEL ? `${full.slice(0, MAX_LABEL - 1)}…` : full;
      addEdge(outOf(e.source), into(e.target),
        { kind: e.kind || "next", text, full, source: e.source, target: e.target });
    });
    for (const m of clusters) {
      const kids = states.filter((st) => st.parent === m);
      const kidNames = new Set(kids.map((k) => k.name));
      const entered = new Set((graph.edges || []).filter((e) => kidNames.has(e.source) &&
        kidNames.has(e.target)).map((e) => e.target));
      const firsts = kids.filter((k) => !entered.has(k.name));
      (firsts.length ? firsts : kids.slice(0, 1)).forEach((k) =>
        addEdge(headerId(m), into(k.name), { kind: "inner", target: k.name }));
      kids.filter(isTerminal).forEach((k) =>
        addEdge(outOf(k.name), joinId(m), { kind: "join", source: k.name }));
    }
    const ends = states.filter((st) => !st.parent && isTerminal(st));
    if (ends.length) {
      g.setNode(END, { kind: "end", width: TERMINAL_R * 2, height: TERMINAL_R * 2 });
      ends.forEach((st) => addEdge(outOf(st.name), END, { kind: "end", source: st.name }));
    }

    dagre.layout(g);
    this.draw(g, edges, clusters);
  }

  draw(g, edges, clusters) {
    const info = g.graph();
    const width = Math.ceil(info.width || 200);
    const height = Math.ceil(info.height || 100);
    const marker = `${this.uid}-arrow`;
    const svg = s("svg", {
      class: "graph-svg", width, height, viewBox: `0 0 ${width} ${height}`,
      role: "img", "aria-label": "State machine graph", style: `font-family: ${FONT_FAMILY}`,
    }, s("defs", {}, s("marker", {
      id: marker, viewBox: "0 0 10 10", refX: 9, refY: 5, markerWidth: 8, markerHeight: 8,
      markerUnits: "userSpaceOnUse", orient: "auto-start-reverse",
    }, s("path", { d: "M0,0 L10,5 L0,10 z", class: "arrowhead" }))));
    const clusterLayer = s("g", { class: "clusters" });
    const edgeLayer = s("g", { class: "edges" });
    const nodeLayer = s("g", { class: "nodes" });
    const labelLayer = s("g", { class: "edge-labels" });
    svg.append(clusterLayer, edgeLayer, nodeLayer, labelLayer);

    this.nodes = new Map();
    this.edges = [];
    const depth = (n) => { let d = 0; for (let p = g.parent(n); p; p = g.parent(p)) d += 1; return d; };
    [...clusters].sort((a, b) => depth(a) - depth(b)).forEach((name) => {
      const box = clusterBox(g.node(name));
      const header = g.node(headerId(name));
      const headerBottom = header.y + header.height / 2 + 4;
      const frame = s("rect", { class: "cluster-frame", x: box.x, y: box.y, width: box.width,
        height: box.height, rx: 10 });
      clusterLayer.append(s("g", { class: "cluster", "data-cluster": name }, frame));
      this.addState(nodeLayer, name, g.node(name).st, {
        x: box.x, y: box.y, width: box.width, height: headerBottom - box.y,
        nameY: (box.y + headerBottom) / 2 - 2, subY: (box.y + headerBottom) / 2 + 14, frame,
      });
    });

    for (const e of edges) {
      const pts = g.edge({ v: e.v, w: e.w, name: e.id }).points || [];
      if (!pts.length) continue;
      const path = s("path", {
        class: `edge edge-${e.kind}`, d: edgePath(pts),
        "marker-end": e.kind === "join" ? null : `url(#${marker})`,
      });
      edgeLayer.append(path);
      this.edges.push({ path, source: e.source, target: e.target });
      const lab = g.edge({ v: e.v, w: e.w, name: e.id });
      if (e.text && typeof lab.x === "number") {
        const w = lab.width;
        labelLayer.append(s("g", { class: `edge-label edge-label-${e.kind}`,
          transform: `translate(${lab.x - w / 2},${lab.y - 8})` },
        s("title", {}, e.full), s("rect", { width: w, height: 16, rx: 3 }),
        s("text", { x: w / 2, y: 12, "text-anchor": "middle" }, e.text)));
      }
    }

    for (const id of g.nodes()) {
      const n = g.node(id);
      if (n.kind === "state") {
        this.addState(nodeLayer, id, n.st, { x: n.x - n.width / 2, y: n.y - n.height / 2,
          width: n.width, height: n.height, nameY: n.height / 2 - 3, subY: n.height / 2 + 13 });
      } else if (n.kind === "start" || n.kind === "end") {
        nodeLayer.append(s("g", { class: `terminal terminal-${n.kind}`,
          transform: `translate(${n.x},${n.y})` },
        s("circle", { r: TERMINAL_R }),
        s("text", { y: 4, "text-anchor": "middle" }, n.kind === "start" ? "Start" : "End")));
      } else if (n.kind === "join") {
        nodeLayer.append(s("circle", { class: "join", cx: n.x, cy: n.y, r: 4 }));
      }
    }

    this.host.replaceChildren(svg);
    if (this.selected) this.select(this.selected);
  }

  addState(layer, name, st, box) {
    const isCluster = Boolean(box.frame);
    const nameText = s("text", { class: "state-name", "text-anchor": "middle", x: box.width / 2,
      y: isCluster ? box.nameY - box.y : box.nameY }, name);
    const sub = s("text", { class: "state-sub", "text-anchor": "middle", x: box.width / 2,
      y: isCluster ? box.subY - box.y : box.subY }, st.type);
    const title = s("title", {}, name);
    const g = s("g", {
      class: isCluster ? "state state-map-header" : "state", "data-state": name,
      "data-status": "not_reached", "data-type": st.type, tabindex: 0, role: "button",
      transform: `translate(${box.x},${box.y})`,
    }, title, s("rect", { class: "box", width: box.width, height: box.height, rx: isCluster ? 10 : 8 }),
    nameText, sub);
    const choose = () => { this.select(name); this.onSelect(name); };
    g.addEventListener("click", (ev) => { ev.stopPropagation(); choose(); });
    g.addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" || ev.key === " ") { ev.preventDefault(); choose(); }
    });
    layer.append(g);
    this.nodes.set(name, { g, sub, title, st, frame: box.frame || null });
  }

  paint(states, mapRuns) {
    for (const [name, node] of this.nodes) {
      const rec = states[name];
      // A Distributed Map's states run in its children, not in this history: coloured from them.
      const inner = rec ? null : innerOf(mapRuns, node.st);
      const status = rec ? rec.status : inner ? inner.status : "not_reached";
      setAttr(node.g, "data-status", status);
      setAttr(node.g, "data-from-children", Boolean(inner));
      if (node.frame) setAttr(node.frame.parentNode, "data-status", status);
      const text = node.frame ? mapSub(node.st, mapRuns[name], rec)
        : inner ? innerSub(node.st, inner) : stateSub(node.st, rec);
      setText(node.sub, text);
      const tip = [name, `${node.st.type} · ${status.replace("_", " ")}`];
      if (rec && rec.error) tip.push(rec.error);  // the cause, read, is in the state panel
      setText(node.title, tip.join("\n"));
    }
    for (const e of this.edges) {
      const node = (n) => this.nodes.get(n);
      const reached = (n) => Boolean(states[n]) ||
        Boolean(node(n) && node(n).g.getAttribute("data-status") !== "not_reached");
      const taken = Boolean(e.source && e.target && reached(e.source) && reached(e.target));
      e.path.classList.toggle("taken", taken);
    }
  }
}
