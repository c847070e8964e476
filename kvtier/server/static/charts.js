// Inline-SVG charts for the kvtier dashboard (inlined into dashboard.html when served).
// Every label is set with textContent: names come from servers and engines and may be hostile.
"use strict";
// The SVG namespace, read from the page's own <svg> (the page spells out no URL at all).
const SVG_NS = document.getElementById("svgns").namespaceURI;
const COLORS = ["var(--c0)", "var(--c1)", "var(--c2)", "var(--c3)", "var(--c4)", "var(--c5)"];

function s(tag, attrs, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = String(text);
  return el;
}

function svg(width, height) {
  return s("svg", {width, height, viewBox: `0 0 ${width} ${height}`, role: "img"});
}

function clip(text, max) {
  text = String(text);
  return text.length > max ? text.slice(0, max - 1) + "\u2026" : text;
}

// Horizontal bars. rows: [{label, frac (0..1), text, color?, title?, mark?}]; one row per bar.
function hbars(el, rows, empty) {
  if (!rows.length) {
    el.replaceChildren(Object.assign(document.createElement("div"), {className: "empty", textContent: empty || "nothing yet"}));
    return;
  }
  const width = Math.max(260, el.clientWidth || 360), rowH = 22;
  const labelW = Math.min(170, Math.round(width * 0.36)), valueW = Math.min(150, Math.round(width * 0.3));
  const barW = Math.max(40, width - labelW - valueW - 12);
  const chart = svg(width, rows.length * rowH + 2);
  rows.forEach((r, i) => {
    const y = i * rowH + 1, g = s("g", {});
    g.append(s("title", {}, r.title || `${r.label}: ${r.text}`));
    g.append(s("text", {x: 0, y: y + 15}, clip(r.label, Math.floor(labelW / 7))));
    g.append(s("rect", {class: "track", x: labelW, y: y + 3, width: barW, height: rowH - 7, rx: 3}));
    const w = Math.max(r.frac > 0 ? 2 : 0, Math.min(1, r.frac || 0) * barW);
    g.append(s("rect", {x: labelW, y: y + 3, width: w.toFixed(1), height: rowH - 7, rx: 3,
                        style: `fill: ${r.color || COLORS[0]}`}));
    if (r.mark) g.append(s("text", {x: labelW + 6, y: y + 15, style: "fill: #fff; font-size: 11px; font-weight: 600"}, r.mark));
    g.append(s("text", {x: labelW + barW + 8, y: y + 15}, r.text));
    chart.append(g);
  });
  el.replaceChildren(chart);
}

// Bars of values on one scale: [[label, value], ...] -> hbars rows (largest first).
function valueBars(el, pairs, fmt, empty, color) {
  const sorted = pairs.filter(([, v]) => v > 0).sort((a, b) => b[1] - a[1]);
  const total = sorted.reduce((a, [, v]) => a + v, 0), max = sorted.length ? sorted[0][1] : 1;
  hbars(el, sorted.map(([label, v], i) => ({
    label, frac: v / max, color: color || COLORS[i % COLORS.length],
    text: `${fmt(v)}  ${total ? (100 * v / total).toFixed(0) + "%" : ""}`})), empty);
}

function clock(t) {
  const d = new Date(t * 1000);
  return d.toTimeString().slice(0, 8);
}

// Ratio lines over time. lines: [{name, color, width, points: [[t, ratio|null]]}];
// volume: [[t, n]] drawn as faint bars behind (the traffic each point stands for).
function ratioChart(el, lines, volume, bucketS) {
  const width = Math.max(320, el.clientWidth || 600), height = 230;
  const left = 42, right = 10, top = 8, bottom = 24, w = width - left - right, hgt = height - top - bottom;
  const xs = volume.map(([t]) => t);
  const t0 = xs.length ? xs[0] : 0, t1 = xs.length ? xs[xs.length - 1] + bucketS : 1;
  const X = (t) => left + (t - t0) / Math.max(1e-9, t1 - t0) * w, Y = (r) => top + (1 - r) * hgt;
  const chart = svg(width, height);
  for (const r of [0, 0.25, 0.5, 0.75, 1]) {
    chart.append(s("line", {class: "gridline", x1: left, x2: left + w, y1: Y(r), y2: Y(r)}));
    chart.append(s("text", {class: "muted", x: left - 6, y: Y(r) + 4, "text-anchor": "end"}, `${r * 100}%`));
  }
  const vmax = Math.max(1, ...volume.map(([, n]) => n));
  for (const [t, n] of volume) {
    if (!n) continue;
    const bh = n / vmax * hgt * 0.35, bw = Math.max(1, w * bucketS / Math.max(1e-9, t1 - t0) - 2);
    chart.append(s("rect", {x: X(t) + 1, y: top + hgt - bh, width: bw, height: bh, style: "fill: var(--muted); opacity: .18"}));
  }
  const ticks = Math.min(6, xs.length);
  for (let i = 0; i < ticks; i++) {
    const t = t0 + (t1 - t0) * i / Math.max(1, ticks - 1);
    chart.append(s("text", {class: "muted", x: X(t), y: height - 6, "text-anchor": i === 0 ? "start" : i === ticks - 1 ? "end" : "middle"}, clock(t)));
  }
  for (const line of lines) {
    let d = "", pen = false;
    for (const [t, r] of line.points) {
      if (r === null || r === undefined) { pen = false; continue; }
      const cx = X(t + bucketS / 2);
      d += `${pen ? "L" : "M"}${cx.toFixed(1)},${Y(r).toFixed(1)}`;
      pen = true;
      const dot = s("circle", {cx, cy: Y(r), r: line.width > 2 ? 3 : 2, style: `fill: ${line.color}`});
      dot.append(s("title", {}, `${line.name} ${clock(t)}: ${(100 * r).toFixed(1)}%`));
      chart.append(dot);
    }
    const faint = line.width > 2 ? "" : "; opacity: .75";  // the cluster line stays on top visually
    if (d) chart.append(s("path", {d, style: `fill: none; stroke: ${line.color}; stroke-width: ${line.width}; stroke-linejoin: round${faint}`}));
  }
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const line of lines) {
    const item = document.createElement("span"), swatch = document.createElement("i");
    swatch.style.background = line.color;
    item.append(swatch, document.createTextNode(line.name));
    legend.append(item);
  }
  const vol = document.createElement("span");
  vol.textContent = "grey bars: prompt tokens looked up per " + bucketS + " s";
  legend.append(vol);
  el.replaceChildren(chart, legend);
}
