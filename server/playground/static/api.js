// The one way the page talks to the server: adds the API key (kept by the sign-in page in this origin's
// localStorage, when the server has one) as a bearer token, and turns the server's error bodies into ApiError.

const KEY_STORAGE = "kvserve_api_key";

export class ApiError extends Error {
  constructor(status, message, { code = null, type = null, param = null, retryAfter = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
    this.type = type;
    this.param = param;
    this.retryAfter = retryAfter;
  }
}

export function apiKey() {
  try {
    return window.localStorage.getItem(KEY_STORAGE);
  } catch {
    return null; // storage disabled: the server has no key, or the page could not be opened anyway
  }
}

// fetch() with the key; `json` is sent as the JSON body. Resolves to the Response whatever its status.
export function apiFetch(path, { method, json, signal, headers = {} } = {}) {
  const init = { method: method || (json === undefined ? "GET" : "POST"), headers: { ...headers }, signal };
  const key = apiKey();
  if (key) init.headers.Authorization = `Bearer ${key}`;
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  }
  return fetch(path, init);
}

// The ApiError for a response that is not ok (reads its body).
export async function errorFrom(response) {
  let message = `${response.status} ${response.statusText}`;
  let details = {};
  try {
    const body = await response.json();
    const err = body && body.error;
    if (err && typeof err === "object") {
      message = err.message || message;
      details = { code: err.code ?? null, type: err.type ?? null, param: err.param ?? null };
    } else if (body && typeof body.detail === "string") {
      message = body.detail;
    }
  } catch {
    // not JSON: keep the status line
  }
  const retry = Number.parseFloat(response.headers.get("Retry-After"));
  return new ApiError(response.status, message, { ...details, retryAfter: Number.isFinite(retry) ? retry : null });
}

// A JSON request; resolves to the parsed body, rejects with ApiError when the status is not ok.
export async function apiJSON(path, options = {}) {
  const response = await apiFetch(path, options);
  if (!response.ok) throw await errorFrom(response);
  return response.json();
}

// A text request (e.g. /metrics).
export async function apiText(path, options = {}) {
  const response = await apiFetch(path, options);
  if (!response.ok) throw await errorFrom(response);
  return response.text();
}

let modelsPromise = null;

// The served models, fetched once: {generate, embed} are the ids of the generation and embedding models.
export function servedModels() {
  if (!modelsPromise) {
    modelsPromise = apiJSON("/v1/models").then((list) => {
      const data = Array.isArray(list.data) ? list.data : [];
      const byTask = (task) => data.find((m) => m.task === task);
      const generate = byTask("generate") || data.find((m) => m.task !== "embed" && m.task !== "rerank");
      const embed = byTask("embed");
      return {
        generate: generate ? generate.id : null,
        embed: embed ? embed.id : null,
        maxModelLen: generate ? generate.max_model_len : null,
        all: data,
      };
    });
    modelsPromise.catch(() => {
      modelsPromise = null; // let a later call try again
    });
  }
  return modelsPromise;
}

export const sleep = (ms, signal) =>
  new Promise((resolve, reject) => {
    const timer = setTimeout(resolve, ms);
    if (signal) {
      signal.addEventListener(
        "abort",
        () => {
          clearTimeout(timer);
          reject(signal.reason ?? new DOMException("Aborted", "AbortError"));
        },
        { once: true },
      );
    }
  });

export const isAbort = (err) => err && (err.name === "AbortError" || err === "superseded");
