// What was kept and why (index.json's counts, sdflow_common.curation): the children page's per-shard
// columns and the run page's dataset panel ([data-testid=dataset]). A count nobody made (a shard from
// before the counts, a run that did not deduplicate) is null: shown "—", never 0.

import { h, kvTable } from "./dom.js";

export const COUNT_COLUMNS = ["Read", "Filtered", "Failed", "Duplicates", "Kept"];

const known = (n) => n !== null && n !== undefined;
const num = (n) => (known(n) ? Number(n).toLocaleString("en-US") : "—");
const total = (obj) => Object.values(obj).reduce((a, b) => a + Number(b || 0), 0);
const share = (n, base) => (known(n) && base ? `${((100 * n) / base).toFixed(1)}%` : "");

function filterText(drops) {
  const each = Object.entries(drops || {}).filter(([, n]) => n);
  return each.length ? each.map(([name, n]) => `${num(n)} by ${name}`).join(", ") : "";
}

function failed(c) {
  if (!known(c.failed_to_download) && !known(c.failed_to_resize)) return null;
  return Number(c.failed_to_download || 0) + Number(c.failed_to_resize || 0);
}

function duplicates(c) {
  if (!known(c.url_duplicates) || !known(c.image_duplicates)) return null;
  return Number(c.url_duplicates) + Number(c.image_duplicates);
}

/** A shard's five count cells: read, filtered (per filter in its title), failed, duplicates, kept. */
export function countCells(c) {
  const counts = c || {};
  const drops = counts.filter_drops;
  const cell = (testid, value, title) => h("td", { class: "num", "data-testid": testid, title: title || null },
    num(value));
  return [
    cell("count-read", counts.rows_read),
    cell("count-filtered", drops ? total(drops) : null, drops ? filterText(drops) || "no row filtered" : null),
    cell("count-failed", failed(counts), known(counts.failed_to_resize) && counts.failed_to_resize
      ? `${num(counts.failed_to_download)} to download, ${num(counts.failed_to_resize)} to resize` : null),
    cell("count-duplicates", duplicates(counts), known(duplicates(counts))
      ? `${num(counts.url_duplicates)} url, ${num(counts.image_duplicates)} image` : null),
    cell("count-kept", c ? counts.kept : null),
  ];
}

/** The run's funnel as rows: stage, rows, share of the rows read, detail. */
function funnel(c) {
  const read = c.rows_read;
  const dup = duplicates(c);
  const drops = c.filter_drops;
  const rows = [
    ["Rows read", read, read === null ? "shards from before the counts" : ""],
    ["Filtered", drops ? total(drops) : null, drops ? filterText(drops) || "no filter set" : "unknown"],
    ["Failed to download", failed(c), c.failed_to_resize ? `${num(c.failed_to_resize)} of them to resize` : ""],
    c.holdout ? ["Held out for evaluation", c.holdout, ""] : null,
    ["Duplicates", dup, known(dup) ? `${num(c.url_duplicates)} url, ${num(c.image_duplicates)} image`
      : c.deduplicated ? `unknown: ${c.unhashed_shards || 0} shards without hashes` : "not checked (deduplication off)"],
    ["Kept for training", c.kept, ""],
  ].filter((r) => r);
  return h("table", { class: "table funnel", "data-testid": "dataset-funnel" },
    h("thead", {}, h("tr", {}, ["Stage", "Rows", "Share", ""].map((t) => h("th", { scope: "col" }, t)))),
    h("tbody", {}, rows.map(([stage, n, detail]) => h("tr", { "data-stage": stage },
      h("td", {}, stage), h("td", { class: "num" }, num(n)), h("td", { class: "num" }, share(n, read)),
      h("td", { class: "small muted" }, detail)))));
}

/** The dataset panel: Build dataset index's `$.dataset` (shards, samples) and what was kept and why. */
export function datasetPanel(d) {
  const empty = Number(d.shards_empty || 0);
  const ok = Number(d.shards_ok || 0);
  return [
    h("h2", {}, "Dataset"),
    kvTable([
      ["Shards", `${num(ok - empty)} of ${num(ok + Number(d.shards_failed || 0))} downloaded` +
        `${empty ? `, ${num(empty)} held nothing to train on` : ""}` +
        `${d.shards_failed ? `, ${num(d.shards_failed)} failed` : ""}`],
      ["Training samples", num(d.total_samples)],
      d.holdout_samples ? ["Held-out samples", num(d.holdout_samples)] : null,
      ["Index", h("span", { class: "mono small" }, d.index_uri || "—")],
    ]),
    d.curation ? [h("h3", {}, "What was kept and why"), funnel(d.curation)]
      : h("p", { class: "muted small" }, "No counts: the run was indexed before the counts existed."),
  ];
}
