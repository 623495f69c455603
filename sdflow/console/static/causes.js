// A failure as a person reads it (API.md "reason"): the problem in a sentence, one line per
// field with its fix, and the raw cause (Lambda's error JSON, a stack trace) one click away in a
// closed <details>, never in the visible text (left out when it says no more than the message).

import { h, fmtJson } from "./dom.js";

function prettyCause(cause) {
  if (typeof cause !== "string") return fmtJson(cause);
  try { return JSON.stringify(JSON.parse(cause), null, 2); } catch (_e) { return cause; }
}

/** reason: {error, title, problems: [{field, message}] | null, message} | null; raw: the cause. */
export function causeView(reason, raw, testid = "cause") {
  const problems = reason && Array.isArray(reason.problems) ? reason.problems : [];
  return h("div", { class: "cause-read", "data-testid": testid },
    reason && reason.title ? h("p", { class: "cause-title" }, reason.title) : null,
    problems.length ? h("ul", { class: "cause-problems", "data-testid": "cause-problems" },
      problems.map((p) => h("li", {}, h("code", { class: "cause-field" }, `${p.field || "(document)"}:`),
        h("span", { class: "cause-fix" }, p.message || "")))) : null,
    reason && reason.message ? h("p", { class: "cause-message" }, reason.message) : null,
    raw && !(reason && reason.message === raw) ? h("details", { class: "cause-raw", "data-testid": "raw-cause" },
      h("summary", {}, "Raw cause"), h("pre", { class: "cause" }, prettyCause(raw))) : null);
}
