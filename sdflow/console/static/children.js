// #/runs/<name>/maps/<state> : the Map run's child executions, a page at a time (next_token),
// filtered by status, refreshed every 5 s.

import { api } from "./api.js";
import { h, replace, badge, timeEl, fmtDuration, link, signature } from "./dom.js";
import { reportError, clearError } from "./errors.js";
import { Poller } from "./poll.js";
import { COUNT_COLUMNS, countCells } from "./data.js";

const REFRESH_MS = 5000;
const STATUSES = ["", "RUNNING", "SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED", "PENDING_REDRIVE"];
// Read / Filtered / Failed / Duplicates / Kept: what was kept of the shard's rows and why (data.js).
const COLUMNS = ["Child", "Status", "Shard", "Job", "Job status", "Images", ...COUNT_COLUMNS, "Started",
  "Duration", "Log", "Notes"];

/** "101 of 102", flagged when the shard stored none: a shard of no images is no download. */
function images(c) {
  if (c.samples === null || c.samples === undefined) return "—";
  const text = c.images != null ? `${c.samples} of ${c.images}` : String(c.samples);
  return Number(c.samples) === 0
    ? h("span", { class: "empty-shard", "data-testid": "empty-shard" }, `${text} · no images`) : text;
}

/** The failure of this attempt, and each earlier attempt of the shard that failed (then retried). */
function notes(c) {
  const earlier = Array.isArray(c.earlier_attempts) ? c.earlier_attempts : [];
  return [
    c.failure_reason ? h("div", { class: "failure" }, c.failure_reason) : null,
    earlier.map((a, i) => h("div", { class: "small", "data-testid": "earlier-attempt" },
      `Attempt ${earlier.length - i} (${a.job_name}) ${String(a.status || "ended").toLowerCase()}` +
      `${a.failure_reason ? `: ${a.failure_reason}` : ""}; retried.`)),
  ];
}

function childRow(c) {
  return h("tr", { "data-testid": "child-row", "data-child-name": c.name, "data-status": c.status,
    class: Number(c.samples) === 0 ? "row-warning" : null },
    h("td", { class: "mono", title: c.arn || null }, c.name || "—"),
    h("td", {}, badge(c.status)),
    h("td", { class: "mono" }, c.shard_id ?? "—"),
    h("td", { class: "mono" }, c.job_name ?? "—"),
    h("td", {}, c.job_status ? badge(c.job_status) : "—"),
    h("td", { class: "num" }, images(c)),
    countCells(c.counts),
    h("td", {}, timeEl(c.start)),
    h("td", { class: "num" }, fmtDuration(c.duration_s)),
    h("td", {}, c.log_url ? link(c.log_url, "log", { "data-testid": "child-log" }) : "—"),
    h("td", {}, notes(c)));
}

export function mountChildren(root, ctx, runName, state) {
  document.title = `${state} · ${runName} · sdflow console`;
  const runHref = `#/runs/${encodeURIComponent(runName)}`;
  const select = h("select", { "data-testid": "status-filter", "aria-label": "Status" },
    STATUSES.map((st) => h("option", { value: st }, st ? st.replace(/_/g, " ") : "All statuses")));
  const first = h("button", { type: "button", "data-testid": "first-page" }, "First page");
  const prev = h("button", { type: "button", "data-testid": "prev-page" }, "Previous page");
  const next = h("button", { type: "button", "data-testid": "next-page" }, "Next page");
  const pageNo = h("span", { class: "muted small", "data-testid": "page-number" });
  const body = h("tbody");
  const note = h("p", { class: "muted small" });
  const summary = h("div", { class: "children-summary" });
  replace(root,
    h("p", { class: "crumbs" }, h("a", { href: "#/" }, "Runs"), " / ",
      h("a", { href: runHref }, runName), " / ", state),
    h("section", { class: "card" },
      h("div", { class: "card-head" }, h("h1", {}, `Child executions of ${state}`),
        h("a", { href: runHref }, "← back to the run")),
      h("div", { class: "toolbar" }, h("label", {}, "Status ", select), first, prev, next, pageNo),
      summary,
      h("div", { class: "table-wrap" }, h("table", { class: "table", "data-testid": "children-table" },
        h("thead", {}, h("tr", {}, COLUMNS.map((t) => h("th", { scope: "col" }, t)))), body)),
      note));

  let alive = true;
  let tokens = [null]; // the token of each page shown so far; the last is the current page
  let nextToken = null;
  let lastSig = null;
  let loadedOnce = false;

  const updateButtons = () => {
    next.disabled = !nextToken;
    prev.disabled = tokens.length < 2;
    first.disabled = tokens.length < 2;
    pageNo.textContent = `Page ${tokens.length}`;
  };
  updateButtons();
  next.disabled = true;

  const load = async () => {
    const token = tokens[tokens.length - 1];
    const status = select.value;
    try {
      const data = await api.children(runName, state, status, token);
      if (!alive || token !== tokens[tokens.length - 1] || status !== select.value) return REFRESH_MS;
      clearError("page");
      loadedOnce = true;
      nextToken = data.next_token || null;
      const items = Array.isArray(data.items) ? data.items : [];
      const sig = signature(items);
      if (sig !== lastSig) {
        lastSig = sig;
        replace(body, items.length ? items.map(childRow)
          : h("tr", {}, h("td", { colspan: COLUMNS.length, class: "muted" },
            status ? `No ${status.replace(/_/g, " ").toLowerCase()} child executions.` : "No child executions yet.")));
      }
      const empty = items.filter((c) => Number(c.samples) === 0).length;
      const retried = items.filter((c) => (c.earlier_attempts || []).length).length;
      replace(summary,
        empty ? h("p", { class: "notice", "data-testid": "empty-shards" },
          `${empty} shard${empty === 1 ? "" : "s"} on this page downloaded no images: ` +
          "the child succeeded, but the shard adds nothing to training.") : null,
        retried ? h("p", { class: "small", "data-testid": "retried-shards" },
          `${retried} shard${retried === 1 ? " was" : "s were"} retried after a failed download job.`) : null);
      note.textContent = data.map_run_arn ? `Map run ${data.map_run_arn}` : "";
    } catch (err) {
      if (alive) reportError("page", err);
      if (alive && !loadedOnce) replace(body, h("tr", {}, h("td", { colspan: COLUMNS.length, class: "muted" },
        "Could not load the child executions.")));
    }
    updateButtons();
    return REFRESH_MS;
  };

  const poller = new Poller(load, REFRESH_MS).start();
  const go = (newTokens) => { tokens = newTokens; nextToken = null; lastSig = null; updateButtons(); poller.now(); };
  select.addEventListener("change", () => go([null]));
  first.addEventListener("click", () => go([null]));
  prev.addEventListener("click", () => go(tokens.slice(0, -1)));
  next.addEventListener("click", () => { if (nextToken) go([...tokens, nextToken]); });

  return () => { alive = false; poller.stop(); };
}
