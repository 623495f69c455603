// DOM helpers and formatting. Every text from the API goes through textContent (h() children,
// setText) so nothing is ever parsed as HTML.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(el, attrs, children) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.setAttribute("class", value);
    else if (key === "text") el.textContent = String(value);
    else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** An HTML element: h("td", {class: "x", "data-testid": "y"}, "text", otherNode). */
export function h(tag, attrs, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element, same calling convention as h(). */
export function s(tag, attrs, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** Replace all children of el. */
export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function setText(el, text) {
  const value = text === null || text === undefined ? "" : String(text);
  if (el.textContent !== value) el.textContent = value;
}

export function setAttr(el, name, value) {
  const text = String(value);
  if (el.getAttribute(name) !== text) el.setAttribute(name, text);
}

const pad = (n) => String(n).padStart(2, "0");

/** "2024-05-01 14:03:09" in the browser's time zone; the ISO string goes in a title. */
export function fmtTime(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return String(iso);
  return `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`;
}

export function timeEl(iso) {
  return h("time", { datetime: iso || null, title: iso || null }, fmtTime(iso));
}

/** 4.2 s, 3 min 05 s, 2 h 04 min. */
export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || Number.isNaN(Number(seconds))) return "—";
  const sec = Math.max(0, Number(seconds));
  if (sec < 10) return `${sec.toFixed(1)} s`;
  if (sec < 60) return `${Math.round(sec)} s`;
  const total = Math.round(sec);
  const hours = Math.floor(total / 3600);
  const minutes = Math.floor((total % 3600) / 60);
  if (hours > 0) return `${hours} h ${pad(minutes)} min`;
  return `${minutes} min ${pad(total % 60)} s`;
}

export function fmtNumber(value) {
  if (typeof value !== "number") return value === null || value === undefined ? "—" : String(value);
  if (Number.isInteger(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(3);
  return String(Number(value.toPrecision(4)));
}

/** Any value as display text: scalars as they are, objects as compact JSON. */
export function fmtValue(value) {
  if (value === null || value === undefined) return "—";
  if (typeof value === "number") return fmtNumber(value);
  if (typeof value === "object") return JSON.stringify(value);
  return String(value);
}

/** Pretty JSON for a <pre>; a raw string (input that did not parse) is shown as it is. */
export function fmtJson(value) {
  if (typeof value === "string") return value;
  return JSON.stringify(value, null, 2);
}

const STATUS_CLASS = {
  running: ["RUNNING", "INPROGRESS", "IN_PROGRESS", "CREATING", "UPDATING", "PENDING",
    "STARTING", "STOPPING", "PENDING_REDRIVE", "SYSTEMUPDATING", "ROLLINGBACK", "PUBLISHING"],
  succeeded: ["SUCCEEDED", "COMPLETED", "INSERVICE", "SUCCESS", "OK", "APPROVED"],
  failed: ["FAILED", "TIMED_OUT", "FAILURE", "ERROR", "REJECTED"],
  caught: ["CAUGHT"],
  aborted: ["ABORTED", "STOPPED", "DELETING", "OUTOFSERVICE"],
};

/** The colour family of any status string (run, state, job, endpoint). */
export function statusClass(status) {
  const key = String(status || "").toUpperCase().replace(/[\s-]/g, "");
  for (const [cls, names] of Object.entries(STATUS_CLASS)) {
    if (names.includes(key)) return cls;
  }
  return "unknown";
}

export function badge(status, testid) {
  return h("span", { class: `badge badge-${statusClass(status)}`, "data-testid": testid || null },
    status ? String(status).replace(/_/g, " ") : "—");
}

/** A link from an API value: hash routes stay in the page, anything else opens a new tab. */
export function link(href, text, attrs = {}) {
  if (!href) return h("span", { class: "muted" }, "—");
  const internal = String(href).startsWith("#") || String(href).startsWith("/");
  return h("a", {
    href, ...attrs,
    target: internal ? null : "_blank", rel: internal ? null : "noopener noreferrer",
  }, text);
}

/** A two-column table of [label, value] rows; value may be a Node or text. */
export function kvTable(rows, attrs = {}) {
  return h("table", { class: "kv", ...attrs },
    h("tbody", {}, rows.filter((r) => r).map(([key, value]) =>
      h("tr", {}, h("th", { scope: "row" }, key),
        h("td", {}, value instanceof Node ? value : fmtValue(value))))));
}

/** Cheap change detection for "rebuild only when the data changed". */
export function signature(value) {
  return JSON.stringify(value === undefined ? null : value);
}

/** The page route of a Map state's child executions. */
export function mapHref(runName, state) {
  return `#/runs/${encodeURIComponent(runName)}/maps/${encodeURIComponent(state)}`;
}
