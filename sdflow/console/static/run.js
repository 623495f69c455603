// #/runs/<name> : header, graph, Map counts, state panel and the run's sections, polled from
// /api/runs/<name> every poll_after_s while the run is not finished, every 10 s after.

import { api } from "./api.js";
import { h, replace, badge, timeEl, fmtDuration, kvTable, link, signature, setAttr,
  mapHref } from "./dom.js";
import { reportError, clearError } from "./errors.js";
import { Poller } from "./poll.js";
import { RunGraph } from "./graph.js";
import { StatePanel } from "./panel.js";
import { Sections } from "./sections.js";
import { causeView } from "./causes.js";

const FINISHED_POLL_MS = 10000;
const ERROR_POLL_MS = 3000;

const LEGEND = [
  ["not_reached", "Not reached"], ["running", "Running"], ["succeeded", "Succeeded"],
  ["failed", "Failed"], ["caught", "Caught"], ["aborted", "Aborted"],
];

export function legend() {
  return h("ul", { class: "legend", "data-testid": "legend" }, LEGEND.map(([status, text]) =>
    h("li", { "data-status": status }, h("span", { class: "swatch" }), text)));
}

/** One [data-testid=map-counts] box per entry of map_runs. */
function mapCounts(runName, state, mapRun) {
  const c = mapRun.counts || {};
  const num = (k) => Number(c[k] || 0);
  const total = num("total");
  const pct = (k) => (total > 0 ? (100 * num(k)) / total : 0);
  const bar = h("div", { class: "bar", title: `${num("succeeded")} of ${total} succeeded` },
    ["succeeded", "failed", "running", "aborted", "timed_out"].map((k) =>
      h("span", { class: `bar-${k}`, style: `width:${pct(k).toFixed(2)}%` })));
  const el = h("div", { class: "map-counts", "data-testid": "map-counts", "data-state": state },
    h("div", { class: "map-counts-head" }, h("strong", {}, state), badge(mapRun.status)),
    bar,
    h("dl", { class: "counts" },
      [["total", "Total"], ["succeeded", "Succeeded"], ["failed", "Failed"], ["running", "Running"],
        ["pending", "Pending"], ["timed_out", "Timed out"], ["aborted", "Aborted"],
        ["results_written", "Results written"]]
        .filter(([k]) => k === "total" || k === "succeeded" || k === "failed" || k === "running" ||
          num(k) > 0)
        .map(([k, label]) => h("div", { class: `count count-${k}` }, h("dt", {}, label),
          h("dd", {}, String(num(k)))))),
    h("p", { class: "small muted" },
      `Tolerated failures ${mapRun.tolerated_failure_percentage ?? 0}% · max concurrency ` +
      `${mapRun.max_concurrency || "unlimited"}`),
    link(mapHref(runName, state), "Child executions →", { "data-testid": "map-children-link" }));
  for (const k of ["total", "succeeded", "failed", "running", "pending"]) {
    setAttr(el, `data-${k}`, num(k));
  }
  return el;
}

function header(run, runName) {
  const failed = ["FAILED", "TIMED_OUT", "ABORTED"].includes(run.status) || run.error;
  return [
    h("div", { class: "run-title" },
      h("h1", { "data-testid": "run-name" }, run.name || runName),
      badge(run.status, "run-status")),
    kvTable([
      ["Started", timeEl(run.start)],
      ["Stopped", run.stop ? timeEl(run.stop) : "—"],
      ["Duration", fmtDuration(run.duration_s)],
      ["Started by", run.started_by || "—"],
      run.manifest ? ["Manifest", run.manifest] : null,
      run.redrive_count ? ["Redrives", h("span", {}, String(run.redrive_count),
        run.redrive_date ? [" · last ", timeEl(run.redrive_date)] : null)] : null,
    ], { class: "kv run-meta" }),
    failed && (run.error || run.cause) ? h("div", {
      class: run.status === "ABORTED" ? "run-error run-stopped" : "run-error", "data-testid": "run-error" },
      h("strong", {}, run.error || run.status),
      causeView(run.reason, run.cause, "run-cause")) : null,
  ];
}

export function mountRun(root, ctx, runName) {
  document.title = `${runName} · sdflow console`;
  const head = h("section", { class: "card run-head", "data-testid": "run-header" },
    h("div", { class: "run-title" }, h("h1", { "data-testid": "run-name" }, runName)),
    h("p", { class: "muted" }, "Loading…"));
  const graphHost = h("div", { class: "graph", "data-testid": "graph" });
  const mapsHost = h("div", { class: "map-runs", "data-testid": "map-runs" });
  const panelHost = h("div", { class: "panel-host" },
    h("p", { class: "muted hint" }, "Click a state to see its input, output and events."));
  const sectionsHost = h("div", { class: "sections", hidden: true });
  const body = h("div", { class: "run-body", hidden: true },
    h("section", { class: "card graph-card" },
      h("div", { class: "card-head" }, h("h2", {}, "Graph"), legend()),
      graphHost),
    h("aside", { class: "side" }, mapsHost, panelHost));
  replace(root,
    h("p", { class: "crumbs" }, h("a", { href: "#/" }, "Runs"), " / ", runName),
    head, body, sectionsHost);

  let alive = true;
  let last = null;
  const sigs = {};
  const panel = new StatePanel(panelHost, runName);
  const graph = new RunGraph(graphHost, (state) => panel.open(state, last));
  const sections = new Sections(sectionsHost);

  const render = (data) => {
    last = data;
    body.hidden = false;
    sectionsHost.hidden = false;
    const run = data.run || {};
    const headSig = signature(run);
    if (headSig !== sigs.head) { sigs.head = headSig; replace(head, header(run, runName)); }
    graph.update(data.graph, data.states, data.map_runs);
    const maps = data.map_runs || {};
    const mapsSig = signature(maps);
    if (mapsSig !== sigs.maps) {
      sigs.maps = mapsSig;
      replace(mapsHost, Object.entries(maps).map(([state, m]) => mapCounts(runName, state, m || {})));
    }
    panel.update(data);
    sections.update(data);
  };

  const poller = new Poller(async () => {
    try {
      const data = await api.run(runName);
      if (!alive) return null;
      clearError("page");
      render(data);
      if (data.finished) return FINISHED_POLL_MS;
      const after = Number(data.poll_after_s);
      return (Number.isFinite(after) && after > 0 ? after : 1.5) * 1000;
    } catch (err) {
      if (!alive) return null;
      const apiErr = reportError("page", err);
      if (!last && apiErr.status === 404) {
        replace(head, h("div", { class: "run-title" }, h("h1", { "data-testid": "run-name" }, runName)),
          h("p", { class: "muted" }, apiErr.message));
      }
      return ERROR_POLL_MS;
    }
  }, ERROR_POLL_MS).start();

  return () => { alive = false; poller.stop(); panel.close(); };
}
