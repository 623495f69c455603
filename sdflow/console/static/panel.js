// The state panel ([data-testid=state-panel]): opened by clicking a state in the graph, it
// shows /api/runs/<run>/states/<state> as Input / Output / Error tabs plus the state's events,
// and for a Map state its counts and a link to the child executions. It refetches when the
// state's status changes in the run's polls.

import { api } from "./api.js";
import { h, replace, badge, timeEl, fmtJson, fmtDuration, signature, setText, mapHref } from "./dom.js";
import { reportError, clearError } from "./errors.js";
import { causeView } from "./causes.js";

const TABS = [["input", "Input"], ["output", "Output"], ["error", "Error"]];

function jsonBlock(value, what) {
  if (value === null || value === undefined) return `(no ${what} yet)`;
  return fmtJson(value);
}

export class StatePanel {
  constructor(host, runName) {
    this.host = host;
    this.runName = runName;
    this.state = null;
    this.tab = "input";
    this.seq = 0;
    this.fetchedSig = null;
    this.els = null;
  }

  open(state, runData) {
    this.state = state;
    this.runData = runData;
    this.fetchedSig = null;
    const info = ((runData && runData.graph && runData.graph.states) || []).find((st) => st.name === state);
    const isMap = info ? info.type === "Map" : false;
    const els = {
      title: h("h2", { "data-testid": "state-name" }, state),
      meta: h("div", { class: "panel-meta" }, h("span", { class: "muted" }, "Loading…")),
      map: isMap ? h("div", { class: "panel-map" }) : null,
      input: h("pre", { class: "json", "data-testid": "state-input" }),
      output: h("pre", { class: "json", "data-testid": "state-output" }),
      error: h("div", { class: "state-error", "data-testid": "state-error" }),
      events: h("tbody"),
      tabs: {},
      message: h("p", { class: "panel-message muted", hidden: true }),
    };
    const tabBar = h("div", { class: "tabs", role: "tablist" }, TABS.map(([key, label]) => {
      const button = h("button", { type: "button", role: "tab", class: "tab",
        "data-testid": `tab-${key}`, onclick: () => this.showTab(key) }, label);
      els.tabs[key] = button;
      return button;
    }));
    this.els = els;
    replace(this.host, h("section", { class: "card panel", "data-testid": "state-panel",
      "data-state": state },
    h("div", { class: "panel-head" }, els.title,
      h("button", { type: "button", class: "close", title: "Close", "aria-label": "Close",
        "data-testid": "panel-close", onclick: () => this.close(true) }, "×")),
    els.meta, els.map, els.message, tabBar,
    h("div", { class: "tab-body" }, els.input, els.output, els.error),
    h("h3", {}, "Events"),
    h("table", { class: "table events", "data-testid": "state-events" },
      h("thead", {}, h("tr", {}, h("th", {}, "ID"), h("th", {}, "Type"), h("th", {}, "Time"))),
      els.events)));
    this.showTab(this.tab);
    const box = this.host.firstElementChild;
    const rect = box.getBoundingClientRect();
    if (rect.top > window.innerHeight || rect.bottom < 0) box.scrollIntoView({ block: "start" });
    if (runData) this.update(runData, false);
    this.fetch(runData);
  }

  showTab(key) {
    this.tab = key;
    if (!this.els) return;
    for (const [k] of TABS) {
      const on = k === key;
      this.els.tabs[k].classList.toggle("active", on);
      this.els.tabs[k].setAttribute("aria-selected", String(on));
      this.els[k].hidden = !on;
    }
  }

  close(byUser = false) {
    this.seq += 1;
    this.state = null;
    this.els = null;
    clearError("panel");
    if (byUser) {
      replace(this.host, h("p", { class: "muted hint" }, "Click a state to see its input, output and events."));
      for (const g of document.querySelectorAll("g.state.selected")) g.classList.remove("selected");
    }
  }

  stateSig(runData) {
    const rec = runData && runData.states ? runData.states[this.state] : null;
    return signature(rec ? [rec.status, rec.exited, rec.attempts, rec.error] : null);
  }

  /** Each run poll: refresh the Map counts; refetch the detail when the state changed. */
  update(runData, refetch = true) {
    this.runData = runData;
    if (!this.state || !this.els) return;
    if (this.els.map) this.renderMap(runData.map_runs ? runData.map_runs[this.state] : null);
    if (refetch && this.fetchedSig !== null && this.stateSig(runData) !== this.fetchedSig) {
      this.fetch(runData);
    }
  }

  renderMap(mapRun) {
    const c = (mapRun && mapRun.counts) || null;
    const counts = c ? h("dl", { class: "counts", "data-testid": "panel-map-counts" },
      ["total", "succeeded", "failed", "running", "pending"].map((k) =>
        h("div", { class: `count count-${k}` }, h("dt", {}, k.replace("_", " ")),
          h("dd", {}, String(c[k] ?? 0))))) : h("p", { class: "muted small" }, "No map run yet.");
    replace(this.els.map, counts,
      h("a", { href: mapHref(this.runName, this.state), "data-testid": "map-link" },
        "Child executions →"));
  }

  async fetch(runData) {
    const seq = ++this.seq;
    const state = this.state;
    const sig = this.stateSig(runData);
    this.fetchedSig = sig;
    try {
      const detail = await api.state(this.runName, state);
      if (seq !== this.seq || !this.els) return;
      clearError("panel");
      this.els.message.hidden = true;
      this.render(detail);
    } catch (err) {
      if (seq !== this.seq || !this.els) return;
      const apiErr = reportError("panel", err);
      this.fetchedSig = "\u0000retry"; // differs from any state: the next poll fetches again
      this.els.message.hidden = false;
      this.els.message.classList.remove("info");
      setText(this.els.message, apiErr.hint ? `${apiErr.message} (${apiErr.hint})` : apiErr.message);
    }
  }

  /** A Distributed Map's inner state: it runs in the Map's children, not in this history. */
  innerOf(state) {
    const graph = (this.runData && this.runData.graph && this.runData.graph.states) || [];
    const st = graph.find((x) => x.name === state);
    const mapRun = st && st.parent && this.runData.map_runs ? this.runData.map_runs[st.parent] : null;
    const inner = mapRun && mapRun.inner && mapRun.inner.states ? mapRun.inner.states[state] : null;
    return inner ? { ...inner, map: st.parent, of: mapRun.inner } : null;
  }

  render(d) {
    const els = this.els;
    const inner = d.status === "not_reached" ? this.innerOf(d.name) : null;
    const status = inner ? inner.status : d.status || "not_reached";
    // The server's duration: fixed once the state ended (its exit, or the failure that ended the run).
    const duration = d.entered && d.ended && d.duration_s != null ? Number(d.duration_s) : null;
    replace(els.meta,
      h("span", { class: "type" }, d.type || ""),
      badge(status.replace("not_reached", "not reached"), "state-status"),
      h("span", { class: "small muted" }, "Entered ", timeEl(d.entered)),
      d.exited ? h("span", { class: "small muted" }, "Exited ", timeEl(d.exited))
        : d.ended ? h("span", { class: "small muted" }, "Ended ", timeEl(d.ended)) : null,
      duration !== null && Number.isFinite(duration) ? h("span", { class: "small muted" },
        fmtDuration(duration)) : null);
    els.message.classList.toggle("info", Boolean(inner));
    if (inner) {
      const counts = Object.entries(inner.counts || {}).map(([k, n]) => `${n} ${k}`).join(", ");
      els.message.hidden = false;
      replace(els.message, `This state runs in the child executions of ${inner.map}: of the ` +
        `${inner.of.sampled} children read, ${counts}. `,
      h("a", { href: mapHref(this.runName, inner.map) }, "Child executions →"));
    }
    els.input.classList.toggle("empty", d.input === null || d.input === undefined);
    els.output.classList.toggle("empty", d.output === null || d.output === undefined);
    setText(els.input, jsonBlock(d.input, "input"));
    setText(els.output, jsonBlock(d.output, "output"));
    if (d.error || d.cause) {
      replace(els.error, h("strong", { class: "error-name" }, d.error || "Error"),
        causeView(d.reason, d.cause, "state-cause"));
    } else {
      replace(els.error, h("p", { class: "muted" }, "No error."));
    }
    els.tabs.error.classList.toggle("has-error", Boolean(d.error || d.cause));
    const events = Array.isArray(d.events) ? d.events : [];
    replace(els.events, events.length ? events.map((e) => h("tr", { "data-testid": "state-event" },
      h("td", { class: "num" }, String(e.id ?? "")), h("td", {}, e.type || ""),
      h("td", {}, timeEl(e.timestamp)))) : h("tr", {}, h("td", { colspan: 3, class: "muted" },
      "No events.")));
  }
}
