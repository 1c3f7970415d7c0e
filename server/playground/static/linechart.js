// A small time-series line chart on a <canvas>: a few series over a time window, gaps where a value is null.

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

// series: [{color, points: [[t_ms, value or null]]}]; xMin, xMax: the window (ms);
// yMax: a fixed top (default: a round number above the data); format: a tick's text.
export function drawLineChart(canvas, { series, xMin, xMax, yMax = null, format = (v) => String(v) }) {
  const dpr = window.devicePixelRatio || 1;
  const width = canvas.clientWidth || 400;
  const height = canvas.clientHeight || 160;
  if (canvas.width !== Math.round(width * dpr) || canvas.height !== Math.round(height * dpr)) {
    canvas.width = Math.round(width * dpr);
    canvas.height = Math.round(height * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, width, height);

  let top = 0;
  for (const s of series) for (const [, v] of s.points) if (v !== null && v > top) top = v;
  top = yMax ?? niceMax(top * 1.1);

  const pad = { left: 48, right: 8, top: 8, bottom: 20 };
  const w = width - pad.left - pad.right;
  const h = height - pad.top - pad.bottom;
  const x = (t) => pad.left + ((t - xMin) / (xMax - xMin)) * w;
  const y = (v) => pad.top + h - (v / top) * h;

  ctx.font = "10px ui-monospace, Menlo, Consolas, monospace";
  ctx.lineWidth = 1;
  ctx.strokeStyle = "#e6e9ee";
  ctx.fillStyle = "#5b6776";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (let k = 0; k <= 4; k++) {
    const v = (top * k) / 4;
    const yy = Math.round(y(v)) + 0.5;
    ctx.beginPath();
    ctx.moveTo(pad.left, yy);
    ctx.lineTo(pad.left + w, yy);
    ctx.stroke();
    ctx.fillText(format(v), pad.left - 6, yy);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const span = xMax - xMin;
  for (let k = 0; k <= 5; k++) {
    const t = xMin + (span * k) / 5;
    const secondsAgo = Math.round((xMax - t) / 1000);
    const label = secondsAgo === 0 ? "now" : secondsAgo % 60 === 0 ? `-${secondsAgo / 60}m` : `-${secondsAgo}s`;
    ctx.fillText(label, Math.min(pad.left + w - 10, Math.max(pad.left + 10, x(t))), pad.top + h + 5);
  }

  ctx.save();
  ctx.beginPath();
  ctx.rect(pad.left, pad.top - 2, w, h + 4);
  ctx.clip();
  for (const s of series) {
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 1.75;
    ctx.lineJoin = "round";
    let drawing = false;
    ctx.beginPath();
    const pts = s.points;
    for (let i = 0; i < pts.length; i++) {
      const [t, v] = pts[i];
      if (v === null || v === undefined) {
        drawing = false;
        continue;
      }
      if (drawing) ctx.lineTo(x(t), y(v));
      else ctx.moveTo(x(t), y(v));
      drawing = true;
    }
    ctx.stroke();
    // a point with no neighbour would be invisible as a line: give it a dot
    for (let i = 0; i < pts.length; i++) {
      const v = pts[i][1];
      if (v === null || v === undefined) continue;
      const prev = i > 0 ? pts[i - 1][1] : null;
      const next = i + 1 < pts.length ? pts[i + 1][1] : null;
      if ((prev === null || prev === undefined) && (next === null || next === undefined)) {
        ctx.beginPath();
        ctx.arc(x(pts[i][0]), y(v), 2.5, 0, 2 * Math.PI);
        ctx.fill();
      }
    }
  }
  ctx.restore();
}
