// The kvtier dashboard: polls /api/cluster and draws it (charts from charts.js).
// Inlined into dashboard.html when served. Names are always inserted as text.
"use strict";
const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);

// h("div", {class: "x"}, "text", childNode, ...): strings become text nodes, never markup.
function h(tag, attrs, ...kids) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "style") el.style.cssText = v; else el.setAttribute(k, v);
  }
  for (const kid of kids.flat()) {
    if (kid === null || kid === undefined || kid === false) continue;
    el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
  }
  return el;
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0, v = n;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (i === 0 ? v : v.toFixed(v < 10 ? 2 : v < 100 ? 1 : 0)) + " " + units[i];
}
function count(n) {
  n = n || 0;
  if (n < 1e4) return String(Math.round(n));
  if (n < 1e6) return (n / 1e3).toFixed(1) + "k";
  if (n < 1e9) return (n / 1e6).toFixed(1) + "M";
  return (n / 1e9).toFixed(1) + "G";
}
const pct = (r) => (r === null || r === undefined) ? "\u2013" : (100 * r).toFixed(1) + "%";
const ms = (v) => (v === null || v === undefined) ? "\u2013" : v < 10 ? v.toFixed(2) + " ms" : v < 1000 ? v.toFixed(0) + " ms" : (v / 1000).toFixed(2) + " s";
function duration(sec) {
  sec = Math.floor(sec || 0);
  const d = Math.floor(sec / 86400), hh = Math.floor(sec % 86400 / 3600), m = Math.floor(sec % 3600 / 60);
  return d ? `${d}d ${hh}h` : hh ? `${hh}h ${m}m` : m ? `${m}m ${sec % 60}s` : `${sec}s`;
}
const sumValues = (obj) => Object.values(obj || {}).reduce((a, b) => a + b, 0);

function card(label, value, sub, tone, id) {
  return h("div", {class: "card", "data-card": id || label}, h("div", {class: "label"}, label),
    h("div", {class: "value" + (tone ? " " + tone : ""), "data-value": id || label}, value),
    sub ? h("div", {class: "sub"}, sub) : null);
}

// --- engines -------------------------------------------------------------------------------
function renderEngines(e) {
  const t = e.totals;
  const ratio = t.ttft_ms_hit && t.ttft_ms_miss ? t.ttft_ms_miss / t.ttft_ms_hit : null;
  const speedup = ratio === null ? "" : Math.abs(ratio - 1) < 0.05 ? " (about the same)"
    : ratio > 1 ? ` \u00b7 hits ${ratio.toFixed(1)}\u00d7 faster` : ` \u00b7 hits ${(1 / ratio).toFixed(1)}\u00d7 slower`;
  $("engine-cards").replaceChildren(
    card("prompt-token hit ratio", pct(t.hit_ratio), `${count(t.hit_tokens)} of ${count(t.prompt_tokens)} prompt tokens from cache`,
         t.hit_ratio === null ? "" : "good", "hit_ratio"),
    card("prefill saved", count(t.prefill_tokens_saved) + " tok", `${bytes(t.restored_bytes)} restored \u00b7 ${count(t.lookups)} prompts`, "", "prefill_tokens_saved"),
    card("TTFT with a hit", ms(t.ttft_ms_hit), `mean time to first token \u00b7 without: ${ms(t.ttft_ms_miss)}` + speedup, "", "ttft"),
    card("restore latency", `${ms(t.restore_ms_p50)}`, `p50 \u00b7 p95 ${ms(t.restore_ms_p95)} \u00b7 mean ${ms(t.restore_ms_mean)}`, "", "restore"),
    card("replicas", `${e.reporting} reporting`, e.stopped.length ? `${e.stopped.length} stopped reporting` : "all reporting",
         e.stopped.length ? "bad" : "", "replicas"),
    card("failures", `${count(t.load_failures)} / ${count(t.save_drops)}`, "load failures / save drops",
         t.load_failures || t.save_drops ? "bad" : "", "failures"));
  $("bucket-hint").textContent = `cluster and top models, per ${e.bucket_s} s`;
  const lines = [{name: "cluster", color: "var(--fg)", width: 3, points: e.series.map(([tt, , , r]) => [tt, r])}];
  const models = Object.entries(e.series_by_model);
  if (models.length > 1) models.forEach(([model, pts], i) => {  // one model: its line is the cluster's
    lines.push({name: model, color: COLORS[i % COLORS.length], width: 1.4, points: pts.map(([tt, , , r]) => [tt, r])});
  });
  ratioChart($("ratio-chart"), lines, e.series.map(([tt, p]) => [tt, p]), e.bucket_s);
  valueBars($("tier-chart"), Object.entries(t.hits_per_tier), (v) => count(v) + " tok", "no hits yet");
  valueBars($("miss-chart"), Object.entries(t.misses_per_reason), (v) => count(v) + " tok", "no misses", "var(--c4)");
  const ratioRows = (rows, key) => {
    const max = Math.max(1, ...rows.map((r) => r.prompt_tokens));
    return rows.slice(0, 12).map((r, i) => ({
      label: r[key], frac: r.hit_ratio || 0, color: r.stale ? "var(--warn)" : COLORS[i % COLORS.length],
      mark: r.stale ? "stopped" : "",
      text: `${pct(r.hit_ratio)} \u00b7 ${count(r.prompt_tokens)} tok`,
      title: `${r[key]}: ${pct(r.hit_ratio)} of ${r.prompt_tokens} prompt tokens (${(100 * r.prompt_tokens / max).toFixed(0)}% of the busiest)` +
        (r.nodes ? ` \u00b7 reports to ${r.nodes.join(", ")}` : "")}));
  };
  hbars($("replica-chart"), ratioRows(e.replicas, "replica"), "no engine has reported yet");
  hbars($("model-chart"), ratioRows(e.models, "model"), "no models yet");
  hbars($("tenant-chart"), ratioRows(e.tenants, "tenant"), "no tenants yet");
  $("stopped").replaceChildren(...(e.stopped.length ? [h("div", {class: "sub-h"}, "stopped reporting"),
    h("div", {class: "chips"}, e.stopped.map((r) => h("span", {class: "chip", title: `model ${r.model}, tenant ${r.tenant}`},
      `${r.replica} \u00b7 silent ${duration(r.age_s)}`)))] : []));
  valueBars($("ns-bytes"), e.models.map((m) => [m.model, m.restored_bytes]), bytes, "no restores yet", "var(--c5)");
  // Prefixes are named by their first chunk key: 12 hex digits tell them apart on screen.
  valueBars($("prefix-hits"), e.top_prefixes_by_hits.map((p) => [p.prefix.slice(0, 12), p.hit_tokens]), (v) => count(v) + " tok", "no prefix hits yet", "var(--c1)");
  valueBars($("prefix-bytes"), e.top_prefixes_by_bytes.map((p) => [p.prefix.slice(0, 12), p.restored_bytes]), bytes, "no restores yet", "var(--c3)");
}

// --- storage nodes -------------------------------------------------------------------------
function renderCards(doc) {
  const t = doc.totals || {};
  $("cards").replaceChildren(
    card("chunk hit rate", pct(t.hit_rate), `lookups: ${count(t.hit_chunks)} hit / ${count(t.miss_chunks)} missed chunks` +
         (t.read_miss_chunks ? ` \u00b7 ${count(t.read_miss_chunks)} chunk reads missed` : ""), "", "chunk_hit_rate"),
    card("used", bytes(t.used_bytes), `of ${bytes(t.capacity_bytes)} \u00b7 ${count(t.entries)} chunks`, "", "used"),
    card("bytes in / out", `${bytes(t.bytes_in)}`, `${bytes(t.bytes_out)} out \u00b7 ${count(t.lookups)} lookups`, "", "bytes"),
    card("evictions", count(sumValues(t.evictions)), Object.entries(t.evictions || {}).map(([k, v]) => `${k} ${count(v)}`).join(", ") || "none", "", "evictions"),
    card("nodes", `${doc.nodes_up} up` + (doc.nodes_down ? ` \u00b7 ${doc.nodes_down} down` : ""),
         doc.nodes_down ? "a down node's chunks miss until it is back" : "all answering", doc.nodes_down ? "bad" : "good", "nodes"));
}

const lastSeen = {};  // peer address -> node id, so that a node that went down keeps its name

function renderNode(n) {
  const state = !n.up ? "down" : n.draining ? "draining" : "up";
  if (n.up && n.address !== "self") lastSeen[n.address] = n.node_id;
  const name = n.up ? n.node_id : (lastSeen[n.address] || n.node_id);
  const title = h("h3", {}, h("span", {class: "node-name"}, name),
    n.address && n.address !== name ? h("span", {class: "addr"}, n.address === "self" ? "(this node)" : n.address) : null,
    h("span", {class: "badge " + state, "data-state": state}, state));
  if (!n.up) {
    return h("section", {class: "node down", "data-node": name}, title,
      h("div", {class: "error"}, "not answering: " + (n.error || "unknown error")),
      h("div", {class: "info"}, `gave up after ${n.latency_ms} ms`));
  }
  const t = n.totals;
  const info = h("div", {class: "info"}, `version ${n.version} \u00b7 up ${duration(n.uptime_s)} \u00b7 chunk hit rate ${pct(t.hit_rate)}` +
    (n.address === "self" ? "" : ` \u00b7 stats in ${n.latency_ms} ms`));
  const cap = h("div", {}), traffic = h("div", {}), evict = h("div", {});
  const el = h("section", {class: "node", "data-node": name}, title, info,
    h("div", {class: "sub-h"}, "capacity per tier"), cap, h("div", {class: "sub-h"}, "traffic"), traffic,
    h("div", {class: "sub-h"}, "evictions per tier and reason"), evict);
  // Charts measure their container: draw once the section is in the page.
  el.draw = () => {
    hbars(cap, n.tiers.map((tr, i) => {
      const frac = tr.capacity_bytes ? tr.used_bytes / tr.capacity_bytes : 0;
      return {label: tr.name, frac, color: frac >= 0.98 ? "var(--bad)" : frac >= 0.85 ? "var(--warn)" : COLORS[i % COLORS.length],
              text: `${bytes(tr.used_bytes)} / ${bytes(tr.capacity_bytes)}`};
    }), "no tiers");
    const io = [["bytes in", t.bytes_in], ["bytes out", t.bytes_out]], top = Math.max(1, t.bytes_in, t.bytes_out);
    const chunks = Math.max(1, t.hit_chunks + t.miss_chunks);
    hbars(traffic, [...io.map(([k, v], i) => ({label: k, frac: v / top, color: COLORS[i + 1], text: bytes(v)})),
      {label: "chunk hits", frac: t.hit_chunks / chunks, color: "var(--ok)", text: `${count(t.hit_chunks)} (${pct(t.hit_rate)})`},
      {label: "chunk misses", frac: t.miss_chunks / chunks, color: "var(--c4)", text: count(t.miss_chunks)}]);
    const ev = [];
    for (const tr of n.tiers) for (const [reason, v] of Object.entries(tr.evictions || {})) ev.push([`${tr.name} \u00b7 ${reason}`, v]);
    valueBars(evict, ev, count, "no evictions", "var(--c2)");
  };
  return el;
}

function render(doc) {
  $("served").textContent = "served by " + doc.self;
  $("updated").textContent = "updated " + new Date(doc.generated_at * 1000).toLocaleTimeString();
  const down = doc.nodes.filter((n) => !n.up);
  $("banner").replaceChildren(...(down.length ? [h("div", {class: "warn", id: "down-banner"},
    `${down.length} node${down.length > 1 ? "s" : ""} down: ${down.map((n) => lastSeen[n.address] || n.node_id).join(", ")}`)] : []));
  if (doc.engines) renderEngines(doc.engines);
  renderCards(doc);
  const nodes = doc.nodes.map(renderNode);
  $("nodes").replaceChildren(...nodes);
  nodes.forEach((n) => n.draw && n.draw());
  window.kvtierLast = doc;  // what is on screen (tests compare it with /api/cluster)
  document.body.dataset.rendered = String((Number(document.body.dataset.rendered) || 0) + 1);
}

async function poll() {
  const ctl = new AbortController();
  const timer = setTimeout(() => ctl.abort(), POLL_MS + 2000);
  try {
    const resp = await fetch("/api/cluster", {cache: "no-store", signal: ctl.signal});
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    render(await resp.json());
  } catch (err) {
    $("banner").replaceChildren(h("div", {}, `this server is not answering (${err.message || err}); showing the last figures, retrying`));
  } finally {
    clearTimeout(timer);
    setTimeout(poll, POLL_MS);
  }
}

const THEMES = ["auto", "light", "dark"];
function setTheme(name) {
  if (name === "auto") document.documentElement.removeAttribute("data-theme");
  else document.documentElement.setAttribute("data-theme", name);
  $("theme").textContent = "theme: " + name;
  try { localStorage.setItem("kvtier-theme", name); } catch (e) { /* storage off: session only */ }
}
$("theme").addEventListener("click", () => {
  const cur = document.documentElement.getAttribute("data-theme") || "auto";
  setTheme(THEMES[(THEMES.indexOf(cur) + 1) % THEMES.length]);
});
try { setTheme(localStorage.getItem("kvtier-theme") || "auto"); } catch (e) { setTheme("auto"); }
let resizeTimer = 0;
window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(() => window.kvtierLast && render(window.kvtierLast), 200); });
poll();
