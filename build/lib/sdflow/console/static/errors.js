// The error banner ([data-testid=error]): message and hint of the latest failed call, one per
// source ("page", "panel", ...). A source's next successful call clears its error; any
// successful call clears network errors (the server is back). The banner element exists only
// while there is an error.

import { h } from "./dom.js";
import { asApiError } from "./api.js";

const errors = new Map(); // source -> ApiError, in insertion order (latest last)
let host = null;

export function initBanner(element) {
  host = element;
  render();
}

export function reportError(source, err) {
  const apiErr = asApiError(err);
  errors.delete(source);
  errors.set(source, apiErr);
  render();
  return apiErr;
}

export function clearError(source) {
  let changed = errors.delete(source);
  for (const [key, err] of [...errors]) {
    if (err.code === "network") { errors.delete(key); changed = true; }
  }
  if (changed) render();
}

export function clearAllErrors() {
  if (errors.size) { errors.clear(); render(); }
}

function render() {
  if (!host) return;
  const latest = [...errors.values()].pop();
  if (!latest) { host.replaceChildren(); return; }
  const existing = host.querySelector("[data-testid=error]");
  const key = `${latest.code}\u0000${latest.message}\u0000${latest.hint}`;
  if (existing && existing.dataset.key === key) return;
  const banner = h("div", { class: "banner", role: "alert", "data-testid": "error",
    "data-code": latest.code },
  h("strong", { class: "banner-message", "data-testid": "error-message" }, latest.message),
  latest.hint ? h("span", { class: "banner-hint", "data-testid": "error-hint" }, latest.hint) : null);
  banner.dataset.key = key;
  host.replaceChildren(banner);
}
