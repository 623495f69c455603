// The JSON API client (API.md). Every call resolves to the parsed body or rejects with an
// ApiError carrying the server's {code, message, hint}; network failures become an ApiError
// with code "network". Nothing here throws anything else.

const GET_TIMEOUT_MS = 20000;
const INVOKE_TIMEOUT_MS = 600000;

export class ApiError extends Error {
  constructor(code, message, hint, status) {
    super(message);
    this.name = "ApiError";
    this.code = code;
    this.hint = hint || null;
    this.status = status || 0;
  }
}

async function request(path, options = {}, timeoutMs = GET_TIMEOUT_MS) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), timeoutMs);
  let response;
  try {
    response = await fetch(path, {
      ...options, signal: controller.signal, cache: "no-store",
      headers: { Accept: "application/json", ...(options.headers || {}) },
    });
  } catch (err) {
    clearTimeout(timer);
    const timedOut = err && err.name === "AbortError";
    throw new ApiError("network",
      timedOut ? "The console server did not answer in time" : "Cannot reach the console server",
      "Is `sdflow console` still running? The page keeps retrying.");
  }
  let body = null;
  let parsed = false;
  try {
    const text = await response.text();
    if (text) { body = JSON.parse(text); parsed = true; }
  } catch (_err) {
    parsed = false;
  } finally {
    clearTimeout(timer);
  }
  if (!response.ok) {
    const err = parsed && body && typeof body === "object" ? body.error : null;
    if (err && typeof err === "object") {
      throw new ApiError(String(err.code || response.status),
        String(err.message || `HTTP ${response.status}`),
        err.hint === null || err.hint === undefined ? null : String(err.hint), response.status);
    }
    throw new ApiError(String(response.status),
      `HTTP ${response.status} ${response.statusText || ""}`.trim(), null, response.status);
  }
  if (!parsed) {
    throw new ApiError("bad_response", `The server answered ${path} with something that is not JSON`,
      null, response.status);
  }
  return body;
}

const enc = encodeURIComponent;

function query(params) {
  const q = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value !== null && value !== undefined && value !== "") q.set(key, value);
  }
  const text = q.toString();
  return text ? `?${text}` : "";
}

export const api = {
  overview: () => request("/api/overview"),
  run: (name) => request(`/api/runs/${enc(name)}`),
  state: (run, state) => request(`/api/runs/${enc(run)}/states/${enc(state)}`),
  children: (run, state, status, nextToken) =>
    request(`/api/runs/${enc(run)}/maps/${enc(state)}/children` +
      query({ status, next_token: nextToken })),
  logs: (group, stream, nextToken) =>
    request(`/api/logs${query({ group, stream, next_token: nextToken })}`),
  invoke: (invokeUrl, prompt) => request(invokeUrl, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ prompt }),
  }, INVOKE_TIMEOUT_MS),
};

/** Any thrown value as an ApiError (so callers can always show message + hint). */
export function asApiError(err) {
  if (err instanceof ApiError) return err;
  return new ApiError("client", "Something went wrong in the page", String(err && err.message || err));
}
