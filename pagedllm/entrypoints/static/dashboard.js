// pagedllm engine dashboard: polls v1/internal/engine_state and draws each engine core's block
// pool, queues and time series. Plain JS, no dependencies (works offline). docs/dashboard.md.
"use strict";

const STATES = ["free", "used", "shared", "cached", "reserved", "swapped"];
const COLORS = {
  free: "#e9ecef", used: "#4c6ef5", shared: "#f59f00", cached: "#94d82d",
  reserved: "#495057", swapped: "#e64980",
};
const STATE_RGB = STATES.map((s) => hexRgb(COLORS[s]));
const HIGHLIGHT = "#d6336c";
const ENGINE_COLORS = ["#4c6ef5", "#f76707", "#12b886", "#ae3ec9", "#fab005", "#1098ad"];
const HISTORY_S = 300; // time series keep the last five minutes
const KEY_STORE = "pagedllm-dashboard-key";

const ui = {
  key: sessionStorage.getItem(KEY_STORE) || "",
  pollMs: 500,
  selected: null, // {engine, id}
  history: {}, // engine index -> [{t, usage, genRate, batchRate, running, waiting, swapped, preemptions, hitRate}]
  prev: {}, // engine index -> previous snapshot counters (for rates)
  engines: {}, // engine index -> DOM and decoded state
  last: null,
  wantHistory: true, // the first answer brings the server's last minutes
};
window.pagedllmDashboard = ui; // tests read it

function hexRgb(hex) {
  const v = parseInt(hex.slice(1), 16);
  return [(v >> 16) & 255, (v >> 8) & 255, v & 255];
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const c of children) node.append(c);
  return node;
}

function rleDecode(runs, n) {
  const out = new Uint8Array(n);
  let i = 0;
  for (let r = 0; r < runs.length; r += 2) {
    out.fill(runs[r], i, i + runs[r + 1]);
    i += runs[r + 1];
  }
  return out;
}

function fmt(v, digits = 0, unit = "") {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  return v.toFixed(digits) + unit;
}

// ---- polling --------------------------------------------------------------------------

async function poll() {
  const status = document.getElementById("status");
  try {
    const headers = ui.key ? { Authorization: "Bearer " + ui.key } : {};
    const url = "v1/internal/engine_state" + (ui.wantHistory ? "?history=1" : "");
    const resp = await fetch(url, { headers, cache: "no-store" });
    if (resp.status === 401) {
      askKey(ui.key ? "The API key was refused." : "This server needs its API key.");
      return;
    }
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    ui.wantHistory = false;
    ui.pollMs = Math.max(250, data.poll_interval_ms || 500);
    render(data);
    status.textContent = "live · " + new Date(data.served_at * 1000).toLocaleTimeString()
      + " · every " + ui.pollMs + " ms";
    status.classList.remove("error");
  } catch (err) {
    status.textContent = "cannot reach the server: " + err.message;
    status.classList.add("error");
  }
  setTimeout(poll, ui.pollMs);
}

function askKey(message) {
  const form = document.getElementById("key-form");
  const status = document.getElementById("status");
  status.textContent = message;
  status.classList.add("error");
  form.hidden = false;
  document.getElementById("key-input").focus();
}

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  ui.key = document.getElementById("key-input").value.trim();
  sessionStorage.setItem(KEY_STORE, ui.key);
  document.getElementById("key-form").hidden = true;
  poll();
});

// ---- rendering ------------------------------------------------------------------------

function render(data) {
  ui.last = data;
  const main = document.getElementById("engines");
  for (const snap of data.engines) {
    let view = ui.engines[snap.engine_index];
    if (!view) {
      view = ui.engines[snap.engine_index] = makeEngineView(snap.engine_index);
      main.append(view.root);
    }
    if (snap.error) {
      view.error.textContent = "engine " + snap.engine_index + ": " + snap.error;
      continue;
    }
    view.error.textContent = "";
    recordHistory(snap);
    renderEngine(view, snap);
  }
  renderSeries(data.engines.map((s) => s.engine_index));
}

function makeEngineView(index) {
  const v = {};
  v.root = el("section", { class: "engine", "data-engine": String(index) });
  v.title = el("h2", {}, "engine " + index);
  v.error = el("div", { class: "error" });
  v.config = el("table", { class: "config" });
  v.counts = el("div", { class: "counts" });
  v.grids = el("div", { class: "grids" });
  v.host = el("div", { class: "grids" });
  v.queues = el("div", { class: "queues" });
  v.details = el("div", { class: "details", hidden: true });
  v.root.append(v.title, v.error, v.config, v.counts, v.grids, v.host, v.queues, v.details);
  v.gridCanvases = [];
  return v;
}

function renderEngine(view, snap) {
  const cfg = snap.config;
  const n = cfg.num_blocks;
  const states = rleDecode(snap.blocks.rle, n);
  const groups = snap.blocks.groups_rle ? rleDecode(snap.blocks.groups_rle, n) : null;
  const hostStates = rleDecode(snap.host_blocks.rle, cfg.num_host_blocks);
  // block id -> owners ("request #sample"), device and host
  const owners = new Map();
  const hostOwners = new Map();
  for (const req of snap.requests) {
    for (const seq of req.seqs) {
      const map = seq.on_host ? hostOwners : owners;
      for (const table of seq.block_tables) {
        for (const b of table) {
          if (b < 0) continue;
          if (!map.has(b)) map.set(b, []);
          map.get(b).push(req.request_id + " #" + seq.index);
        }
      }
    }
  }
  Object.assign(view, { snap, states, groups, hostStates, owners, hostOwners });

  view.config.replaceChildren(...[
    ["model", cfg.model], ["block size", cfg.block_size + " tokens"],
    ["blocks", n + " (" + (n * cfg.block_size) + " tokens)"], ["KV dtype", cfg.kv_cache_dtype],
    ["bytes per block", cfg.bytes_per_block.toLocaleString()],
    ["KV pool", fmt(n * cfg.bytes_per_block / 2 ** 20, 1, " MiB")],
    ["max_num_seqs", cfg.max_num_seqs], ["max_model_len", cfg.max_model_len],
    ["max_num_batched_tokens", cfg.max_num_batched_tokens],
    ["swap space", cfg.swap_space_gib + " GiB (" + cfg.num_host_blocks + " blocks)"],
    ["prefix caching", cfg.enable_prefix_caching ? "on" : "off"],
    ...(cfg.kv_cache_groups.length ? [["KV cache groups", cfg.kv_cache_groups.join(", ")]] : []),
  ].map(([k, val]) => el("tr", {}, el("td", {}, k), el("td", {}, String(val)))));

  const c = snap.blocks.counts;
  const k = snap.counters;
  view.counts.textContent = `used ${c.used} · shared ${c.shared} · cached ${c.cached} · free ${c.free}`
    + (c.reserved ? ` · reserved ${c.reserved}` : "")
    + ` · swapped (host) ${snap.host_blocks.counts.swapped}`
    + ` · preemptions ${k.num_preemptions} · prefix hits ${k.prefix_cache_hits}/${k.prefix_cache_queries} tokens`;

  // one grid per KV cache group when there are several, else one
  const grids = cfg.kv_cache_groups.length > 1
    ? cfg.kv_cache_groups.map((name, g) => ({ title: "group " + g + " (" + name + ")", group: g }))
    : [{ title: "device blocks", group: null }];
  if (view.gridCanvases.length !== grids.length) {
    view.grids.replaceChildren();
    view.gridCanvases = grids.map((g) => {
      const canvas = el("canvas", { class: "grid" });
      canvas.addEventListener("mousemove", (ev) => hover(ev, view, canvas, false));
      canvas.addEventListener("mouseleave", hideTooltip);
      view.grids.append(el("h3", {}, g.title), canvas);
      return canvas;
    });
  }
  const selected = selectedBlocks(snap);
  grids.forEach((g, i) => {
    const canvas = view.gridCanvases[i];
    canvas.dataset.group = g.group === null ? "" : String(g.group);
    drawGrid(canvas, states, g.group === null ? null : groups, g.group, selected.device);
  });
  if (cfg.num_host_blocks > 0) {
    if (!view.hostCanvas) {
      view.hostCanvas = el("canvas", { class: "grid host" });
      view.hostCanvas.addEventListener("mousemove", (ev) => hover(ev, view, view.hostCanvas, true));
      view.hostCanvas.addEventListener("mouseleave", hideTooltip);
      view.host.append(el("h3", {}, "host (swap) blocks"), view.hostCanvas);
    }
    drawGrid(view.hostCanvas, hostStates, null, null, selected.host);
  }
  renderQueues(view, snap, states);
  renderDetails(view, snap);
  const h = ui.hover;
  if (h && h.view === view && h.canvas.isConnected) hover(h.ev, view, h.canvas, h.isHost);
}

function selectedBlocks(snap) {
  const device = new Set();
  const host = new Set();
  const sel = ui.selected;
  if (!sel || sel.engine !== snap.engine_index) return { device, host };
  const req = snap.requests.find((r) => r.id === sel.id);
  if (!req) return { device, host };
  for (const seq of req.seqs)
    for (const t of seq.block_tables)
      for (const b of t) if (b >= 0) (seq.on_host ? host : device).add(b);
  return { device, host };
}

function gridGeometry(n, width) {
  const cell = n <= 256 ? 14 : n <= 1024 ? 10 : n <= 4096 ? 6 : n <= 16384 ? 4 : 2;
  const cols = Math.max(1, Math.floor(width / cell));
  return { cell, cols, rows: Math.ceil(n / cols) };
}

function drawGrid(canvas, states, groups, group, highlighted) {
  const n = states.length;
  const width = Math.max(200, canvas.parentElement.clientWidth - 4);
  const { cell, cols, rows } = gridGeometry(n, width);
  canvas.width = cols * cell;
  canvas.height = Math.max(1, rows) * cell;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(canvas.width, canvas.height);
  const px = img.data;
  const gap = cell >= 6 ? 1 : 0;
  let used = 0;
  let lit = 0;
  for (let b = 0; b < n; b++) {
    let s = states[b];
    // another group's blocks are drawn as free in this group's grid
    if (groups && s !== 0 && s !== 3 && groups[b] !== group) s = 0;
    if (s === 1 || s === 2) used++;
    const rgb = STATE_RGB[s];
    const x0 = (b % cols) * cell;
    const y0 = Math.floor(b / cols) * cell;
    const hi = highlighted.has(b);
    if (hi) lit++;
    for (let y = y0; y < y0 + cell - gap; y++) {
      for (let x = x0; x < x0 + cell - gap; x++) {
        const edge = hi && (x === x0 || y === y0 || x === x0 + cell - gap - 1 || y === y0 + cell - gap - 1);
        const o = (y * canvas.width + x) * 4;
        const c = edge ? [214, 51, 108] : rgb;
        px[o] = c[0]; px[o + 1] = c[1]; px[o + 2] = c[2]; px[o + 3] = 255;
      }
    }
  }
  ctx.putImageData(img, 0, 0);
  if (highlighted.size && cell >= 4) {
    ctx.strokeStyle = HIGHLIGHT;
    ctx.lineWidth = 2;
    for (const b of highlighted) {
      if (b >= n) continue;
      ctx.strokeRect((b % cols) * cell + 1, Math.floor(b / cols) * cell + 1, cell - gap - 2, cell - gap - 2);
    }
  }
  canvas.dataset.blocks = String(n);
  canvas.dataset.used = String(used);
  canvas.dataset.highlighted = String(lit);
  canvas.dataset.cols = String(cols);
  canvas.dataset.cell = String(cell);
}

function hover(ev, view, canvas, isHost) {
  // kept so that the next poll's redraw refreshes the tooltip under a still mouse
  ui.hover = { ev: { clientX: ev.clientX, clientY: ev.clientY }, view, canvas, isHost };
  const rect = canvas.getBoundingClientRect();
  const cell = Number(canvas.dataset.cell), cols = Number(canvas.dataset.cols);
  const x = Math.floor((ev.clientX - rect.left) * canvas.width / rect.width / cell);
  const y = Math.floor((ev.clientY - rect.top) * canvas.height / rect.height / cell);
  const b = y * cols + x;
  const states = isHost ? view.hostStates : view.states;
  if (x >= cols || b >= states.length) return hideTooltip();
  const owners = (isHost ? view.hostOwners : view.owners).get(b) || [];
  const tip = document.getElementById("tooltip");
  tip.textContent = (isHost ? "host block " : "block ") + b + ": " + STATES[states[b]]
    + (view.groups && !isHost && view.groups[b] !== 255 ? " (group " + view.groups[b] + ")" : "")
    + (owners.length ? " · owners: " + owners.join(", ") : "");
  tip.hidden = false;
  tip.style.left = ev.clientX + 12 + "px";
  tip.style.top = ev.clientY + 12 + "px";
}

function hideTooltip() {
  ui.hover = null;
  const tip = document.getElementById("tooltip");
  tip.hidden = true;
  tip.textContent = "";
}

function renderQueues(view, snap, states) {
  const byId = new Map(snap.requests.map((r) => [r.id, r]));
  view.queues.replaceChildren(...["running", "waiting", "swapped"].map((name) => {
    const ids = snap.queues[name];
    const list = el("ul", { "data-queue": name });
    for (const id of ids) {
      const req = byId.get(id);
      if (!req) continue;
      const bar = el("canvas", {});
      const item = el("li", { class: "request", "data-request-id": req.request_id, "data-core-id": req.id,
        "data-blocks": String(req.num_blocks), title: "click: highlight its blocks" },
      el("span", { class: "rid" }, req.request_id), bar,
      el("span", { class: "n" }, req.num_blocks + (req.num_host_blocks ? "+" + req.num_host_blocks + "h" : "") + " blk"));
      if (ui.selected && ui.selected.engine === snap.engine_index && ui.selected.id === id)
        item.classList.add("selected");
      item.addEventListener("click", () => {
        const same = ui.selected && ui.selected.engine === snap.engine_index && ui.selected.id === id;
        ui.selected = same ? null : { engine: snap.engine_index, id };
        renderEngine(view, view.snap);
      });
      list.append(item);
      requestAnimationFrame(() => drawTableBar(bar, req, states, view.hostStates, snap.config.block_size));
    }
    if (!list.children.length) list.append(el("li", { class: "empty" }, "none"));
    return el("div", { class: "queue" }, el("h3", {}, name + " (" + ids.length + ")"), list);
  }));
}

function drawTableBar(canvas, req, states, hostStates, blockSize) {
  // the first sample's block table (first group), one segment per entry, coloured by state
  const seq = req.seqs[0];
  const table = seq ? seq.block_tables[0] || [] : [];
  const w = canvas.clientWidth || 200;
  canvas.width = w;
  const spans = req.image_spans || [];
  canvas.height = spans.length ? 13 : 10;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#f1f3f5";
  ctx.fillRect(0, 0, w, canvas.height);
  const seg = Math.max(1, Math.min(12, Math.floor(w / Math.max(1, table.length))));
  table.forEach((b, i) => {
    const s = b < 0 ? 4 : seq.on_host ? 5 : states[b];
    ctx.fillStyle = COLORS[STATES[s]];
    ctx.fillRect(i * seg, 0, Math.max(1, seg - 1), 10);
  });
  // image inputs: a bar under the blocks each image's placeholder rows fill
  const bs = blockSize || 16;
  ctx.fillStyle = IMAGE_COLOR;
  spans.forEach(([start, end]) => {
    const first = Math.floor(start / bs), last = Math.floor((end - 1) / bs);
    ctx.fillRect(first * seg, 11, (last - first + 1) * seg - 1, 2);
  });
}

const IMAGE_COLOR = "#ae3ec9";

function renderDetails(view, snap) {
  const sel = ui.selected;
  const req = sel && sel.engine === snap.engine_index ? snap.requests.find((r) => r.id === sel.id) : null;
  if (!req) {
    view.details.hidden = true;
    if (sel && sel.engine === snap.engine_index) view.details.dataset.gone = "1";
    return;
  }
  view.details.hidden = false;
  view.details.replaceChildren(el("table", {}, ...[
    ["request", req.request_id], ["state", req.state], ["samples", req.n + (req.is_beam_search ? " (beams)" : "")],
    ["prompt tokens", req.num_prompt_tokens], ["output tokens", req.num_output_tokens],
    ["prefix-cache hit tokens", req.num_cached_tokens ?? "–"],
    ["images", (req.image_spans || []).length ? req.image_spans.map(([s, e, h]) => `${h} @ ${s}–${e - 1}`).join(", ") : "–"], ["blocks", req.num_blocks + (req.num_host_blocks ? " + " + req.num_host_blocks + " on host" : "")],
    ["TTFT", fmt(req.ttft_s === null ? null : req.ttft_s * 1000, 0, " ms")],
    ["ITL (mean)", fmt(req.itl_s === null ? null : req.itl_s * 1000, 1, " ms")],
    ["preemptions", req.num_preemptions], ["priority", req.priority],
    ["waited", fmt(req.first_scheduled_time ? req.first_scheduled_time - req.arrival_time : snap.timestamp - req.arrival_time, 2, " s")],
  ].map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, String(v))))));
  view.details.dataset.requestId = req.request_id;
}

// ---- time series ----------------------------------------------------------------------

// One chart point from two readings of the cumulative counters (`k` now, `p` before, or
// null), the same for the server's history samples and the page's own polls.
function chartPoint(t, k, prevT, p, numBlocks) {
  const dt = p ? t - prevT : null;
  const rate = (key) => (p && dt > 0 && k[key] != null && p[key] != null ? Math.max(0, k[key] - p[key]) / dt : null);
  const dq = p ? k.prefix_cache_queries - p.prefix_cache_queries : 0;
  return {
    t,
    usage: (100 * k.kv_used_blocks) / numBlocks,
    genRate: rate("generation_tokens_total"),
    batchRate: rate("num_batched_tokens_total"),
    running: k.num_running, waiting: k.num_waiting, swapped: k.num_swapped,
    preemptions: p ? Math.max(0, k.num_preemptions - p.num_preemptions) : 0,
    hitRate: dq > 0 ? (100 * (k.prefix_cache_hits - p.prefix_cache_hits)) / dq : null,
  };
}

function recordHistory(snap) {
  const i = snap.engine_index;
  const hist = (ui.history[i] = ui.history[i] || []);
  if (snap.history && !hist.length) {
    // the minutes before the page opened (the server's samples, one a second)
    let prev = null;
    for (const s of snap.history) {
      hist.push(chartPoint(s.t, s, prev && prev.t, prev, s.kv_num_blocks || snap.config.num_blocks));
      prev = s;
    }
  }
  const k = snap.counters;
  const t = snap.timestamp;
  const prev = ui.prev[i];
  if (prev && t <= prev.t) return; // the same (shared) snapshot again
  hist.push(chartPoint(t, k, prev && prev.t, prev && prev.k, snap.config.num_blocks));
  while (hist.length && hist[0].t < t - HISTORY_S) hist.shift();
  ui.prev[i] = { t, k };
}

const SERIES = [
  { key: "usage", title: "KV cache usage", unit: "%", max: 100 },
  { key: "genRate", title: "generated tokens/s", unit: "" },
  { key: "batchRate", title: "tokens fed to the model/s", unit: "" },
  { key: "running", title: "running requests", unit: "" },
  { key: "waiting", title: "waiting requests (swapped dashed)", unit: "", extra: "swapped" },
  { key: "preemptions", title: "preemptions per poll", unit: "" },
  { key: "hitRate", title: "prefix-cache hit rate", unit: "%", max: 100 },
];

function renderSeries(indices) {
  const box = document.getElementById("series");
  if (!box.children.length) {
    for (const s of SERIES) {
      const canvas = el("canvas", {});
      const value = el("span", {});
      box.append(el("div", { class: "chart", "data-series": s.key },
        el("div", { class: "title" }, el("span", {}, s.title), value), canvas));
      s.canvas = canvas;
      s.value = value;
    }
  }
  for (const s of SERIES) drawSeries(s, indices);
}

function drawSeries(s, indices) {
  const canvas = s.canvas;
  const w = (canvas.width = canvas.clientWidth || 300);
  const h = (canvas.height = 90);
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, w, h);
  const now = Math.max(...indices.map((i) => (ui.history[i] || []).at(-1)?.t || 0));
  let max = s.max || 1;
  if (!s.max)
    for (const i of indices)
      for (const p of ui.history[i] || []) max = Math.max(max, p[s.key] || 0, s.extra ? p[s.extra] || 0 : 0);
  ctx.strokeStyle = "#e9ecef";
  ctx.beginPath();
  for (const f of [0.25, 0.5, 0.75]) { ctx.moveTo(0, h * f); ctx.lineTo(w, h * f); }
  ctx.stroke();
  const labels = [];
  indices.forEach((i, n) => {
    const pts = ui.history[i] || [];
    const color = ENGINE_COLORS[n % ENGINE_COLORS.length];
    for (const [key, dash] of [[s.key, []], ...(s.extra ? [[s.extra, [4, 3]]] : [])]) {
      ctx.strokeStyle = color;
      ctx.setLineDash(dash);
      ctx.lineWidth = 1.5;
      ctx.beginPath();
      let started = false;
      for (const p of pts) {
        const v = p[key];
        if (v === null || v === undefined) { started = false; continue; }
        const x = w - ((now - p.t) / HISTORY_S) * w;
        const y = h - 2 - (v / max) * (h - 4);
        if (started) ctx.lineTo(x, y); else ctx.moveTo(x, y);
        started = true;
      }
      ctx.stroke();
    }
    ctx.setLineDash([]);
    const lastV = pts.length ? pts.at(-1)[s.key] : null;
    labels.push((indices.length > 1 ? "e" + i + " " : "") + fmt(lastV, s.unit === "%" ? 1 : 0, s.unit));
  });
  ctx.fillStyle = "#868e96";
  ctx.font = "10px sans-serif";
  ctx.fillText(fmt(max, 0, s.unit), 2, 10);
  ctx.fillText("-" + HISTORY_S / 60 + " min", 2, h - 3);
  s.value.textContent = labels.join(" · ");
}

function renderLegend() {
  const box = document.getElementById("legend");
  const words = {
    free: "free", used: "used", shared: "shared (ref > 1)", cached: "cached-free (evictable prefix)",
    reserved: "reserved (null block)", swapped: "swapped (host)",
  };
  box.append(...STATES.map((s) => el("span", {}, el("i", { style: "" }), words[s])));
  [...box.querySelectorAll("i")].forEach((node, i) => (node.style.background = COLORS[STATES[i]]));
  box.append(el("span", {}, el("i", {}), "selected request"));
  box.lastChild.firstChild.style.cssText = "background:#fff;border:2px solid " + HIGHLIGHT;
}

renderLegend();
poll();
