// The page's one floating tooltip: show(html, event) near the pointer, hide().

let box = null;

function element() {
  if (!box) box = document.getElementById("tooltip");
  return box;
}

export function showTooltip(html, event) {
  const el = element();
  el.innerHTML = html;
  el.hidden = false;
  const pad = 14;
  const { innerWidth, innerHeight } = window;
  const w = el.offsetWidth;
  const h = el.offsetHeight;
  let x = event.clientX + pad;
  let y = event.clientY + pad;
  if (x + w > innerWidth - 4) x = Math.max(4, event.clientX - w - pad);
  if (y + h > innerHeight - 4) y = Math.max(4, event.clientY - h - pad);
  el.style.left = `${x}px`;
  el.style.top = `${y}px`;
}

export function hideTooltip() {
  element().hidden = true;
}

export function escapeHTML(text) {
  const entities = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  return String(text).replace(/[&<>"']/g, (c) => entities[c]);
}
