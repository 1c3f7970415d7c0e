// Server-sent events as OpenAI streams them: `data: {json}` events, `data: [DONE]` last,
// an error as `data: {"error": {...}}`.

import { ApiError } from "./api.js";

// Yields each event's parsed JSON payload until [DONE] or the end of the body.
// An error payload is thrown as ApiError; an aborted fetch throws its AbortError.
export async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let data = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      let nl;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        let line = buffer.slice(0, nl);
        buffer = buffer.slice(nl + 1);
        if (line.endsWith("\r")) line = line.slice(0, -1);
        if (line === "") {
          if (data.length) {
            const payload = data.join("\n");
            data = [];
            if (payload === "[DONE]") return;
            yield parse(payload);
          }
        } else if (line.startsWith("data:")) {
          data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
        }
        // comments (":") and other fields (event:, id:, retry:) carry nothing the page needs
      }
    }
    if (data.length) {
      const payload = data.join("\n");
      if (payload !== "[DONE]") yield parse(payload);
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

function parse(payload) {
  let event;
  try {
    event = JSON.parse(payload);
  } catch {
    throw new ApiError(0, `unreadable event from the server: ${payload.slice(0, 120)}`);
  }
  if (event && event.error) {
    const e = event.error;
    throw new ApiError(e.code && Number.isInteger(e.code) ? e.code : 500, e.message || "server error", {
      code: e.code ?? null,
      type: e.type ?? null,
      param: e.param ?? null,
    });
  }
  return event;
}
