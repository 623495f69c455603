// #/logs?group=G&stream=S : one log stream, read forward (next_token is CloudWatch's
// nextForwardToken: at the end it gives no events). "Load more" follows next_token; every 3 s
// the last page is fetched again (with the token that produced it) so new lines appear, and
// the following page is taken in when the last one grew.

import { api } from "./api.js";
import { h, replace, fmtTime } from "./dom.js";
import { reportError, clearError } from "./errors.js";
import { Poller } from "./poll.js";

const REFRESH_MS = 3000;

function line(e) {
  return h("div", { class: "log-line", "data-testid": "log-line" },
    h("span", { class: "log-time", title: e.time || null }, e.time ? fmtTime(e.time) : ""),
    h("span", { class: "log-message" }, e.message ?? ""));
}

export function mountLogs(root, ctx, group, stream) {
  document.title = `${stream || group || "Logs"} · sdflow console`;
  const lines = h("div", { class: "log-lines", "data-testid": "log-lines" });
  const more = h("button", { type: "button", "data-testid": "load-more", hidden: true }, "Load more");
  const follow = h("input", { type: "checkbox", checked: true, "data-testid": "auto-refresh" });
  const info = h("p", { class: "muted small", "data-testid": "log-info" });
  replace(root,
    h("p", { class: "crumbs" }, h("a", { href: "#/" }, "Runs"), " / Logs"),
    h("section", { class: "card", "data-testid": "logs" },
      h("div", { class: "card-head" }, h("h1", {}, "Logs"),
        h("label", { class: "small" }, follow, " Auto-refresh every 3 s")),
      h("dl", { class: "log-source" }, h("dt", {}, "Group"), h("dd", { class: "mono" }, group || "—"),
        h("dt", {}, "Stream"), h("dd", { class: "mono" }, stream || "—")),
      lines, h("div", { class: "toolbar" }, more, info)));

  if (!group || !stream) {
    replace(lines, h("p", { class: "muted" }, "The address needs ?group=…&stream=…"));
    return () => {};
  }

  let alive = true;
  // pages: [{token, next, events, el}]; the last one is re-fetched by the refresh
  const pages = [];
  let busy = false;

  const renderPage = (page) => {
    replace(page.el, page.events.map(line));
  };
  const count = () => pages.reduce((n, p) => n + p.events.length, 0);
  const updateMore = () => {
    const last = pages[pages.length - 1];
    more.hidden = !(last && last.next && last.next !== last.token && last.next !== last.exhausted);
    info.textContent = `${count()} line${count() === 1 ? "" : "s"}`;
  };

  /** Fetch the page for `token` and either replace `page` or append a new one. */
  const fetchPage = async (token, page) => {
    const data = await api.logs(group, stream, token);
    if (!alive) return null;
    clearError("page");
    const events = Array.isArray(data.events) ? data.events : [];
    const next = data.next_token || null;
    if (page) {
      const grew = events.length !== page.events.length ||
        (events.length && events[events.length - 1].message !== page.events[page.events.length - 1].message);
      page.events = events;
      page.next = next;
      if (grew) renderPage(page);
      return page;
    }
    if (!events.length) {
      const last = pages[pages.length - 1];
      if (last) last.exhausted = token; // nothing after this page for now
      return null;
    }
    if (!pages.length) lines.replaceChildren(); // drop the "no log lines yet" note
    const created = { token, next, events, exhausted: null, el: h("div", { class: "log-page" }) };
    pages.push(created);
    lines.append(created.el);
    renderPage(created);
    return created;
  };

  const stickToBottom = () => {
    const atBottom = window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
    return () => { if (atBottom) window.scrollTo(0, document.body.scrollHeight); };
  };

  const guarded = async (work) => {
    if (busy) return;
    busy = true;
    const restore = stickToBottom();
    try {
      await work();
      if (alive) restore();
    } catch (err) {
      if (alive) reportError("page", err);
    } finally {
      busy = false;
      if (alive) updateMore();
    }
  };

  const refresh = () => guarded(async () => {
    if (!pages.length) {
      const first = await fetchPage(null, null);
      if (!pages.length && !lines.firstChild) {
        replace(lines, h("p", { class: "muted", "data-testid": "no-logs" }, "No log lines yet."));
      }
      if (first && first.next && first.next !== first.token) {
        await fetchPage(first.next, null); // one look ahead, so "Load more" shows only when there is more
      }
      return;
    }
    const last = pages[pages.length - 1];
    const before = last.events.length;
    await fetchPage(last.token, last);
    if (last.next && last.next !== last.token && last.next !== last.exhausted &&
        last.events.length > before) {
      await fetchPage(last.next, null); // the page filled up: take in what follows
    }
  });

  more.addEventListener("click", () => guarded(async () => {
    const last = pages[pages.length - 1];
    if (!last || !last.next || last.next === last.token) return;
    await fetchPage(last.next, null);
  }));

  const poller = new Poller(async () => {
    await refresh();
    return REFRESH_MS;
  }, REFRESH_MS);
  poller.start();
  follow.addEventListener("change", () => { if (follow.checked) poller.start(); else poller.stop(); });

  return () => { alive = false; poller.stop(); };
}
