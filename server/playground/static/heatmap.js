// A labelled matrix heatmap on a <canvas>: rows top to bottom, columns left to right, token labels on both
// axes (rotated under the columns), a colour scale on the right. Masked entries (exact zeros with `maskZero`,
// or those `isMasked` names) are drawn hatched grey, outside the colour ramp, so masked attention never looks
// like a small weight.

// Viridis, sampled: dark purple (low) to yellow (high). No stop is grey, so masked cells stand apart.
const RAMP = [
  [68, 1, 84], [72, 40, 120], [62, 74, 137], [49, 104, 142], [38, 130, 142],
  [31, 158, 137], [53, 183, 121], [109, 205, 89], [180, 222, 44], [253, 231, 37],
];

// Masked cells: this fill with this hatch (one-pixel diagonal lines).
export const MASK_FILL = [226, 229, 234];
export const MASK_HATCH = [176, 183, 193];

export function rampColor(t) {
  const x = Math.min(1, Math.max(0, Number.isFinite(t) ? t : 0)) * (RAMP.length - 1);
  const i = Math.min(RAMP.length - 2, Math.floor(x));
  const f = x - i;
  const a = RAMP[i];
  const b = RAMP[i + 1];
  return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
}

const css = (rgb) => `rgb(${rgb[0]},${rgb[1]},${rgb[2]})`;

// What the page shows for a token: whitespace made visible, long ones cut.
export function tokenLabel(text, max = 12) {
  let s = String(text ?? "")
    .replace(/\n/g, "↵")
    .replace(/\t/g, "⇥")
    .replace(/\r/g, "␍")
    .replace(/ /g, "·");
  if (s === "") s = "∅";
  return s.length > max ? `${s.slice(0, max - 1)}…` : s;
}

function hatchPattern(ctx, dpr) {
  const size = 6;
  const tile = document.createElement("canvas");
  tile.width = size;
  tile.height = size;
  const t = tile.getContext("2d");
  t.fillStyle = css(MASK_FILL);
  t.fillRect(0, 0, size, size);
  t.fillStyle = css(MASK_HATCH);
  for (let i = 0; i < size; i++) t.fillRect(size - 1 - i, i, 1, 1);
  const pattern = ctx.createPattern(tile, "repeat");
  if (dpr !== 1 && pattern.setTransform) pattern.setTransform(new DOMMatrix().scale(1 / dpr));
  return pattern;
}

const fmt = (v) => {
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return v.toFixed(2);
  if (a >= 0.01) return v.toFixed(3);
  return v.toExponential(1);
};

// Draws `matrix` (array of rows) on `canvas`. Options:
//   rowLabels, colLabels: strings (tokens); formatLabel: label text from a string (default: tokenLabel);
//   maxWidth: the CSS width to fit in;
//   vmin, vmax: the colour range (default: the matrix's min and max); gamma: t ** gamma before the ramp
//   (< 1 brightens small values); maskZero: exact zeros drawn as masked; isMasked(i, j): which cells are
//   masked, instead of the zeros; selectedRow: outlined row;
//   scaleLabel: the colour scale's title.
// Returns the layout (CSS pixels): {left, top, cell, rows, cols, vmin, vmax, cellAt(event)}.
export function drawHeatmap(canvas, matrix, options = {}) {
  const rows = matrix.length;
  const cols = rows ? matrix[0].length : 0;
  const format = options.formatLabel || ((s) => tokenLabel(s));
  const rowLabels = (options.rowLabels || []).map(format);
  const colLabels = (options.colLabels || []).map(format);
  const maxWidth = Math.max(240, options.maxWidth || 640);
  const gamma = options.gamma ?? 1;
  const maskZero = Boolean(options.maskZero);
  const isMasked = options.isMasked || (maskZero ? (i, j) => matrix[i][j] === 0 : () => false);
  const dpr = window.devicePixelRatio || 1;

  let lo = Infinity;
  let hi = -Infinity;
  matrix.forEach((row, i) =>
    row.forEach((v, j) => {
      if (isMasked(i, j)) return;
      if (v < lo) lo = v;
      if (v > hi) hi = v;
    }),
  );
  const vmin = options.vmin ?? (Number.isFinite(lo) ? lo : 0);
  let vmax = options.vmax ?? (Number.isFinite(hi) ? hi : 1);
  if (!(vmax > vmin)) vmax = vmin + 1;

  const ctx = canvas.getContext("2d");
  const legendW = 64;
  // Cell size first from the widest label allowed, then labels sized to the cell.
  let cell = Math.floor((maxWidth - 90 - legendW) / Math.max(1, cols));
  cell = Math.max(2, Math.min(34, cell));
  const font = Math.min(12, Math.floor(cell * 0.85));
  const step = font >= 7 ? 1 : Math.ceil(8 / Math.max(1, cell)); // label every `step`-th token when cells are tiny
  const labelFont = `${Math.max(font, 8)}px ui-monospace, Menlo, Consolas, monospace`;
  ctx.font = labelFont;
  const widest = (labels) => labels.reduce((w, s) => Math.max(w, ctx.measureText(s).width), 0);
  const rowW = Math.min(96, Math.ceil(widest(rowLabels)) + 8);
  const colW = Math.min(96, Math.ceil(widest(colLabels)) + 8);
  const sin = Math.sin(Math.PI / 3);
  const left = Math.max(rowW, Math.ceil(colW * 0.5) + 4, 24);
  const top = 8;
  const gridW = cell * cols;
  const gridH = cell * rows;
  const bottom = Math.ceil(colW * sin) + 10;
  const width = left + gridW + legendW;
  const barH = Math.max(80, Math.min(gridH, 220));
  const height = Math.max(top + gridH + bottom, top + barH + 44, 140);

  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(height * dpr);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.imageSmoothingEnabled = false;

  // cells: one path per colour would be faster, but a fillRect each is fine up to 256 x 256
  const masked = new Path2D();
  let anyMasked = false;
  const span = vmax - vmin;
  for (let i = 0; i < rows; i++) {
    const row = matrix[i];
    const y = top + i * cell;
    for (let j = 0; j < cols; j++) {
      const v = row[j];
      const x = left + j * cell;
      if (isMasked(i, j)) {
        masked.rect(x, y, cell, cell);
        anyMasked = true;
        continue;
      }
      const t = Math.max(0, (v - vmin) / span);
      ctx.fillStyle = css(rampColor(gamma === 1 ? t : t ** gamma));
      ctx.fillRect(x, y, cell, cell);
    }
  }
  if (anyMasked) {
    ctx.fillStyle = hatchPattern(ctx, dpr);
    ctx.fill(masked);
  }

  // labels
  ctx.fillStyle = "#3b4654";
  ctx.font = labelFont;
  if (font >= 5 || step > 1) {
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i < rows; i += step) {
      ctx.font = i === options.selectedRow ? `bold ${labelFont}` : labelFont;
      ctx.fillText(rowLabels[i] ?? String(i), left - 4, top + (i + 0.5) * cell, rowW - 4);
    }
    ctx.font = labelFont;
    for (let j = 0; j < cols; j += step) {
      ctx.save();
      ctx.translate(left + (j + 0.5) * cell, top + gridH + 4);
      ctx.rotate(-Math.PI / 3);
      ctx.fillText(colLabels[j] ?? String(j), 0, 0, colW - 4);
      ctx.restore();
    }
  }

  // selected row
  if (Number.isInteger(options.selectedRow) && options.selectedRow >= 0 && options.selectedRow < rows) {
    ctx.strokeStyle = "#e8453c";
    ctx.lineWidth = 2;
    ctx.strokeRect(left - 1, top + options.selectedRow * cell - 1, gridW + 2, cell + 2);
  }

  // colour scale
  const barX = left + gridW + 14;
  const grad = ctx.createLinearGradient(0, top + barH, 0, top);
  for (let k = 0; k <= 10; k++) {
    const t = k / 10;
    grad.addColorStop(t, css(rampColor(gamma === 1 ? t : t ** gamma)));
  }
  ctx.fillStyle = grad;
  ctx.fillRect(barX, top, 12, barH);
  ctx.strokeStyle = "#c3cad3";
  ctx.lineWidth = 1;
  ctx.strokeRect(barX + 0.5, top + 0.5, 11, barH - 1);
  ctx.fillStyle = "#3b4654";
  ctx.font = "10px ui-monospace, Menlo, Consolas, monospace";
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  ctx.fillText(fmt(vmax), barX + 15, top);
  ctx.textBaseline = "bottom";
  ctx.fillText(fmt(vmin), barX + 15, top + barH);
  if (options.scaleLabel) {
    ctx.textBaseline = "top";
    ctx.fillText(options.scaleLabel, barX - 2, top + barH + 6);
  }
  if (anyMasked) {
    const y = top + barH + 24;
    ctx.fillStyle = hatchPattern(ctx, dpr);
    ctx.fillRect(barX, y, 12, 12);
    ctx.strokeRect(barX + 0.5, y + 0.5, 11, 11);
    ctx.fillStyle = "#3b4654";
    ctx.textBaseline = "top";
    ctx.fillText("= 0", barX + 15, y + 1);
  }

  return {
    left,
    top,
    cell,
    rows,
    cols,
    vmin,
    vmax,
    width,
    height,
    // the {row, col} under a mouse event, or null
    cellAt(event) {
      const rect = canvas.getBoundingClientRect();
      const x = event.clientX - rect.left - left;
      const y = event.clientY - rect.top - top;
      if (x < 0 || y < 0 || x >= gridW || y >= gridH) return null;
      return { row: Math.floor(y / cell), col: Math.floor(x / cell) };
    },
  };
}
