// PolarKV status page: polls every shard's /v1/stats, /v1/nodes and /v1/events, sums
// the shards (as `polarkv admin` does), keeps a short history in this tab and draws it.
// No framework and no build step: the manager serves this file as it is.
"use strict";

const params = new URLSearchParams(location.search);
const POLL_MS = Math.max(250, Number(params.get("interval")) || 2000);
const HISTORY = 180;              // samples kept for the charts (6 minutes at 2 s)
const TOKEN_KEY = "polarkv.token";
// Fields of /v1/stats that are not additive: node counts come from the merged node list.
const NOT_SUMMED = new Set(["nodes", "nodes_dead"]);
const BYTES = new Set(["bytes_memory", "capacity_memory", "bytes_disk", "capacity_disk"]);

const $ = sel => document.querySelector(sel);
const history = [];               // {t, total}
// The shards this page reads: the ones its own origin names (manager.shard_urls, in
// shard order), or that origin alone. Nothing else is ever contacted (see shards()).
let SHARDS = [];
let eventSeq = [];
let events = new Map();           // shard/event id -> event
let paused = false;
let timer = null;

function token() { return sessionStorage.getItem(TOKEN_KEY) || ""; }

const trimmed = url => url.trim().replace(/\/+$/, "");

// Which shards to read: asked of this page's own origin, the one address the page can
// trust. A `?shards=` in the address is never followed (a link could point it, and the
// token typed here, anywhere): URLs in it that the manager does not list are named as
// refused, and the manager's own list is read either way.
async function shards() {
  const resp = await fetch(location.origin + "/healthz", {cache: "no-store", redirect: "error"});
  if (!resp.ok) throw new Error("/healthz: HTTP " + resp.status);
  const known = ((await resp.json()).shard_urls || []).map(trimmed);
  const list = known.length ? known : [location.origin];
  const asked = (params.get("shards") || "").split(",").map(trimmed).filter(Boolean);
  const refused = asked.filter(url => !list.includes(url));
  const notes = [];
  if (refused.length) notes.push("Not contacted (not one of this manager's shards, manager.shard_urls): " + refused.join(", "));
  // the shards answer pages from their own listed origins only (CORS)
  if (!list.some(url => new URL(url).origin === location.origin)) notes.push("Open this page at one of " + list.join(", "));
  $("#refused").hidden = !notes.length;
  $("#refused").textContent = notes.join(". ");
  return list;
}

async function get(shard, path) {
  if (!SHARDS.includes(shard)) throw new Error(shard + " is not one of this manager's shards");
  const headers = token() ? {Authorization: "Bearer " + token()} : {};
  const resp = await fetch(shard + path, {headers, cache: "no-store", redirect: "error"});
  if (resp.status === 401 || resp.status === 403) throw Object.assign(new Error("token refused"), {auth: true});
  if (!resp.ok) throw new Error(path + ": HTTP " + resp.status);
  return resp.json();
}

async function pollShard(shard, i) {
  try {
    const [stats, nodes, ev] = await Promise.all([
      get(shard, "/v1/stats"), get(shard, "/v1/nodes"), get(shard, "/v1/events?since=" + eventSeq[i]).catch(() => null)]);
    return {shard, stats, nodes: nodes.nodes, events: ev};
  } catch (err) {
    return {shard, error: err};
  }
}

function mergeNodes(answers) {
  const byId = new Map();
  answers.forEach((a, index) => {
    if (!a.nodes) return;
    for (const n of a.nodes) {
      const row = byId.get(n.id);
      if (!row) { byId.set(n.id, {...n, shards: [index]}); continue; }
      row.shards.push(index);
      for (const k of ["memory_used", "memory_capacity", "keys_memory", "bytes_memory", "disk_used", "disk_capacity", "keys_disk"])
        row[k] = (row[k] || 0) + (n[k] || 0);
      if (n.state !== "alive") row.state = n.state;
      row.draining = row.draining || n.draining;
      row.last_heartbeat = Math.max(row.last_heartbeat || 0, n.last_heartbeat || 0);
    }
  });
  return [...byId.values()].sort((a, b) => (a.state !== "alive") - (b.state !== "alive") || String(a.id).localeCompare(String(b.id)));
}

function sumStats(answers, nodes) {
  const total = {};
  for (const a of answers) {
    if (!a.stats) continue;
    for (const [k, v] of Object.entries(a.stats))
      if (typeof v === "number" && !NOT_SUMMED.has(k)) total[k] = (total[k] || 0) + v;
  }
  if (answers.length > 1) {
    total.nodes = nodes.filter(n => n.state === "alive").length;
    total.nodes_dead = nodes.length - total.nodes;
  } else if (answers[0].stats) {
    total.nodes = answers[0].stats.nodes;
    total.nodes_dead = answers[0].stats.nodes_dead;
  }
  return total;
}

// -- formatting ----------------------------------------------------------------------

const int = n => (n === undefined || n === null) ? "–" : Math.round(n).toLocaleString("en-US");
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? n.toFixed(1) + " " + units[i] : n + " B";
}
const pct = r => r === null || r === undefined || isNaN(r) ? "–" : (100 * r).toFixed(1) + "%";
const rate = r => r === null || r === undefined ? "–" : r < 10 ? r.toFixed(1) : int(r);
function hitRate(s) { const asked = (s.hits || 0) + (s.misses || 0); return asked ? s.hits / asked : null; }
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const c of children) e.append(c instanceof Node ? c : String(c));
  return e;
}
function bar(used, capacity, cls) {
  const b = el("div", {class: "bar"});
  const fill = el("i", cls ? {class: cls} : {});
  fill.style.width = capacity ? Math.min(100, 100 * used / capacity).toFixed(1) + "%" : "0";
  b.append(fill);
  return b;
}

// -- rendering -----------------------------------------------------------------------

function renderStats(total) {
  for (const e of document.querySelectorAll("[data-stat]")) {
    const k = e.dataset.stat;
    const v = k === "hit_rate" ? hitRate(total) : total[k];
    e.dataset.value = v === null || v === undefined ? "" : String(v);
    e.textContent = k === "hit_rate" ? pct(v) : BYTES.has(k) ? bytes(v || 0) : int(v);
  }
  $("#memory-bar").style.width = total.capacity_memory ? (100 * total.bytes_memory / total.capacity_memory).toFixed(1) + "%" : "0";
  $("#disk-bar").style.width = total.capacity_disk ? (100 * total.bytes_disk / total.capacity_disk).toFixed(1) + "%" : "0";
}

function rates() {
  // Per second over the last interval; hits stand for loads (chunks served), commits
  // for stores (chunks stored).
  if (history.length < 2) return {};
  const [a, b] = history.slice(-2);
  const dt = (b.t - a.t) / 1000;
  const out = {};
  for (const k of ["commits", "lookups", "hits", "misses", "offloads", "reloads"]) out[k] = Math.max(0, (b.total[k] - a.total[k]) / dt);
  return out;
}

function renderRates() {
  const r = rates();
  for (const e of document.querySelectorAll("[data-rate]")) {
    const k = e.dataset.rate === "lookups" ? "hits" : e.dataset.rate;
    e.dataset.value = r[k] === undefined ? "" : String(r[k]);
    e.textContent = rate(r[k]);
  }
}

function renderNodes(nodes) {
  const now = Date.now() / 1000;
  const body = $("#nodes tbody");
  body.replaceChildren(...nodes.map(n => {
    const state = n.draining && n.state === "alive" ? "draining" : n.state;
    return el("tr", {"data-node": n.id},
      el("td", {}, n.id),
      el("td", {}, el("span", {class: "state " + state}, state)),
      el("td", {}, n.address || ""),
      el("td", {"data-field": "memory_used", "data-value": n.memory_used}, bar(n.memory_used, n.memory_capacity), bytes(n.memory_used) + " / " + bytes(n.memory_capacity)),
      el("td", {"data-field": "disk_used", "data-value": n.disk_used}, n.disk_capacity ? bar(n.disk_used, n.disk_capacity, "disk") : "", n.disk_capacity ? bytes(n.disk_used) + " / " + bytes(n.disk_capacity) : "no disk"),
      el("td", {class: "num", "data-field": "keys_memory"}, int(n.keys_memory)),
      el("td", {class: "num", "data-field": "keys_disk"}, int(n.keys_disk)),
      el("td", {class: "num"}, n.last_heartbeat ? Math.max(0, now - n.last_heartbeat).toFixed(1) + " s ago" : "–"),
      el("td", {}, n.shards.join(",")));
  }));
  if (!nodes.length) body.replaceChildren(el("tr", {}, el("td", {colspan: 9, class: "muted"}, "no nodes registered")));
}

function renderShards(answers) {
  $("#shard-section").hidden = answers.length < 2;
  $("#shard-table tbody").replaceChildren(...answers.map((a, i) => a.stats
    ? el("tr", {}, el("td", {}, i + " " + a.shard), el("td", {}, el("span", {class: "state alive"}, "up")),
        el("td", {class: "num"}, int(a.stats.keys_memory)), el("td", {class: "num"}, int(a.stats.keys_disk)),
        el("td", {class: "num"}, pct(hitRate(a.stats))), el("td", {class: "num"}, int(a.stats.commits)),
        el("td", {class: "num"}, int(a.stats.lookups)))
    : el("tr", {}, el("td", {}, i + " " + a.shard), el("td", {colspan: 6}, el("span", {class: "state dead"}, "unreachable"), " " + a.error.message))));
}

function renderEvents(answers) {
  answers.forEach((a, i) => {
    if (!a.events) return;
    const fresh = a.events.events || [];
    if (fresh.length) eventSeq[i] = fresh[fresh.length - 1].seq;
    for (const e of fresh) { e.shard_index = i; events.set(i + "/" + e.id, e); }  // a folded repeat replaces its first copy
  });
  const recent = [...events.values()].sort((x, y) => y.time - x.time).slice(0, 100);
  events = new Map(recent.map(e => [e.shard_index + "/" + e.id, e]));
  const list = $("#events");
  list.replaceChildren(...recent.map(e => el("li", {class: e.level, "data-kind": e.kind},
    el("time", {}, new Date(e.time * 1000).toLocaleTimeString()),
    e.message + (e.subject ? " — " + e.subject : "") + (e.count > 1 ? " (×" + e.count + ")" : "") + (SHARDS.length > 1 ? " [shard " + e.shard_index + "]" : ""))));
  if (!recent.length) list.replaceChildren(el("li", {class: "muted"}, "nothing yet"));
}

// -- charts: inline SVG, drawn here --------------------------------------------------

const W = 600, H = 180, PAD = {l: 44, r: 8, t: 18, b: 18};

function drawChart(svg, series, opts) {
  const ns = "http://www.w3.org/2000/svg";
  const mk = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const values = series.flatMap(s => s.points.map(p => p[1]).filter(v => v !== null));
  const max = opts.max || Math.max(1, ...values) * 1.1;
  // The x axis spans the history this tab has (at least 10 polls), so a freshly
  // opened page is readable at once.
  const t1 = Date.now();
  const t0 = t1 - Math.max(history.length ? t1 - history[0].t : 0, 10 * POLL_MS);
  const x = t => PAD.l + (W - PAD.l - PAD.r) * (t - t0) / (t1 - t0);
  const y = v => H - PAD.b - (H - PAD.t - PAD.b) * v / max;
  const parts = [];
  for (const f of [0, 0.5, 1]) {
    parts.push(mk("line", {class: "grid", x1: PAD.l, x2: W - PAD.r, y1: y(max * f), y2: y(max * f)}));
    parts.push(mk("text", {x: PAD.l - 4, y: y(max * f) + 4, "text-anchor": "end"}, opts.fmt(max * f)));
  }
  const span = (t1 - t0) / 1000;
  parts.push(mk("text", {x: PAD.l, y: H - 4}, span < 120 ? "-" + Math.round(span) + " s" : "-" + Math.round(span / 60) + " min"));
  parts.push(mk("text", {x: W - PAD.r, y: H - 4, "text-anchor": "end"}, "now"));
  let lx = W - PAD.r;
  for (const s of [...series].reverse()) {
    const legend = mk("text", {x: lx, y: 12, "text-anchor": "end", class: "legend"}, s.name);
    legend.style.fill = s.color;  // CSSOM, not a style attribute: the page's CSP allows no inline style
    parts.push(legend);
    lx -= 9 * s.name.length + 14;
  }
  for (const s of series) {  // in order: later series draw over earlier ones
    let d = "", pen = "M";
    for (const [t, v] of s.points) {
      if (v === null) { pen = "M"; continue; }
      d += pen + x(t).toFixed(1) + "," + y(v).toFixed(1) + " ";
      pen = "L";
    }
    parts.push(mk("path", {class: "series", d: d.trim(), stroke: s.color, "stroke-width": s.width || 2, "data-series": s.name, "data-points": s.points.filter(p => p[1] !== null).length}));
  }
  svg.replaceChildren(...parts);
}

function deltas(fn) {
  const out = [];
  for (let i = 1; i < history.length; i++) {
    const a = history[i - 1], b = history[i];
    out.push([b.t, fn(a.total, b.total, (b.t - a.t) / 1000)]);
  }
  return out;
}

function renderCharts() {
  const d = (a, b, k) => Math.max(0, (b[k] || 0) - (a[k] || 0));
  const share = k => (a, b) => { const asked = d(a, b, "hits") + d(a, b, "misses"); return asked ? d(a, b, k) / asked : null; };
  const per = k => (a, b, dt) => d(a, b, k) / dt;
  const css = getComputedStyle(document.documentElement);
  const c = n => css.getPropertyValue(n).trim();
  drawChart($("#chart-hits"), [
    {name: "all", color: c("--miss"), width: 6, points: deltas(share("hits"))},
    {name: "memory", color: c("--mem"), points: deltas(share("hits_memory"))},
    {name: "disk", color: c("--disk"), points: deltas(share("hits_disk"))}], {max: 1, fmt: v => Math.round(100 * v) + "%"});
  drawChart($("#chart-ops"), [
    {name: "stores", color: c("--mem"), points: deltas(per("commits"))},
    {name: "loads", color: c("--ok"), points: deltas(per("hits"))},
    {name: "misses", color: c("--bad"), points: deltas(per("misses"))}], {fmt: rate});
  drawChart($("#chart-tier"), [
    {name: "offloads", color: c("--disk"), points: deltas(per("offloads"))},
    {name: "reloads", color: c("--mem"), points: deltas(per("reloads"))}], {fmt: rate});
}

// -- the loop ------------------------------------------------------------------------

async function poll() {
  timer = null;
  if (!SHARDS.length) {
    try {
      SHARDS = await shards();
    } catch (err) {
      $("#problem").hidden = false;
      $("#problem").textContent = "this manager is unreachable: " + err.message;
      if (!paused) timer = setTimeout(poll, POLL_MS);
      return;
    }
    eventSeq = SHARDS.map(() => 0);
    $("#shards").textContent = SHARDS.length > 1 ? SHARDS.length + " shards" : SHARDS[0].replace(/^https?:\/\//, "");
  }
  const answers = await Promise.all(SHARDS.map(pollShard));
  if (answers.some(a => a.error && a.error.auth)) return askToken(token() ? "That token was refused." : "");
  const down = answers.filter(a => a.error);
  $("#problem").hidden = !down.length;
  $("#problem").textContent = down.length ? down.length + " of " + SHARDS.length + " shard(s) unreachable" : "";
  if (down.length < answers.length) {
    const nodes = mergeNodes(answers);
    const total = sumStats(answers, nodes);
    history.push({t: Date.now(), total});
    if (history.length > HISTORY + 1) history.shift();
    $("#login").hidden = true;
    $("#view").hidden = false;
    renderStats(total);
    renderRates();
    renderNodes(nodes);
    renderShards(answers);
    renderEvents(answers);
    renderCharts();
    $("#updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  }
  if (!paused) timer = setTimeout(poll, POLL_MS);
}

function askToken(message) {
  $("#view").hidden = true;
  $("#login").hidden = false;
  $("#problem").hidden = !message;
  $("#problem").textContent = message;
  $("#token").focus();
}

$("#login").addEventListener("submit", ev => {
  ev.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
  $("#token").value = "";
  if (timer === null) poll();
});
$("#pause").addEventListener("click", () => {
  paused = !paused;
  $("#pause").textContent = paused ? "Resume" : "Pause";
  if (!paused && timer === null) poll();
});
poll();
