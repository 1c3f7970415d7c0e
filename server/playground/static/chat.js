// Chat: streamed replies from /v1/chat/completions with per-token logprobs, multi-turn history, a Stop button
// (and Escape) that aborts the request, and per reply its time to first token and tokens per second.

import { apiFetch, errorFrom, isAbort, servedModels } from "./api.js";
import { sseEvents } from "./sse.js";
import { escapeHTML, hideTooltip, showTooltip } from "./tooltip.js";

const $ = (id) => document.getElementById(id);

const state = {
  streaming: false,
  messages: [], // the conversation sent with each turn (without the system prompt)
  tokens: 0, // tokens of the reply being (or last) streamed
  text: "",
  stats: null,
  finishReason: null,
  error: null,
  stopped: false,
};
let controller = null;
const tokenInfo = new WeakMap(); // reply body element -> its tokens [{token, logprob, top}]

function publish() {
  window.playground.chat = {
    streaming: state.streaming,
    tokens: state.tokens,
    text: state.text,
    messages: state.messages.map((m) => ({ ...m })),
    stats: state.stats,
    finish_reason: state.finishReason,
    error: state.error,
    stopped: state.stopped,
  };
}

function numberField(id) {
  const raw = $(id).value.trim();
  if (raw === "") return null;
  const value = Number(raw);
  return Number.isFinite(value) ? value : null;
}

function requestBody(model) {
  const system = $("p-system").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...state.messages] : [...state.messages];
  const body = {
    model,
    messages,
    stream: true,
    stream_options: { include_usage: true },
    logprobs: true,
    top_logprobs: 5,
  };
  const temperature = numberField("p-temperature");
  const topP = numberField("p-top_p");
  const topK = numberField("p-top_k");
  const maxTokens = numberField("p-max_tokens");
  const seed = numberField("p-seed");
  if (temperature !== null) body.temperature = temperature;
  if (topP !== null) body.top_p = topP;
  if (topK !== null && topK > 0) body.top_k = Math.round(topK);
  if (maxTokens !== null) body.max_tokens = Math.round(maxTokens);
  if (seed !== null) body.seed = Math.round(seed);
  const stop = $("p-stop")
    .value.split(/[,\n]/)
    .map((s) => s.trim())
    .filter(Boolean);
  if (stop.length) body.stop = stop;
  return body;
}

// Background for a token of probability p: green (sure) through yellow to red (unlikely).
export function probColor(p) {
  const q = Math.min(1, Math.max(0, p));
  return `hsl(${Math.round(q * 140)} ${60 + 25 * (1 - q)}% ${80 + 8 * q}%)`;
}

function addMessage(role, text) {
  const log = $("chat-log");
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  el.innerHTML = `<div class="who">${role === "user" ? "You" : "Assistant"}</div><div class="body"></div>`;
  el.querySelector(".body").textContent = text;
  if (role === "assistant") {
    const stats = document.createElement("div");
    stats.className = "stats";
    el.append(stats);
  }
  log.append(el);
  scrollDown(true);
  return el;
}

function scrollDown(force = false) {
  const log = $("chat-log");
  if (force || log.scrollHeight - log.scrollTop - log.clientHeight < 80) log.scrollTop = log.scrollHeight;
}

function statsText(s) {
  const parts = [`${s.tokens} token${s.tokens === 1 ? "" : "s"}`];
  if (s.ttft_ms !== null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.tokens_per_s !== null) parts.push(`${s.tokens_per_s.toFixed(1)} tok/s`);
  return parts.join(" · ");
}

function setStreaming(on) {
  state.streaming = on;
  $("chat-stop").disabled = !on;
  $("chat-send").disabled = on;
  publish();
}

async function send() {
  const input = $("chat-text");
  const text = input.value.trim();
  if (!text || state.streaming) return;
  input.value = "";
  state.messages.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  const body = bubble.querySelector(".body");
  const statsEl = bubble.querySelector(".stats");
  const tokens = [];
  tokenInfo.set(body, tokens);
  bubble.classList.add("streaming");

  Object.assign(state, { tokens: 0, text: "", finishReason: null, error: null, stopped: false });
  const stats = { tokens: 0, ttft_ms: null, tokens_per_s: null };
  state.stats = stats;
  controller = new AbortController();
  setStreaming(true);

  const t0 = performance.now();
  let tFirst = null;
  let usage = null;
  let pending = null; // a frame is scheduled to show the latest stats
  const showStats = () => {
    pending = null;
    statsEl.textContent = statsText(stats);
  };

  try {
    const models = await servedModels();
    const response = await apiFetch("/v1/chat/completions", {
      json: requestBody(models.generate),
      signal: controller.signal,
    });
    if (!response.ok) throw await errorFrom(response);
    for await (const chunk of sseEvents(response)) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.finish_reason) state.finishReason = choice.finish_reason;
      const delta = choice.delta || {};
      const content = delta.content || "";
      const items = (choice.logprobs && choice.logprobs.content) || [];
      if (!content && !items.length) continue;
      const now = performance.now();
      if (tFirst === null) tFirst = now;
      const frag = document.createDocumentFragment();
      const joined = items.map((it) => it.token).join("");
      if (items.length && joined === content) {
        for (const it of items) frag.append(tokenSpan(tokens, it));
      } else {
        // token texts that do not spell the delta (a stop string cut, a partial character): show the text,
        // shaded by the chunk's least likely token
        const worst = items.reduce((a, b) => (a && a.logprob <= b.logprob ? a : b), null);
        frag.append(tokenSpan(tokens, worst ? { ...worst, token: content } : { token: content, logprob: null }));
      }
      body.append(frag);
      state.text += content;
      state.tokens += Math.max(items.length, content ? 1 : 0);
      stats.tokens = state.tokens;
      stats.ttft_ms = tFirst - t0;
      stats.tokens_per_s = state.tokens > 1 && now > tFirst ? ((state.tokens - 1) * 1000) / (now - tFirst) : null;
      publish();
      if (!pending) pending = requestAnimationFrame(showStats);
      scrollDown();
    }
    if (usage && Number.isInteger(usage.completion_tokens)) stats.tokens = usage.completion_tokens;
  } catch (err) {
    if (isAbort(err)) {
      state.stopped = true;
    } else {
      state.error = err.message || String(err);
    }
  } finally {
    if (pending) cancelAnimationFrame(pending);
    bubble.classList.remove("streaming");
    controller = null;
    statsEl.textContent = statsText(stats);
    if (state.stopped) statsEl.append(" · stopped");
    else if (state.finishReason) statsEl.append(` · ${state.finishReason}`);
    if (state.error) {
      const err = document.createElement("span");
      err.className = "error";
      err.textContent = ` ${state.error}`;
      statsEl.append(err);
    }
    if (state.text) {
      state.messages.push({ role: "assistant", content: state.text });
    } else if (state.error) {
      // nothing came back: take the turn out of the history and give the text back to edit
      state.messages.pop();
      if (!$("chat-text").value) $("chat-text").value = text;
    }
    setStreaming(false);
  }
}

function tokenSpan(tokens, item) {
  const span = document.createElement("span");
  span.className = "tok";
  span.textContent = item.token;
  span.dataset.i = String(tokens.length);
  if (item.logprob !== null && item.logprob !== undefined) span.style.background = probColor(Math.exp(item.logprob));
  tokens.push(item);
  return span;
}

function stop() {
  if (controller) controller.abort();
}

function clearChat() {
  stop();
  state.messages = [];
  $("chat-log").replaceChildren();
  publish();
  $("chat-text").focus();
}

function tooltipHTML(item) {
  const rows = [];
  const chosen = item.token;
  const top = Array.isArray(item.top_logprobs) ? item.top_logprobs : [];
  const shown = (t) => escapeHTML(JSON.stringify(t).slice(1, -1));
  const head =
    item.logprob === null || item.logprob === undefined
      ? `<div>${shown(chosen)}</div>`
      : `<div><b>${shown(chosen)}</b> p = ${(Math.exp(item.logprob) * 100).toFixed(1)}%` +
        ` <span style="color:#b9c3d0">(logprob ${item.logprob.toFixed(3)})</span></div>`;
  for (const alt of top) {
    const p = Math.exp(alt.logprob);
    rows.push(
      `<tr class="${alt.token === chosen ? "chosen" : ""}"><td>${shown(alt.token)}</td>` +
        `<td class="p">${(p * 100).toFixed(1)}%</td>` +
        `<td><span class="bar" style="width:${Math.max(1, Math.round(p * 80))}px"></span></td></tr>`,
    );
  }
  return rows.length ? `${head}<table>${rows.join("")}</table>` : head;
}

export function initChat() {
  publish();
  const form = $("chat-form");
  const input = $("chat-text");
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && state.streaming) {
      e.preventDefault();
      stop();
    }
  });
  $("chat-stop").addEventListener("click", stop);
  $("chat-clear").addEventListener("click", clearChat);
  const log = $("chat-log");
  const shade = $("p-shade");
  const applyShade = () => log.classList.toggle("no-shade", !shade.checked);
  shade.addEventListener("change", applyShade);
  applyShade();
  log.addEventListener("mousemove", (e) => {
    const span = e.target.closest && e.target.closest(".tok");
    const tokens = span && tokenInfo.get(span.parentElement);
    if (!tokens) return hideTooltip();
    const item = tokens[Number(span.dataset.i)];
    if (item) showTooltip(tooltipHTML(item), e);
  });
  log.addEventListener("mouseleave", hideTooltip);
}

export function focusChat() {
  $("chat-text").focus();
}
