// The endpoint section ([data-testid=endpoint]): the endpoint's description and a prompt box
// that POSTs {"prompt"} to invoke_url and shows the returned PNG. Errors stay in the section.

import { api } from "./api.js";
import { h, replace, badge, timeEl, kvTable, signature, setText } from "./dom.js";

/** The endpoint deployed by another run since (or rolled back to one): what it serves is not this run's model. */
function otherRun(ep) {
  if (ep.serves_this_run !== false || !ep.config_name) return null;
  const who = ep.serving_run
    ? ["the model of run ", h("a", { href: `#/runs/${encodeURIComponent(ep.serving_run)}` }, ep.serving_run)]
    : ["another run's model"];
  return h("p", { class: "notice", "data-testid": "endpoint-other-run" },
    `Endpoint ${ep.name} now serves `, ...who, ` (config ${ep.config_name}), not this run's. `,
    "The details and the prompt box below are that model's.");
}

export class EndpointSection {
  constructor() {
    this.info = h("div", { class: "part" });
    this.infoSig = undefined;
    this.invokeUrl = null;
    this.busy = false;
    this.input = h("input", { type: "text", class: "prompt-input", "data-testid": "prompt-input",
      placeholder: "a photo of an astronaut riding a horse", "aria-label": "Prompt",
      maxlength: 1000 });
    this.submit = h("button", { type: "submit", class: "primary", "data-testid": "prompt-submit" },
      "Generate");
    this.status = h("p", { class: "small muted prompt-status", "data-testid": "prompt-status" });
    this.error = h("div", { class: "inline-error", "data-testid": "prompt-error", hidden: true });
    this.result = h("div", { class: "prompt-result" });
    const form = h("form", { class: "prompt-form", onsubmit: (ev) => { ev.preventDefault(); this.run(); } },
      this.input, this.submit);
    this.el = h("section", { class: "card", "data-testid": "endpoint" },
      h("h2", {}, "Endpoint"), this.info,
      h("h3", {}, "Try a prompt"), form, this.status, this.error, this.result);
  }

  update(ep) {
    this.invokeUrl = ep.invoke_url || null;
    const sig = signature(ep);
    if (sig === this.infoSig) return;
    this.infoSig = sig;
    const variants = Array.isArray(ep.variants) ? ep.variants : [];
    replace(this.info, otherRun(ep), h("div", { class: "grid-2" },
      kvTable([
        ["Name", h("span", { "data-testid": "endpoint-name" }, ep.name || "—")],
        ["Status", badge(ep.status, "endpoint-status")],
        ["Config", ep.config_name || "—"],
        ["Created", timeEl(ep.created)],
        ["Last modified", timeEl(ep.last_modified)],
        ep.failure_reason ? ["Failure", h("span", { class: "failure" }, ep.failure_reason)] : null,
      ]),
      h("div", {}, h("h3", {}, "Variants"),
        variants.length ? h("table", { class: "table", "data-testid": "variants" },
          h("thead", {}, h("tr", {}, ["Variant", "Instance type", "Count", "Model"].map((t) =>
            h("th", { scope: "col" }, t)))),
          h("tbody", {}, variants.map((v) => h("tr", {}, h("td", {}, v.name || "—"),
            h("td", {}, v.instance_type || "—"), h("td", { class: "num" }, String(v.instance_count ?? "—")),
            h("td", {}, v.model_name || "—")))))
          : h("p", { class: "muted small" }, "No variants."))));
  }

  showError(err) {
    const message = String((err && err.message) || "Something went wrong");
    const hint = err && err.hint ? String(err.hint) : null;
    replace(this.error, h("strong", {}, message), hint ? h("span", {}, ` ${hint}`) : null);
    this.error.hidden = false;
  }

  async run() {
    if (this.busy) return;
    const prompt = this.input.value.trim();
    this.error.hidden = true;
    if (!prompt) { this.showError({ message: "Type a prompt first." }); return; }
    if (!this.invokeUrl) { this.showError({ message: "This endpoint has no invoke URL." }); return; }
    this.busy = true;
    this.submit.disabled = true;
    setText(this.status, "Generating…");
    this.result.replaceChildren();
    const started = performance.now();
    try {
      const answer = await api.invoke(this.invokeUrl, prompt);
      if (!answer || typeof answer.image !== "string" || !answer.image) {
        throw { message: "The endpoint answered without an image." };
      }
      const seconds = Number(answer.seconds);
      const shown = Number.isFinite(seconds) ? seconds : (performance.now() - started) / 1000;
      replace(this.result,
        h("img", { src: `data:image/png;base64,${answer.image}`, alt: prompt,
          "data-testid": "prompt-image" }),
        h("p", { class: "small muted", "data-testid": "prompt-seconds" },
          `${shown.toFixed(1)} s · “${prompt}”`));
      setText(this.status, "");
    } catch (err) {
      setText(this.status, "");
      this.showError(err);
    } finally {
      this.busy = false;
      this.submit.disabled = false;
    }
  }
}
