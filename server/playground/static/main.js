// The page's entry: the tabs (buttons in a tablist, Enter / Space to pick, arrow keys to move, the view in
// the URL's #hash) and each view's start; `window.playground` holds what each view last drew.

import { servedModels } from "./api.js";
import { initAttention, showAttention } from "./attention.js";
import { focusChat, initChat } from "./chat.js";
import { initEmbeddings, showEmbeddings } from "./embeddings.js";
import { hideKV, initKV, kvInfo, showKV } from "./kvcache.js";
import { hideMetrics, initMetrics, showMetrics } from "./metrics.js";

window.playground = window.playground || {};

const VIEWS = {
  chat: { show: () => {}, hide: () => {} },
  attention: { show: () => showAttention(kvInfo), hide: () => {} },
  kv: { show: showKV, hide: hideKV },
  embeddings: { show: showEmbeddings, hide: () => {} },
  metrics: { show: showMetrics, hide: hideMetrics },
};

const tabs = [...document.querySelectorAll('[role="tab"]')];
let current = null;

function select(name, { focus = false, updateHash = true } = {}) {
  if (!(name in VIEWS)) name = "chat";
  if (name === current) return;
  for (const tab of tabs) {
    const on = tab.dataset.view === name;
    tab.setAttribute("aria-selected", String(on));
    document.getElementById(tab.getAttribute("aria-controls")).hidden = !on;
  }
  if (current) VIEWS[current].hide();
  current = name;
  window.playground.view = name;
  if (updateHash && location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  VIEWS[name].show();
  if (focus && name === "chat") focusChat();
}

function initTabs() {
  for (const tab of tabs) {
    tab.addEventListener("click", () => select(tab.dataset.view));
    tab.addEventListener("keydown", (e) => {
      const i = tabs.indexOf(tab);
      let next = null;
      if (e.key === "ArrowRight") next = tabs[(i + 1) % tabs.length];
      else if (e.key === "ArrowLeft") next = tabs[(i - 1 + tabs.length) % tabs.length];
      else if (e.key === "Home") next = tabs[0];
      else if (e.key === "End") next = tabs[tabs.length - 1];
      if (next) {
        e.preventDefault();
        next.focus();
      }
    });
  }
  window.addEventListener("hashchange", () => select(location.hash.slice(1), { updateHash: false }));
}

async function showModels() {
  const el = document.getElementById("models");
  try {
    const m = await servedModels();
    el.textContent = [m.generate, m.embed].filter(Boolean).join(" · ");
    el.title = "served models (GET /v1/models)";
    window.playground.models = m;
  } catch (err) {
    el.innerHTML = "";
    const span = document.createElement("span");
    span.className = "err";
    span.textContent =
      err.status === 401 ? "API key missing or wrong: log in to set it" : `server unreachable: ${err.message || err}`;
    el.append(span);
  }
}

initChat();
initAttention();
initKV();
initEmbeddings();
initMetrics();
initTabs();
select(location.hash.slice(1) || "chat", { updateHash: false });
showModels();
window.playground.ready = true;
