// Embeddings: embeds one sentence per line (POST /v1/embeddings), draws their cosine similarities as a
// heatmap and lists each sentence's nearest neighbour.

import { apiJSON, servedModels } from "./api.js";
import { drawHeatmap } from "./heatmap.js";
import { escapeHTML, hideTooltip, showTooltip } from "./tooltip.js";

const $ = (id) => document.getElementById(id);

const EXAMPLES = [
  "The cat curled up on the warm windowsill and fell asleep.",
  "Cooking pasta needs plenty of salted boiling water.",
  "My kitten loves chasing a ball of yarn around the house.",
  "Slice the garlic thinly and fry it gently in olive oil.",
  "Dogs and cats are the most popular household pets.",
  "Bake the bread until the crust turns golden brown.",
];

let shown = null; // {sentences, matrix, layout}
let started = false;
let busy = false;

export function cosineMatrix(vectors) {
  const norms = vectors.map((v) => Math.sqrt(v.reduce((a, x) => a + x * x, 0)) || 1);
  return vectors.map((a, i) =>
    vectors.map((b, j) => {
      let dot = 0;
      for (let k = 0; k < a.length; k++) dot += a[k] * b[k];
      return dot / (norms[i] * norms[j]);
    }),
  );
}

export function nearestNeighbours(matrix) {
  return matrix.map((row, i) => {
    let best = -1;
    for (let j = 0; j < row.length; j++) if (j !== i && (best < 0 || row[j] > row[best])) best = j;
    return best;
  });
}

function setStatus(text, error = false) {
  const el = $("emb-status");
  el.textContent = text;
  el.classList.toggle("error", error);
}

function draw() {
  if (!shown) return;
  const labels = shown.sentences.map((s, i) => `${i + 1}. ${s.length > 14 ? `${s.slice(0, 13)}…` : s}`);
  const w = $("view-embeddings").clientWidth || 900;
  shown.layout = drawHeatmap($("emb-canvas"), shown.matrix, {
    rowLabels: labels,
    colLabels: labels,
    maxWidth: Math.min(620, Math.max(320, w / 2)),
    vmax: 1,
    formatLabel: (s) => s,
    scaleLabel: "cosine",
  });
}

async function run() {
  if (busy) return;
  const sentences = $("emb-text")
    .value.split("\n")
    .map((s) => s.trim())
    .filter(Boolean);
  if (sentences.length < 2) {
    setStatus("Give at least two sentences, one per line.", true);
    return;
  }
  busy = true;
  $("emb-run").disabled = true;
  window.playground.embeddingsState = "loading";
  setStatus("Embedding…");
  try {
    const models = await servedModels();
    if (!models.embed) throw new Error("this server serves no embedding model");
    const answer = await apiJSON("/v1/embeddings", { json: { model: models.embed, input: sentences } });
    const vectors = [...answer.data].sort((a, b) => a.index - b.index).map((d) => d.embedding);
    const matrix = cosineMatrix(vectors);
    const neighbours = nearestNeighbours(matrix);
    shown = { sentences, matrix, layout: null };
    draw();
    const list = $("emb-nn");
    list.replaceChildren(
      ...sentences.map((s, i) => {
        const li = document.createElement("li");
        const j = neighbours[i];
        li.innerHTML =
          `${escapeHTML(s)} <span class="arrow">→</span> ${j + 1}. ${escapeHTML(sentences[j])} ` +
          `<span class="sim">${matrix[i][j].toFixed(3)}</span>`;
        return li;
      }),
    );
    window.playground.embeddings = { sentences, matrix, neighbours, model: models.embed, dims: vectors[0].length };
    window.playground.embeddingsState = "ready";
    setStatus(`${models.embed}: ${sentences.length} sentences, ${vectors[0].length} dimensions.`);
  } catch (err) {
    setStatus(err.message || String(err), true);
    window.playground.embeddingsState = "error";
  } finally {
    busy = false;
    $("emb-run").disabled = false;
  }
}

export function initEmbeddings() {
  $("emb-text").value = EXAMPLES.join("\n");
  $("emb-form").addEventListener("submit", (e) => {
    e.preventDefault();
    run();
  });
  $("emb-text").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      run();
    }
  });
  const canvas = $("emb-canvas");
  canvas.addEventListener("mousemove", (e) => {
    const cell = shown && shown.layout && shown.layout.cellAt(e);
    if (!cell) return hideTooltip();
    const s = shown.sentences;
    showTooltip(
      `${escapeHTML(s[cell.row])}<br>${escapeHTML(s[cell.col])}<br>` +
        `cosine ${shown.matrix[cell.row][cell.col].toFixed(4)}`,
      e,
    );
  });
  canvas.addEventListener("mouseleave", hideTooltip);
}

export function showEmbeddings() {
  if (!started) {
    started = true;
    run();
  } else {
    draw();
  }
}
