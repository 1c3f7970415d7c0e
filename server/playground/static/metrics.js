// Metrics: polls GET /metrics (Prometheus text) every 2 s while the page is visible, keeps five minutes of
// samples and charts time to first token, inter-token latency (each the mean over a poll interval, from the
// histograms' _sum and _count), running and waiting requests, and KV-cache usage.

import { apiText } from "./api.js";
import { drawLineChart } from "./linechart.js";

const $ = (id) => document.getElementById(id);
const POLL_MS = 2000;
const WINDOW_MS = 5 * 60 * 1000;

// Each series under kvserve's names first, then vLLM's (a server started with --metrics-names vllm).
const NAMES = {
  ttft: ["kvserve:time_to_first_token_seconds", "vllm:time_to_first_token_seconds"],
  itl: ["kvserve:inter_token_latency_seconds", "vllm:inter_token_latency_seconds"],
  running: ["kvserve:num_requests_running", "vllm:num_requests_running"],
  waiting: ["kvserve:num_requests_waiting", "vllm:num_requests_waiting"],
  kv: ["kvserve:kv_cache_usage_perc", "vllm:kv_cache_usage_perc"],
};

const CHARTS = [
  {
    id: "ttft",
    title: "Time to first token",
    unit: "ms",
    series: [{ key: "ttft_ms", name: "mean per interval", color: "#2457d6" }],
  },
  {
    id: "itl",
    title: "Inter-token latency",
    unit: "ms",
    series: [{ key: "itl_ms", name: "mean per interval", color: "#0f8a6a" }],
  },
  {
    id: "reqs",
    title: "Requests",
    unit: "",
    series: [
      { key: "running", name: "running", color: "#2457d6" },
      { key: "waiting", name: "waiting", color: "#d9822b" },
    ],
  },
  {
    id: "kv",
    title: "KV-cache usage",
    unit: "%",
    yMax: 100,
    series: [{ key: "kv_pct", name: "blocks in use", color: "#8e44c9" }],
  },
];

const samples = []; // {t, ttft_ms, itl_ms, running, waiting, kv_pct}
let previous = null; // the last poll's histogram sums and counts
let timer = null;
let inFlight = false;
let visible = false;
let built = false;

// name -> summed value over all its label sets, for each sample line of a Prometheus text page.
export function parsePrometheus(text) {
  const values = new Map();
  for (const raw of text.split("\n")) {
    const line = raw.trim();
    if (!line || line.startsWith("#")) continue;
    let name;
    let rest;
    const brace = line.indexOf("{");
    const space = line.indexOf(" ");
    if (brace >= 0 && (space < 0 || brace < space)) {
      name = line.slice(0, brace);
      const close = line.lastIndexOf("}");
      rest = line.slice(close + 1).trim();
    } else {
      name = line.slice(0, space);
      rest = line.slice(space + 1).trim();
    }
    const value = Number.parseFloat(rest.split(/\s+/)[0]);
    if (!Number.isFinite(value)) continue;
    values.set(name, (values.get(name) || 0) + value);
  }
  return values;
}

function pick(values, names, suffix = "") {
  for (const n of names) if (values.has(n + suffix)) return values.get(n + suffix);
  return null;
}

function intervalMean(now, prev, key) {
  if (!prev || now[key].count === null || prev[key].count === null) return null;
  const dc = now[key].count - prev[key].count;
  const ds = now[key].sum - prev[key].sum;
  return dc > 0 ? (ds / dc) * 1000 : null;
}

function sample(text) {
  const values = parsePrometheus(text);
  const hist = (key) => ({ sum: pick(values, NAMES[key], "_sum"), count: pick(values, NAMES[key], "_count") });
  const now = { ttft: hist("ttft"), itl: hist("itl") };
  const kv = pick(values, NAMES.kv);
  const point = {
    t: Date.now(),
    ttft_ms: intervalMean(now, previous, "ttft"),
    itl_ms: intervalMean(now, previous, "itl"),
    running: pick(values, NAMES.running),
    waiting: pick(values, NAMES.waiting),
    kv_pct: kv === null ? null : kv * 100,
  };
  previous = now;
  samples.push(point);
  const cutoff = point.t - WINDOW_MS;
  while (samples.length && samples[0].t < cutoff) samples.shift();
  window.playground.metrics = { samples: samples.slice(), last: point };
}

function build() {
  if (built) return;
  built = true;
  $("metrics-charts").replaceChildren(
    ...CHARTS.map((c) => {
      const el = document.createElement("div");
      el.className = "chart";
      const keys = c.series.map((s) => `<span><i style="background:${s.color}"></i>${s.name}</span>`).join("");
      el.innerHTML =
        `<h2><span>${c.title}${c.unit ? ` <small>(${c.unit})</small>` : ""}</span>` +
        `<span class="now" id="now-${c.id}"></span></h2>` +
        `<canvas id="chart-${c.id}" role="img" aria-label="${c.title} over the last five minutes"></canvas>` +
        `<div class="keys">${keys}</div>`;
      return el;
    }),
  );
}

const fmt = (v, unit) => {
  if (v === null || v === undefined) return "–";
  if (unit === "ms") return v >= 100 ? `${v.toFixed(0)} ms` : `${v.toFixed(1)} ms`;
  if (unit === "%") return `${v.toFixed(1)}%`;
  return String(Math.round(v * 100) / 100);
};

function draw() {
  if (!visible) return;
  build();
  const xMax = Date.now();
  const xMin = xMax - WINDOW_MS;
  for (const c of CHARTS) {
    const series = c.series.map((s) => ({ color: s.color, points: samples.map((p) => [p.t, p[s.key]]) }));
    drawLineChart($(`chart-${c.id}`), {
      series,
      xMin,
      xMax,
      yMax: c.yMax ?? null,
      format: (v) => (c.unit === "%" ? `${Math.round(v)}` : v >= 100 ? v.toFixed(0) : String(+v.toFixed(2))),
    });
    const last = samples[samples.length - 1];
    const nowEl = $(`now-${c.id}`);
    if (last) nowEl.textContent = c.series.map((s) => fmt(last[s.key], c.unit)).join(" / ");
  }
  const status = $("metrics-status");
  if (!status.classList.contains("error")) {
    status.textContent = samples.length
      ? `${samples.length} samples, every ${POLL_MS / 1000} s; the last five minutes are kept while this page is open.`
      : "Waiting for the first sample…";
  }
}

async function poll() {
  timer = null;
  if (document.hidden || inFlight) return;
  const status = $("metrics-status");
  inFlight = true;
  try {
    sample(await apiText("/metrics"));
    status.classList.remove("error");
  } catch (err) {
    status.textContent = `Could not read /metrics: ${err.message || err}`;
    status.classList.add("error");
    previous = null;
  } finally {
    inFlight = false;
  }
  draw();
  if (!timer) timer = setTimeout(poll, POLL_MS);
}

export function initMetrics() {
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !timer && !inFlight) poll();
  });
  window.addEventListener("resize", draw);
  // start after the first paint; the history builds up whichever view is shown
  setTimeout(poll, 300);
}

export function showMetrics() {
  visible = true;
  draw();
}

export function hideMetrics() {
  visible = false;
}
