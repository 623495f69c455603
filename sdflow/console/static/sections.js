// The run page's sections below the graph: dataset, training, evaluation, endpoint, notifications.
// Each part is rebuilt only when its own data changed, so images and the prompt box persist
// across polls.

import { h, replace, badge, timeEl, fmtDuration, fmtValue, kvTable, link, signature } from "./dom.js";
import { lossCurve } from "./charts.js";
import { EndpointSection } from "./endpoint.js";
import { datasetPanel } from "./data.js";

/** A slot that rebuilds its content only when the signature of its data changes. */
class Part {
  constructor(attrs = {}) { this.el = h("div", attrs); this.sig = undefined; }
  set(data, build) {
    const sig = signature(data);
    if (sig === this.sig) return;
    this.sig = sig;
    replace(this.el, build(data));
  }
}

/** A value of a summary as a person reads it: numbers and words; a list of records by its size. */
function plain(v) {
  if (Array.isArray(v)) {
    return v.every((x) => x === null || typeof x !== "object") ? v.map(fmtValue).join(", ")
      : `${v.length} entries`;
  }
  return fmtValue(v);
}

/** "prompt_adherence" → "Prompt adherence": names from a JSON file, said as words. */
const words = (key) => {
  const text = String(key).replace(/_/g, " ");
  return text.charAt(0).toUpperCase() + text.slice(1);
};

/** name → value rows; a nested object's entries become "name · key" rows next to their values. */
function metricsTable(obj, testid, asWords = true) {
  const label = asWords ? words : String;
  const rows = [];
  for (const [k, v] of Object.entries(obj || {})) {
    if (v && typeof v === "object" && !Array.isArray(v)) {
      for (const [k2, v2] of Object.entries(v)) rows.push([`${label(k)} · ${label(k2).toLowerCase()}`, plain(v2)]);
    } else rows.push([label(k), plain(v)]);
  }
  if (!rows.length) return h("p", { class: "muted small" }, "None yet.");
  return kvTable(rows, { "data-testid": testid });
}

const mark = (ok, seen) => h("span", { class: ok ? "ok" : "miss", title: ok ? "as asked" : "not as asked" },
  `${ok ? "✓" : "✗"} ${seen ?? "—"}`);

/** One row per evaluation prompt, in a box of bounded height that scrolls. */
function resultsTable(results) {
  if (!results.length) return null;
  const matched = results.filter((r) => r.foreground_ok && r.background_ok).length;
  return [
    h("h3", {}, "Per prompt"),
    h("p", { class: "small", "data-testid": "results-summary" },
      `${matched} of ${results.length} prompts drawn with the asked foreground and background colours.`),
    h("div", { class: "results-wrap", "data-testid": "results" },
      h("table", { class: "table results" },
        h("thead", {}, h("tr", {}, ["Prompt", "Foreground seen", "Background seen", "Shape seen"].map((t) =>
          h("th", { scope: "col" }, t)))),
        h("tbody", {}, results.map((r) => h("tr", { "data-testid": "result-row" },
          h("td", {}, r.prompt || "—"), h("td", {}, mark(r.foreground_ok, r.foreground)),
          h("td", {}, mark(r.background_ok, r.background)), h("td", {}, mark(r.shape_ok, r.shape))))))),
  ];
}

/** trained − base as the notification prints it, marked better or worse in the metric's own direction
 * (↑: higher is better, ↓: lower). */
function change(row) {
  if (!row.change_text) return "—";
  const delta = row.trained - row.base;
  if (!row.direction || delta === 0) return row.change_text;
  const better = row.direction === "lower" ? delta < 0 : delta > 0;
  return h("span", { class: better ? "ok" : "miss", title: better ? "better than the base" : "worse than the base" },
    row.change_text);
}

const DIRECTIONS = { higher: "higher is better", lower: "lower is better" };

/** One row per metric: base → trained with the direction, what it was computed on. */
function metricTable(rows) {
  if (!rows.length) return null;
  return [
    h("h3", {}, "Metrics, base → trained"),
    h("table", { class: "table metrics-table", "data-testid": "metrics" },
      h("thead", {}, h("tr", {}, ["Metric", "Base", "", "Trained", "Change", "Computed on"].map((t) =>
        h("th", { scope: "col" }, t)))),
      h("tbody", {}, rows.map((r) => h("tr", { "data-testid": "metric-row", "data-metric": r.name },
        h("td", {}, h("strong", {}, r.name), " ",
          r.arrow ? h("span", { title: DIRECTIONS[r.direction] || "" }, r.arrow) : null),
        h("td", {}, r.base_text || "—"), h("td", { class: "muted" }, "→"),
        h("td", {}, r.trained_text || "—"), h("td", {}, change(r)),
        h("td", { class: "small muted" }, r.samples_text || "—"))))),
    h("p", { class: "small muted" }, "↑ higher is better · ↓ lower is better"),
  ];
}

/** The quality gate's checks (✓/✗ with the numbers each was judged on) and the metrics not computed. */
function gateAndMissing(gate, missing) {
  const parts = [];
  if (gate.length) {
    const passed = gate.filter((c) => c.passed).length;
    parts.push(h("h3", {}, "Quality gate"),
      h("p", { class: "small", "data-testid": "gate-summary" }, `${passed} of ${gate.length} checks passed`),
      h("ul", { class: "plain-list", "data-testid": "gate" }, gate.map((c) =>
        h("li", { class: c.passed ? "ok" : "miss", "data-testid": "gate-check", "data-passed": String(c.passed) },
          c.text))));
  }
  if (missing.length) {
    parts.push(h("h3", {}, "Not computed"),
      h("ul", { class: "plain-list", "data-testid": "missing" }, missing.map((m) =>
        h("li", { "data-testid": "missing-metric" }, h("strong", {}, m.metric), `: ${m.reason || "no reason given"}`))));
  }
  return parts.length ? parts : null;
}

function image(src, testid, alt) {
  if (!src) return null;
  return h("a", { href: src, target: "_blank", rel: "noopener noreferrer", class: "image-link" },
    h("img", { src, alt, "data-testid": testid }));
}

class TrainingSection {
  constructor() {
    this.info = new Part({ class: "part" });
    this.metrics = new Part({ class: "part" });
    this.chart = new Part({ class: "part chart" });
    this.samples = new Part({ class: "part samples" });
    this.summary = new Part({ class: "part" });
    this.el = h("section", { class: "card", "data-testid": "training" },
      h("h2", {}, "Training"),
      h("div", { class: "grid-2" }, h("div", {}, this.info.el, h("h3", {}, "Final metrics"),
        this.metrics.el), h("div", {}, h("h3", {}, "Loss"), this.chart.el)),
      this.samples.el, this.summary.el);
  }

  update(t) {
    this.info.set([t.job_name, t.status, t.secondary_status, t.instance_type, t.instance_count,
      t.start, t.end, t.duration_s, t.failure_reason, t.log_url, t.loss_png_url], () => [
      kvTable([
        ["Job", h("span", { "data-testid": "training-job" }, t.job_name || "—")],
        ["Status", h("span", {}, badge(t.status, "training-status"),
          t.secondary_status && t.secondary_status !== t.status
            ? h("span", { class: "muted small" }, ` ${t.secondary_status}`) : null)],
        ["Instances", `${t.instance_type || "—"} × ${t.instance_count ?? 1}`],
        t.start || !t.end ? ["Started", timeEl(t.start)] : null,
        ["Ended", t.end ? timeEl(t.end) : "—"],
        ["Duration", fmtDuration(t.duration_s)],
        t.failure_reason ? ["Failure", h("span", { class: "failure" }, t.failure_reason)] : null,
        ["Logs", link(t.log_url, "Training log", { "data-testid": "training-log" })],
      ]),
    ]);
    this.metrics.set(t.final_metrics, (m) => metricsTable(m, "final-metrics", false));  // metric names as defined
    this.chart.set(t.loss, (loss) => [lossCurve(loss),
      t.loss_png_url ? h("p", { class: "small" }, link(t.loss_png_url, "loss.png")) : null]);
    this.samples.set(t.samples_url, (url) => (url ? [h("h3", {}, "Samples"),
      image(url, "samples", "Sample images from the trained model")] : null));
    this.summary.set(t.summary, (sum) => (sum ? [h("h3", {}, "Summary"),
      metricsTable(sum, "training-summary")] : null));
  }
}

class EvaluationSection {
  constructor() {
    this.info = new Part({ class: "part" });
    this.metrics = new Part({ class: "part" });
    this.gate = new Part({ class: "part" });
    this.holdout = new Part({ class: "part samples" });
    this.results = new Part({ class: "part" });
    this.grid = new Part({ class: "part samples" });
    // The two grids side by side: each may be up to 560 px tall.
    this.el = h("section", { class: "card", "data-testid": "evaluation" },
      h("h2", {}, "Evaluation"), this.info.el, this.metrics.el, this.gate.el,
      h("div", { class: "grid-2" }, this.holdout.el, this.grid.el), this.results.el);
  }

  update(e) {
    const info = { ...e, results: undefined, metrics: undefined, gate: undefined, missing: undefined };
    this.info.set(info, () => h("div", { class: "grid-2" },
      kvTable([
        ["Job", e.job_name || "—"],
        ["Status", badge(e.status, "evaluation-status")],
        e.failure_reason ? ["Failure", h("span", { class: "failure" }, e.failure_reason)] : null,
        ["Logs", link(e.log_url, "Evaluation log", { "data-testid": "evaluation-log" })],
      ]),
      // With the metrics in their own table below, the rest of evaluation.json is detail.
      h("div", {}, h("h3", {}, e.metrics && e.metrics.length ? "Details" : "Scores"), metricsTable(e.scores, "scores"),
        e.settings && Object.keys(e.settings).length ? h("p", { class: "small muted" }, "Settings: ",
          Object.entries(e.settings).map(([k, v]) => `${words(k).toLowerCase()} ${fmtValue(v)}`).join(" · "))
          : null)));
    this.metrics.set(Array.isArray(e.metrics) ? e.metrics : [], metricTable);
    this.gate.set([e.gate || [], e.missing || []], ([gate, missing]) => gateAndMissing(gate, missing));
    this.holdout.set([e.holdout_grid_url, e.holdout_samples], ([url, n]) => (url ? [
      h("h3", {}, "Held-out captions: real | base | trained"),
      n ? h("p", { class: "small muted" }, `A sample of the ${n} held-out images and captions the metrics were computed on.`)
        : null,
      image(url, "holdout-grid", "Held-out grid: real image, base model, trained model per caption")] : null));
    this.results.set(Array.isArray(e.results) ? e.results : [], resultsTable);
    this.grid.set(e.grid_url, (url) => (url ? [h("h3", {}, "Prompt adherence"),
      image(url, "adherence-grid", "Prompt adherence grid")] : null));
  }
}

function notification(n) {
  return h("li", { class: "notification", "data-testid": "notification", "data-status": n.status },
    h("div", { class: "notification-head" }, timeEl(n.time), badge(n.status),
      h("strong", { class: "subject" }, n.subject || "")),
    h("pre", { class: "message" }, n.message || ""));
}

export class Sections {
  constructor(host) {
    this.host = host;
    this.training = new TrainingSection();
    this.evaluation = new EvaluationSection();
    this.endpoint = new EndpointSection();
    this.notifications = new Part({ class: "card", "data-testid": "notifications" });
    this.dataset = new Part({ class: "card", "data-testid": "dataset" });
    this.slots = {
      dataset: h("div"), training: h("div"), evaluation: h("div"), endpoint: h("div"),
    };
    host.append(this.slots.dataset, this.slots.training, this.slots.evaluation, this.slots.endpoint,
      this.notifications.el);
    replace(this.notifications.el, h("h2", {}, "Notifications"));
  }

  show(key, data) {
    const slot = this.slots[key];
    const section = this[key];
    if (data) {
      if (slot.firstChild !== section.el) replace(slot, section.el);
      section.update(data);
    } else if (slot.firstChild) {
      slot.replaceChildren();
    }
  }

  update(data) {
    if (data.dataset) {
      if (this.slots.dataset.firstChild !== this.dataset.el) replace(this.slots.dataset, this.dataset.el);
      this.dataset.set(data.dataset, datasetPanel);
    } else this.slots.dataset.replaceChildren();
    this.show("training", data.training);
    this.show("evaluation", data.evaluation);
    this.show("endpoint", data.endpoint);
    const notes = Array.isArray(data.notifications) ? data.notifications : [];
    this.notifications.set(notes, (list) => [h("h2", {}, "Notifications"),
      list.length ? h("ul", { class: "notifications" }, list.map(notification))
        : h("p", { class: "muted small" }, "No notifications yet.")]);
  }
}
