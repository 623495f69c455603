// #/ : the runs table, polled from /api/overview every 3 s.

import { api } from "./api.js";
import { h, replace, badge, timeEl, fmtDuration, link, signature } from "./dom.js";
import { reportError, clearError } from "./errors.js";
import { Poller } from "./poll.js";

const POLL_MS = 3000;

function runRow(run) {
  return h("tr", { "data-testid": "run-row", "data-run-name": run.name, "data-status": run.status },
    h("td", {}, link(run.url || `#/runs/${encodeURIComponent(run.name)}`, run.name,
      { class: "run-link", title: run.arn || null })),
    h("td", {}, badge(run.status, "run-status")),
    h("td", {}, timeEl(run.start)),
    h("td", { class: "num" }, fmtDuration(run.duration_s)),
    h("td", {}, run.started_by === "upload" ? "upload" : run.started_by || "—"),
    h("td", { class: "num" }, String(run.redrive_count ?? 0)));
}

export function mountRuns(root, ctx) {
  const body = h("tbody");
  const empty = h("p", { class: "muted empty", hidden: true }, "No runs yet.");
  const machine = h("p", { class: "muted small" });
  replace(root,
    h("section", { class: "card" },
      h("div", { class: "card-head" }, h("h1", {}, "Runs"), machine),
      h("table", { class: "table runs", "data-testid": "runs-table" },
        h("thead", {}, h("tr", {},
          ["Name", "Status", "Started", "Duration", "Started by", "Redrives"].map((t) =>
            h("th", { scope: "col", class: t === "Duration" || t === "Redrives" ? "num" : null }, t)))),
        body),
      empty));

  let lastSig = null;
  let alive = true;
  const poller = new Poller(async () => {
    try {
      const data = await api.overview();
      if (!alive) return null;
      clearError("page");
      ctx.setOverview(data);
      const sig = signature(data.runs);
      if (sig !== lastSig) {
        lastSig = sig;
        const runs = Array.isArray(data.runs) ? data.runs : [];
        replace(body, runs.map(runRow));
        empty.hidden = runs.length > 0;
      }
      machine.textContent = data.state_machine_arn ? `State machine ${data.state_machine_arn}` : "";
    } catch (err) {
      if (alive) reportError("page", err);
    }
    return POLL_MS;
  }, POLL_MS).start();

  return () => { alive = false; poller.stop(); };
}
