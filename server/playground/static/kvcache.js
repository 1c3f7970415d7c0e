// KV cache: polls GET /kv_cache while the view is shown and draws the block pool (every block by state)
// and each running sequence's block table (shared blocks marked, blocks released by the sliding window faded).
// A key that is not an admin's gets the counts only (blocks and sequences null): cards, no grid, no strips.

import { apiJSON } from "./api.js";
import { escapeHTML, hideTooltip, showTooltip } from "./tooltip.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 500;
const STATE_NAMES = { u: "in use", s: "shared", c: "cached, free", f: "free" };

let active = false;
let timer = null;
let inFlight = false;
let last = null;
let gridLayout = null;
const rows = new Map(); // sequence id -> {el, meta, strip}

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
}

let colors = null;
function stateColors() {
  if (!colors) colors = { u: cssVar("--st-u"), s: cssVar("--st-s"), c: cssVar("--st-c"), f: cssVar("--st-f") };
  return colors;
}

function card(label, value, swatch) {
  return (
    `<div class="card"><div class="n">${escapeHTML(value)}</div>` +
    `<div class="k">${swatch ? `<i class="sw ${swatch}"></i>` : ""}${escapeHTML(label)}</div></div>`
  );
}

function drawCards(s) {
  const windowText = s.sliding_window === null ? "none" : `${s.sliding_window} (+${s.num_sink_tokens} sink)`;
  $("kv-cards").innerHTML = [
    card("blocks in use", s.num_used_blocks, "st-u"),
    card("shared", s.num_shared_blocks, "st-s"),
    card("cached, free", s.num_cached_free_blocks, "st-c"),
    card("free", s.num_free_blocks, "st-f"),
    card("running", s.num_running),
    card("waiting", s.num_waiting),
    card("sliding window", windowText),
  ].join("");
  const usage = s.num_blocks ? ((100 * s.num_used_blocks) / s.num_blocks).toFixed(1) : "0";
  $("kv-blockinfo").textContent =
    `${s.num_blocks} blocks of ${s.block_size} tokens · ${usage}% in use · prefix caching ` +
    `${s.prefix_caching ? "on" : "off"}` +
    (s.blocks == null ? " · each block's state and the running sequences: admin keys only" : "");
}

function drawGrid(s) {
  const canvas = $("kv-grid");
  if (s.blocks == null) {
    canvas.width = canvas.height = 0;
    canvas.style.width = canvas.style.height = "0px";
    gridLayout = null;
    return;
  }
  const n = s.blocks.length;
  const width = Math.max(200, canvas.parentElement.clientWidth - 30);
  let cell = Math.floor(Math.sqrt((width * 240) / Math.max(1, n)));
  cell = Math.max(4, Math.min(18, cell));
  const gap = cell >= 7 ? 1 : 0;
  const cols = Math.max(1, Math.floor(width / cell));
  const rowsN = Math.ceil(n / cols);
  const height = Math.max(cell, rowsN * cell);
  const dpr = window.devicePixelRatio || 1;
  const w = cols * cell;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(height * dpr);
    canvas.style.width = `${w}px`;
    canvas.style.height = `${height}px`;
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, height);
  const c = stateColors();
  for (const st of "fcus") {
    ctx.fillStyle = c[st];
    for (let i = 0; i < n; i++) {
      if (s.blocks[i] !== st) continue;
      ctx.fillRect((i % cols) * cell, Math.floor(i / cols) * cell, cell - gap, cell - gap);
    }
  }
  gridLayout = { cell, cols, n };
}

function drawSequences(s) {
  const container = $("kv-seqs");
  const seen = new Set();
  for (const seq of s.sequences || []) {
    seen.add(seq.id);
    let row = rows.get(seq.id);
    if (!row) {
      const el = document.createElement("div");
      el.className = "seq";
      el.dataset.id = String(seq.id);
      const meta = document.createElement("div");
      meta.className = "meta";
      el.append(meta);
      container.append(el);
      row = { el, meta, strips: [] };
      rows.set(seq.id, row);
    }
    // One strip per attention group: a model that mixes full and sliding layers holds a table for each.
    const groups = seq.groups && seq.groups.length ? seq.groups : [{ block_table: seq.block_table, shared: seq.shared }];
    const kinds = s.attention_groups || [];
    const table = groups[0].block_table;
    const released = groups.reduce((n, g) => n + g.block_table.filter((b) => b === 0).length, 0);
    const shared = groups.reduce((n, g) => n + g.shared.filter(Boolean).length, 0);
    const held = groups.reduce((n, g) => n + g.block_table.filter((b) => b !== 0).length, 0);
    row.meta.textContent =
      `sequence ${seq.id} · ${seq.num_tokens} tokens (${seq.num_computed_tokens} computed) · ` +
      (groups.length > 1 ? `${held} blocks in ${groups.length} attention groups` : `${table.length} blocks`) +
      (shared ? ` · ${shared} shared` : "") +
      (released ? ` · ${released} released by the window` : "");
    while (row.strips.length < groups.length) {
      const strip = document.createElement("div");
      strip.className = "strip";
      row.el.append(strip);
      row.strips.push(strip);
    }
    while (row.strips.length > groups.length) row.strips.pop().remove();
    groups.forEach((group, g) => {
      const strip = row.strips[g];
      const kind = kinds[g];
      const label =
        groups.length > 1 && kind
          ? `group ${g}: layers ${kind.layers.join(", ")} · ` +
            (kind.sliding_window === null ? "full attention" : `sliding window ${kind.sliding_window}`)
          : "";
      if (strip.title !== label) strip.title = label;
      const spans = strip.children;
      const entries = group.block_table;
      for (let k = 0; k < entries.length; k++) {
        let span = spans[k];
        if (!span) {
          span = document.createElement("span");
          strip.append(span);
        }
        const id = entries[k];
        const cls = id === 0 ? "blk released" : group.shared[k] ? "blk shared" : "blk";
        if (span.className !== cls) span.className = cls;
        const title =
          (label ? label + " · " : "") +
          (id === 0
            ? `entry ${k}: released by the sliding window`
            : `entry ${k}: block ${id}${group.shared[k] ? " (shared)" : ""}`);
        if (span.title !== title) span.title = title;
      }
      while (spans.length > entries.length) strip.lastElementChild.remove();
    });
  }
  for (const [id, row] of rows) {
    if (seen.has(id)) continue;
    rows.delete(id);
    row.el.classList.add("gone");
    setTimeout(() => row.el.remove(), 500);
  }
}

function render(s) {
  drawCards(s);
  drawGrid(s);
  drawSequences(s);
}

async function poll() {
  timer = null;
  if (!active || document.hidden) return;
  inFlight = true;
  let delay = POLL_MS;
  try {
    const snapshot = await apiJSON("/kv_cache");
    last = snapshot;
    window.playground.kv = snapshot;
    window.playground.kvPolls = (window.playground.kvPolls || 0) + 1;
    if (active) render(snapshot);
    $("kv-status").textContent = "";
    $("kv-status").classList.remove("error");
  } catch (err) {
    $("kv-status").textContent = `Could not read the KV cache: ${err.message || err}`;
    $("kv-status").classList.add("error");
    delay = 2000;
  } finally {
    inFlight = false;
  }
  if (active && !timer) timer = setTimeout(poll, delay);
}

export function showKV() {
  active = true;
  if (last) render(last);
  if (!timer && !inFlight) poll();
}

export function hideKV() {
  active = false;
  clearTimeout(timer);
  timer = null;
}

let infoPromise = null;
// The server's KV settings, read once (the attention view takes its default window from them).
export function kvInfo() {
  if (last) return Promise.resolve(last);
  if (!infoPromise) infoPromise = apiJSON("/kv_cache").catch(() => null);
  return infoPromise;
}

export function initKV() {
  document.addEventListener("visibilitychange", () => {
    if (active && !document.hidden && !timer && !inFlight) poll();
  });
  const canvas = $("kv-grid");
  canvas.addEventListener("mousemove", (e) => {
    if (!gridLayout || !last || last.blocks == null) return;
    const rect = canvas.getBoundingClientRect();
    const col = Math.floor((e.clientX - rect.left) / gridLayout.cell);
    const row = Math.floor((e.clientY - rect.top) / gridLayout.cell);
    const i = row * gridLayout.cols + col;
    if (col < 0 || col >= gridLayout.cols || i < 0 || i >= gridLayout.n) return hideTooltip();
    showTooltip(`block ${i + 1}: ${STATE_NAMES[last.blocks[i]] || last.blocks[i]}`, e);
  });
  canvas.addEventListener("mouseleave", hideTooltip);
  window.addEventListener("resize", () => {
    if (active && last) drawGrid(last);
  });
}
