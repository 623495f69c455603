// Entry point: the top bar, the error banner and the hash router (API.md "Page routes").

import { api } from "./api.js";
import { h, replace } from "./dom.js";
import { initBanner, reportError, clearAllErrors } from "./errors.js";
import { mountRuns } from "./runs.js";
import { mountRun } from "./run.js";
import { mountChildren } from "./children.js";
import { mountLogs } from "./logs.js";

const main = document.getElementById("main");
const target = document.querySelector("[data-testid=target]");
initBanner(document.getElementById("banner"));

let haveOverview = false;

/** The top bar shows where the console looks: the local endpoint or the AWS region. */
function setOverview(data) {
  if (!data || typeof data !== "object") return;
  haveOverview = true;
  const text = data.endpoint_url ? data.endpoint_url : `AWS ${data.region || ""}`.trim();
  target.textContent = text;
  target.title = [data.state_machine_arn, data.bucket ? `s3://${data.bucket}` : null]
    .filter(Boolean).join("\n");
  target.dataset.mode = data.endpoint_url ? "local" : "aws";
}

const ctx = { setOverview };

function safeDecode(part) {
  try { return decodeURIComponent(part); } catch (_err) { return part; }
}

/** "#/runs/a/maps/b" -> {page: "children", run: "a", state: "b"}. */
export function parseRoute(hash) {
  const raw = String(hash || "").replace(/^#/, "") || "/";
  const q = raw.indexOf("?");
  const path = q >= 0 ? raw.slice(0, q) : raw;
  const params = new URLSearchParams(q >= 0 ? raw.slice(q + 1) : "");
  const parts = path.split("/").filter(Boolean).map(safeDecode);
  if (parts.length === 0) return { page: "runs" };
  if (parts[0] === "runs" && parts.length === 2) return { page: "run", run: parts[1] };
  if (parts[0] === "runs" && parts.length === 4 && parts[2] === "maps") {
    return { page: "children", run: parts[1], state: parts[3] };
  }
  if (parts[0] === "logs" && parts.length === 1) {
    return { page: "logs", group: params.get("group"), stream: params.get("stream") };
  }
  return { page: "unknown", path: raw };
}

let unmount = null;

function route() {
  if (unmount) {
    try { unmount(); } catch (_err) { /* a page that fails to clean up must not block the next */ }
    unmount = null;
  }
  clearAllErrors();
  window.scrollTo(0, 0);
  const r = parseRoute(window.location.hash);
  document.title = "sdflow console";
  try {
    if (r.page === "runs") unmount = mountRuns(main, ctx);
    else if (r.page === "run") unmount = mountRun(main, ctx, r.run);
    else if (r.page === "children") unmount = mountChildren(main, ctx, r.run, r.state);
    else if (r.page === "logs") unmount = mountLogs(main, ctx, r.group, r.stream);
    else {
      replace(main, h("section", { class: "card" }, h("h1", {}, "Page not found"),
        h("p", {}, "There is no page at ", h("code", {}, `#${r.path}`), ". ",
          h("a", { href: "#/" }, "See the runs."))));
    }
  } catch (err) {
    reportError("page", err);
  }
  if (!haveOverview && r.page !== "runs") {
    api.overview().then(setOverview, () => { /* the page's own calls report errors */ });
  }
}

window.addEventListener("hashchange", route);
window.addEventListener("unhandledrejection", (ev) => {
  ev.preventDefault();
  reportError("page", ev.reason);
});
window.addEventListener("error", (ev) => {
  ev.preventDefault();
  reportError("page", ev.error || ev.message);
});
route();
