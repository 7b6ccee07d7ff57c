// Small line charts on a canvas (no library): time on x, one or more series on y.
"use strict";

const PALETTE = ["#1f6feb", "#cf222e", "#1a7f37", "#8250df", "#b08800", "#0a7ea4", "#bc4c00", "#57606a"];

function drawChart(canvas, series, opts) {
  // series: [{name, points: [[t, v], ...], color?}]; opts: {unit, min0}
  opts = opts || {};
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  canvas.width = w * dpr; canvas.height = h * dpr;
  const g = canvas.getContext("2d");
  g.scale(dpr, dpr);
  g.clearRect(0, 0, w, h);
  const pad = {l: 48, r: 8, t: 8, b: 20};
  let t0 = Infinity, t1 = -Infinity, v1 = 0, v0 = opts.min0 === false ? Infinity : 0;
  for (const s of series) for (const [t, v] of s.points) {
    if (v === null || v === undefined) continue;
    t0 = Math.min(t0, t); t1 = Math.max(t1, t); v1 = Math.max(v1, v); v0 = Math.min(v0, v);
  }
  g.font = "11px system-ui, sans-serif";
  g.fillStyle = "#6b7385";
  if (!isFinite(t0)) { g.fillText("no data yet", pad.l, h / 2); return; }
  if (t1 === t0) t1 = t0 + 1;
  if (v1 === v0) v1 = v0 + 1;
  v1 = niceMax(v1);
  const X = t => pad.l + (t - t0) / (t1 - t0) * (w - pad.l - pad.r);
  const Y = v => h - pad.b - (v - v0) / (v1 - v0) * (h - pad.t - pad.b);
  g.strokeStyle = "#e2e5eb"; g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = v0 + (v1 - v0) * i / 4, y = Y(v);
    g.beginPath(); g.moveTo(pad.l, y); g.lineTo(w - pad.r, y); g.stroke();
    g.fillText(fmtNum(v) + (opts.unit || ""), 2, y + 4);
  }
  const span = t1 - t0;
  for (const frac of [0, 0.5, 1]) {
    const t = t0 + span * frac, d = new Date(t * 1000);
    const label = d.toTimeString().slice(0, 8);
    g.fillText(label, Math.min(w - 52, Math.max(pad.l, X(t) - 24)), h - 5);
  }
  series.forEach((s, i) => {
    g.strokeStyle = s.color || PALETTE[i % PALETTE.length]; g.lineWidth = 1.8;
    g.beginPath();
    let started = false;
    for (const [t, v] of s.points) {
      if (v === null || v === undefined) { started = false; continue; }
      if (!started) { g.moveTo(X(t), Y(v)); started = true; } else g.lineTo(X(t), Y(v));
    }
    g.stroke();
  });
}

function niceMax(v) {
  const p = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
  return 10 * p;
}

function fmtNum(v) {
  if (Math.abs(v) >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (Math.abs(v) >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (Math.abs(v) >= 100) return v.toFixed(0);
  if (Math.abs(v) >= 10) return v.toFixed(1);
  return v.toFixed(2).replace(/\.?0+$/, "") || "0";
}

function legendHtml(series) {
  return series.map((s, i) => `<span><i style="background:${s.color || PALETTE[i % PALETTE.length]}"></i>${s.name}</span>`).join("");
}
