// Attention: a prompt's attention weights (POST /attention) for one layer and head as a query x key heatmap,
// optionally with a sliding window and sink tokens, or both side by side; clicking a row shows where that
// query token looks.

import { apiFetch, errorFrom, sleep } from "./api.js";
import { drawHeatmap, rampColor, tokenLabel } from "./heatmap.js";
import { escapeHTML, hideTooltip, showTooltip } from "./tooltip.js";

const $ = (id) => document.getElementById(id);

const EXAMPLES = [
  ["Sentence", "The quick brown fox jumps over the lazy dog, and then the dog chases the fox back into the woods."],
  ["Repetition", "red green blue yellow purple orange red green blue yellow purple orange red green"],
  ["Code", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"],
];
const RETRIES = 40; // 429s waited out (another attention request is running)

let maps = []; // what each canvas shows: {data, layout}
let selectedRow = null;
let generation = 0; // bumped by every run asked for
let running = false; // a request is in flight
let wanted = false; // a run was asked for since the in-flight one was sent
let started = false;

function setStatus(text, error = false) {
  const el = $("att-status");
  el.textContent = text;
  el.classList.toggle("error", error);
}

function intField(id, min) {
  const v = Number.parseInt($(id).value, 10);
  return Number.isFinite(v) && v >= min ? v : null;
}

async function fetchAttention(body) {
  for (let attempt = 0; ; attempt++) {
    const response = await apiFetch("/attention", { json: body });
    if (response.ok) return response.json();
    const err = await errorFrom(response);
    if (response.status !== 429 || attempt >= RETRIES) throw err;
    await sleep(Math.min(2000, Math.max(150, (err.retryAfter ?? 0.25) * 1000)));
  }
}

function setOptions(select, values, labels) {
  const current = select.value;
  const wanted = values.map(String);
  const have = [...select.options].map((o) => o.value);
  if (have.length === wanted.length && have.every((v, i) => v === wanted[i])) return;
  select.replaceChildren(
    ...values.map((v, i) => {
      const o = document.createElement("option");
      o.value = String(v);
      o.textContent = labels[i];
      return o;
    }),
  );
  if (wanted.includes(current)) select.value = current;
}

function publish() {
  const shown = maps.map((m, i) => ({
    canvas: `att-canvas-${i}`,
    tokens: m.data.tokens,
    token_ids: m.data.token_ids,
    weights: m.data.weights,
    layer: m.data.layer,
    head: m.data.head,
    sliding_window: m.data.sliding_window,
    num_sink_tokens: m.data.num_sink_tokens,
    num_layers: m.data.num_layers,
    num_heads: m.data.num_heads,
    layout: m.layout && { left: m.layout.left, top: m.layout.top, cell: m.layout.cell },
  }));
  const main = shown[shown.length - 1] || null;
  window.playground.attention = main && { ...main, compare: shown.length > 1, maps: shown, selected_row: selectedRow };
}

// Whether key j is hidden from query i: a later token, or outside the window and not a sink.
export function masked(data, i, j) {
  if (j > i) return true;
  const w = data.sliding_window;
  return w !== null && w !== undefined && i - j >= w && j >= data.num_sink_tokens;
}

function availableWidth(compare) {
  const w = $("att-maps").clientWidth || 900;
  return compare ? Math.floor((w - 16) / 2) - 22 : Math.min(w - 22, 1000);
}

function draw() {
  const compare = maps.length > 1;
  let vmax = 0;
  for (const m of maps) for (const row of m.data.weights) for (const v of row) if (v > vmax) vmax = v;
  maps.forEach((m, i) => {
    const t = m.data.tokens;
    m.layout = drawHeatmap($(`att-canvas-${i}`), m.data.weights, {
      rowLabels: t,
      colLabels: t,
      maxWidth: availableWidth(compare),
      vmin: 0,
      vmax: vmax || 1,
      gamma: 0.5,
      isMasked: (r, c) => masked(m.data, r, c),
      selectedRow,
      scaleLabel: "weight",
    });
    const d = m.data;
    const masking = d.sliding_window === null ? "no window" : `window ${d.sliding_window}, ${d.num_sink_tokens} sink`;
    const head = d.head === "mean" ? "mean over heads" : `head ${d.head}`;
    $(`att-cap-${i}`).textContent = `layer ${d.layer} · ${head} · ${masking} · ${t.length} tokens`;
  });
  $("att-canvas-1").parentElement.hidden = !compare;
  drawRow();
  publish();
}

function drawRow() {
  const panel = $("att-row-panel");
  if (selectedRow === null || !maps.length || selectedRow >= maps[0].data.tokens.length) {
    panel.hidden = true;
    return;
  }
  panel.hidden = false;
  const tokens = maps[0].data.tokens;
  $("att-row-title").textContent = `Where token ${selectedRow} "${tokenLabel(tokens[selectedRow], 24)}" looks`;
  const container = $("att-row");
  container.replaceChildren();
  maps.forEach((m, idx) => {
    const line = document.createElement("div");
    line.className = "tokens";
    if (maps.length > 1) {
      const tag = document.createElement("small");
      tag.textContent = idx === 0 ? "without window:" : "with window:";
      tag.style.marginRight = "6px";
      line.append(tag);
    }
    const row = m.data.weights[selectedRow];
    const max = Math.max(...row) || 1;
    tokens.forEach((tok, j) => {
      const span = document.createElement("span");
      span.textContent = tok.replace(/\n/g, "↵");
      const w = row[j];
      const hidden = masked(m.data, selectedRow, j);
      if (hidden) {
        span.style.color = "#9aa3ae";
        span.style.background = "repeating-linear-gradient(135deg, #eef0f3 0 3px, #e0e4e9 3px 5px)";
      } else {
        const [r, g, b] = rampColor(Math.sqrt(w / max));
        span.style.background = `rgb(${r} ${g} ${b} / ${0.25 + 0.55 * Math.sqrt(w / max)})`;
      }
      span.title = `${tokenLabel(tok, 30)}: ${hidden ? "masked" : w.toPrecision(3)}`;
      if (j === selectedRow) span.classList.add("query");
      line.append(span);
    });
    container.append(line);
  });
}

function requestBodies() {
  const prompt = $("att-prompt").value;
  const layer = Number.parseInt($("att-layer").value, 10) || 0;
  const headValue = $("att-head").value;
  const head = headValue === "mean" ? "mean" : Number.parseInt(headValue, 10);
  const base = { prompt, layer, head };
  const windowed = {
    ...base,
    sliding_window: intField("att-window", 1),
    num_sink_tokens: intField("att-sinks", 0) ?? 0,
  };
  const full = { ...base, sliding_window: null, num_sink_tokens: 0 };
  if ($("att-compare").checked) return [full, windowed];
  return [$("att-apply").checked ? windowed : full];
}

// Requests go one at a time (the server computes one attention forward at a time): a run asked for while one
// is in flight is sent when it ends, with the form as it is then; a result already superseded is not drawn.
async function run() {
  if (!$("att-prompt").value.trim()) {
    setStatus("Type a prompt first.", true);
    return;
  }
  const windowWanted = $("att-compare").checked || $("att-apply").checked;
  if (windowWanted && intField("att-window", 1) === null) {
    setStatus("The sliding window must be a whole number of at least 1.", true);
    return;
  }
  generation++;
  wanted = true;
  window.playground.attentionState = "loading";
  setStatus("Computing attention…");
  if (running) return;
  running = true;
  try {
    while (wanted) {
      wanted = false;
      const mine = generation;
      const bodies = requestBodies();
      try {
        const results = [];
        for (const body of bodies) results.push(await fetchAttention(body));
        if (mine === generation) show(results);
      } catch (err) {
        if (mine === generation) {
          setStatus(err.message || String(err), true);
          window.playground.attentionState = "error";
        }
      }
    }
  } finally {
    running = false;
  }
}

function show(results) {
  const first = results[0];
  const layers = [...Array(first.num_layers).keys()];
  const heads = [...Array(first.num_heads).keys()];
  setOptions($("att-layer"), layers, layers.map(String));
  setOptions($("att-head"), ["mean", ...heads], ["mean over heads", ...heads.map((h) => `head ${h}`)]);
  if (selectedRow !== null && selectedRow >= first.tokens.length) selectedRow = null;
  maps = results.map((data) => ({ data, layout: null }));
  draw();
  setStatus(
    `${first.model}: ${first.tokens.length} tokens, ${first.num_layers} layers x ${first.num_heads} heads. ` +
      "Rows are queries, columns keys; click a row to see where that token looks.",
  );
  window.playground.attentionState = "ready";
}

function hover(i, e) {
  const m = maps[i];
  const cell = m && m.layout && m.layout.cellAt(e);
  if (!cell) return hideTooltip();
  const t = m.data.tokens;
  const w = m.data.weights[cell.row][cell.col];
  let what = `weight ${w.toPrecision(4)}`;
  if (masked(m.data, cell.row, cell.col)) what = "masked";
  else if (w === 0) what = "weight below 5e-7";
  showTooltip(
    `query ${cell.row} <b>${escapeHTML(tokenLabel(t[cell.row], 20))}</b><br>` +
      `key ${cell.col} <b>${escapeHTML(tokenLabel(t[cell.col], 20))}</b><br>` +
      what,
    e,
  );
}

function selectRow(row) {
  if (!maps.length) return;
  const n = maps[0].data.tokens.length;
  selectedRow = Math.max(0, Math.min(n - 1, row));
  draw();
}

export function initAttention() {
  const select = $("att-example");
  select.replaceChildren(
    new Option("pick an example…", ""),
    ...EXAMPLES.map(([name], i) => new Option(name, String(i))),
  );
  $("att-prompt").value = EXAMPLES[0][1];
  select.addEventListener("change", () => {
    if (select.value === "") return;
    $("att-prompt").value = EXAMPLES[Number(select.value)][1];
    selectedRow = null;
    run();
  });
  $("att-form").addEventListener("submit", (e) => {
    e.preventDefault();
    selectedRow = null;
    run();
  });
  $("att-prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      $("att-form").requestSubmit();
    }
  });
  for (const id of ["att-layer", "att-head", "att-apply", "att-compare", "att-window", "att-sinks"]) {
    $(id).addEventListener("change", () => {
      if (maps.length) run();
    });
  }
  for (const i of [0, 1]) {
    const canvas = $(`att-canvas-${i}`);
    canvas.addEventListener("mousemove", (e) => hover(i, e));
    canvas.addEventListener("mouseleave", hideTooltip);
    canvas.addEventListener("click", (e) => {
      const cell = maps[i] && maps[i].layout && maps[i].layout.cellAt(e);
      if (cell) selectRow(cell.row);
    });
    canvas.addEventListener("keydown", (e) => {
      if (!maps.length) return;
      const last = maps[0].data.tokens.length - 1;
      const moves = { ArrowUp: -1, ArrowDown: 1, PageUp: -10, PageDown: 10 };
      if (e.key in moves) {
        e.preventDefault();
        selectRow(selectedRow === null ? 0 : selectedRow + moves[e.key]);
      } else if (e.key === "Home" || e.key === "End") {
        e.preventDefault();
        selectRow(e.key === "Home" ? 0 : last);
      }
    });
  }
  let resizeTimer = null;
  window.addEventListener("resize", () => {
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => {
      if (maps.length && !$("view-attention").hidden) draw();
    }, 150);
  });
}

// Called when the view is shown: the first time, take the server's own window settings and draw the example.
export async function showAttention(kvInfo) {
  if (started) {
    if (maps.length) draw(); // the canvas may have been sized while hidden
    return;
  }
  started = true;
  try {
    const info = await kvInfo();
    if (info && info.sliding_window) {
      $("att-window").value = String(info.sliding_window);
      $("att-sinks").value = String(info.num_sink_tokens ?? 0);
      $("att-apply").checked = true;
    }
  } catch {
    // the defaults stay
  }
  if (!maps.length && !running) run();
}
