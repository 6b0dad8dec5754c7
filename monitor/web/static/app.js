// genq monitor's live page: polls api/state (relative URL: works through a port forward or a
// proxy's path prefix) and draws with uPlot, shipped beside this file. No other dependency.
"use strict";

const $ = (id) => document.getElementById(id);
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
                 "#4b5563", "#65a30d", "#7c3aed", "#0d9488"];
let job = new URLSearchParams(location.search).get("job");
let interval = 2;
let timer = null;
const charts = {};

function duration(s) {
  if (s === null || s === undefined) return "?";
  s = Math.round(s);
  if (s < 90) return s + "s";
  const m = Math.floor(s / 60);
  if (m < 90) return m + "m " + String(s % 60).padStart(2, "0") + "s";
  const h = Math.floor(m / 60);
  if (h < 48) return h + "h " + String(m % 60).padStart(2, "0") + "m";
  return Math.floor(h / 24) + "d " + String(h % 24).padStart(2, "0") + "h";
}

function count(n) {
  if (n === null || n === undefined) return "?";
  for (const [unit, size] of [["G", 1e9], ["M", 1e6], ["k", 1e3]]) {
    if (Math.abs(n) >= size) return (n / size).toFixed(1) + unit;
  }
  return Number.isInteger(n) ? String(n) : n.toFixed(2);
}

function bytes(n) {
  for (const [unit, size] of [["GB", 2 ** 30], ["MB", 2 ** 20], ["kB", 2 ** 10]]) {
    if (n >= size) return (n / size).toFixed(1) + " " + unit;
  }
  return n + " B";
}

// A number shown on the page: formatted text, and the exact value in data-value (for scripts and tests).
function put(id, value, text) {
  const el = $(id);
  el.dataset.value = value === null || value === undefined ? "" : String(value);
  el.textContent = text !== undefined ? text : (value === null || value === undefined ? "?" : String(value));
}

// Points on the x axis a chart draws from: with fewer, its box says so instead of bare axes.
function chart(id, series, data, extra) {
  const el = $(id);
  if ((data[0] || []).length < 2) el.dataset.empty = "waiting for data";
  else delete el.dataset.empty;
  const key = JSON.stringify(series.map((s) => s.label));
  const width = Math.max(300, el.clientWidth);
  if (charts[id] && charts[id].key === key) {
    charts[id].plot.setData(data);
    return;
  }
  if (charts[id]) charts[id].plot.destroy();
  const opts = Object.assign({width: width, height: 240, series: [{}].concat(series),
                              legend: {live: false}, cursor: {drag: {x: false, y: false}}}, extra || {});
  charts[id] = {key: key, plot: new uPlot(opts, data, el)};
}

// A y axis as wide as its longest label, measured in its font: uPlot's fixed 50 px cut
// "15,000" to "5,000".
const measurer = document.createElement("canvas").getContext("2d");
function yAxis(format) {
  return {values: (u, splits) => splits.map(format),
          size: (u, values, i) => {
            const ax = u.axes[i];
            measurer.font = ax.font ? ax.font[0] : "12px system-ui";
            const widest = Math.max(0, ...(values || []).map((v) => measurer.measureText(String(v)).width));
            return Math.ceil(widest / devicePixelRatio + 2 * (ax.gap || 5) + (ax.ticks ? ax.ticks.size : 10) + 4);
          }};
}

// The top of a y scale that a few early outliers do not set (the first ETA of a job is a guess
// from almost nothing, often many times the later ones: it flattened the whole chart).
function robustMax(columns) {
  const all = columns.flat().filter((v) => v !== null && v !== undefined && isFinite(v)).sort((a, b) => a - b);
  if (!all.length) return 60;  // nothing yet: a minute, not 1 s of repeated "0s"/"1s" labels
  const p90 = all[Math.floor(0.9 * (all.length - 1))];
  return Math.max(1e-9, Math.min(all[all.length - 1], 1.25 * p90));
}

function line(label, i, more) {
  return Object.assign({label: label, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true,
                        points: {show: false}}, more || {});
}

function drawProgress(h, p) {
  const t = h.t.slice();
  const n = t.length;
  const done = h.percent_completed.slice(), finished = h.percent.slice();
  const mid = new Array(n).fill(null), low = new Array(n).fill(null), high = new Array(n).fill(null);
  if (n && p.eta_s !== null && p.eta_low_s !== null && p.eta_s > 0 && p.status !== "done" && p.status !== "partial") {
    // The 90% range drawn forward: from now to 100% at the early, median and late finish.
    const now = t[n - 1], at = finished[n - 1];
    mid[n - 1] = low[n - 1] = high[n - 1] = at;
    const ends = [[p.eta_low_s, low], [p.eta_s, mid], [p.eta_high_s, high]];
    let last = now;
    for (const [eta, arr] of ends) {
      const x = Math.max(now + eta, last + 0.001);  // x must grow
      last = x;
      t.push(x); done.push(null); finished.push(null);
      for (const a of [mid, low, high]) a.push(a === arr ? 100 : null);
    }
  }
  chart("chart-progress", [
    line("done %", 0, {fill: "rgba(37,99,235,0.08)"}), line("finished % (done + failed)", 1),
    line("ETA median", 2, {dash: [6, 4]}), line("ETA 5%", 4, {dash: [2, 3]}), line("ETA 95%", 4, {dash: [2, 3]}),
  ], [t, done, finished, mid, low, high], {scales: {y: {range: [0, 100]}}, axes: [{}, yAxis((v) => v + "%")]});
}

function drawEta(h) {
  chart("chart-eta", [line("ETA median", 2), line("ETA 5%", 4, {dash: [2, 3]}), line("ETA 95%", 4, {dash: [2, 3]})],
        [h.t, h.eta_s, h.eta_low_s, h.eta_high_s],
        {scales: {y: {range: (u) => [0, robustMax([u.data[1], u.data[3]])]}}, axes: [{}, yAxis(duration)]});
}

function drawPerWorker(id, h, fleetLabel, field, scale) {
  const names = Object.keys(h.workers).sort();
  const per = names.map((name) => h.workers[name][field].map((v) => (v === null ? null : v * scale)));
  const series = [], data = [h.t];
  if (fleetLabel) {
    // The fleet is the sum of the lines below it, from the same heartbeat windows: the monitor's own
    // job rate uses a longer window and was drawn below the only GPU's line.
    series.push(line(fleetLabel, 0, {width: 2.5}));
    data.push(h.t.map((_, i) => {
      const here = per.map((col) => col[i]).filter((v) => v !== null && v !== undefined);
      return here.length ? here.reduce((a, b) => a + b, 0) : null;
    }));
  }
  names.forEach((name, i) => { series.push(line(name, i + 1)); data.push(per[i]); });
  chart(id, series, data, scale === 100 ? {scales: {y: {range: [0, 100]}}, axes: [{}, yAxis((v) => v + "%")]}
                                        : {axes: [{}, yAxis(count)]});
}

function drawLengths(l) {
  const x = l.buckets;
  const bars = (align) => uPlot.paths.bars({size: [0.45, 60], align: align});
  chart("chart-lengths", [
    {label: "finished", fill: "rgba(37,99,235,0.55)", stroke: PALETTE[0], paths: bars(-1), points: {show: false}},
    {label: "running (so far)", fill: "rgba(234,88,12,0.55)", stroke: PALETTE[4], paths: bars(1), points: {show: false}},
    line("fitted (finished)", 1, {width: 2}),
  ], [x, l.finished, l.running, l.fitted], {
    scales: {x: {time: false}},
    axes: [{values: (u, splits) => splits.map((b) => count(Math.round(2 ** (b / 4) - 1))), label: "output tokens"},
           yAxis(count)],
  });
}

// A GPU against its decode bound (genq.core.decodebound): "62% of 1.2K", "?" where a figure is missing.
function boundCell(v) {
  if (!v) return "";
  const b = v.bound;
  if (b.tok_per_s === undefined || b.share === undefined) return "?";
  return Math.round(100 * b.share) + "% of " + count(Math.round(b.tok_per_s));
}

function boundLines(v) {
  if (!v) return [];
  const out = [];
  if (v.slow) out.push("slow GPU: " + v.slow);
  if (v.cap && !["genq_target", "nothing_to_send"].includes(v.cap.code))
    out.push("batch capped by " + v.cap.text + (v.cap.advice ? "; fix: " + v.cap.advice : ""));
  if (v.bound.tok_per_s === undefined && v.bound.unknown) out.push("bound " + v.bound.unknown);
  return out;
}

function drawTables(s) {
  const p = s.progress;
  const rows = p.worker_details.map((w) => {
    const codes = w.bottleneck_codes.map((c) => `<span class="code ${c}">${c}</span>`).join("");
    const slots = w.slot_utilization === null ? "-" : Math.round(w.slot_utilization * 100) + "%";
    return `<tr data-worker="${esc(w.name)}"><td>${esc(w.name)}</td><td>${esc(w.state)}</td><td>${slots}</td>` +
           `<td>${codes || "none"}</td><td>${w.bottlenecks.concat(boundLines(w.bound)).map(esc).join("<br>")}</td></tr>`;
  });
  document.querySelector("#bottlenecks tbody").innerHTML = rows.join("") || "<tr><td colspan=5>no workers</td></tr>";
  // The terminal view's worker table: this job's figures per worker.
  const live = (w) => !["lost", "gone", "stopped", "silent"].includes(w.state);
  document.querySelector("#workers tbody").innerHTML = p.worker_details.map((w) =>
    `<tr data-worker="${esc(w.name)}"><td>${esc(w.name)}</td><td>${esc(w.state)}</td>` +
    `<td data-value="${live(w) ? w.in_flight : ""}">${live(w) ? w.in_flight + "/" + w.concurrency_target : ""}</td>` +
    `<td>${live(w) ? count(Math.round(w.tok_per_s)) : ""}</td><td data-value="${w.job_completed}">${w.job_completed.toLocaleString()}</td>` +
    `<td data-value="${w.job_failed}">${w.job_failed.toLocaleString()}</td>` +
    `<td data-value="${w.errors}">${live(w) ? w.errors.toLocaleString() : ""}</td>` +
    `<td data-value="${w.bound && w.bound.bound.share !== undefined ? w.bound.bound.share : ""}"` +
    `${w.bound && w.bound.slow ? ' class="slow"' : ""}>${boundCell(w.bound)}</td></tr>`).join("") ||
    "<tr><td colspan=8>no workers</td></tr>";
  const d = s.dead_letters;
  put("dlq-total", d.total);
  document.querySelector("#dlq-kinds tbody").innerHTML =
    Object.entries(d.by_kind).map(([k, n]) => `<tr data-kind="${esc(k)}"><td>${esc(k)}</td><td>${n}</td></tr>`).join("") ||
    "<tr><td colspan=2>none</td></tr>";
  document.querySelector("#dlq-latest tbody").innerHTML = d.latest.map((e) =>
    `<tr><td>${esc(e.id)}</td><td>${esc(e.kind)}</td><td>${esc(e.worker)}</td><td>${esc(e.message)}</td></tr>`).join("") ||
    "<tr><td colspan=4>none</td></tr>";
}

function esc(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}

function fillPicker(jobs) {
  const picker = $("job-picker");
  if (picker.dataset.jobs !== JSON.stringify(jobs)) {
    picker.innerHTML = jobs.map((j) => `<option>${esc(j)}</option>`).join("");
    picker.dataset.jobs = JSON.stringify(jobs);
  }
}

function render(s) {
  $("loading").hidden = true;
  const picker = $("job-picker");
  fillPicker(s.jobs);
  interval = s.interval;
  $("controls").hidden = !s.controls;
  $("redis-note").textContent = s.redis_note || "";  // Redis refusing writes, or evicting (genq.core.refusals)
  $("redis-note").hidden = !s.redis_note;
  if (!s.job) {
    $("status").textContent = "no jobs yet";
    document.querySelectorAll(".chart").forEach((el) => { el.dataset.empty = "no jobs yet (genq enqueue)"; });
    return;
  }
  picker.value = s.job;
  const p = s.progress;
  $("status").textContent = p.status;
  $("status").className = "badge " + p.status;
  $("updated").textContent = "updated " + new Date(p.updated_at * 1000).toLocaleTimeString();
  put("completed", p.completed, p.completed.toLocaleString());
  put("total", p.total, p.total.toLocaleString());
  put("percent", p.percent, p.percent.toFixed(1));
  put("percent-completed", p.percent_completed, p.percent_completed.toFixed(1));
  put("failed", p.failed, p.failed.toLocaleString());
  $("failed").classList.toggle("bad", p.failed > 0);
  put("percent-failed", p.percent_failed, p.percent_failed.toFixed(1));
  put("in-flight", p.in_flight);
  put("queued", p.queued);
  put("batches-done", p.batches_done);
  put("held-batches", p.held_batches);
  put("queued-batches", p.queued_batches);
  put("other-batches", p.other_batches);
  put("eta", p.eta_s, (p.status === "done" || p.status === "partial") ? "finished" : (p.eta_s === null ? p.eta_state : duration(p.eta_s)));
  $("eta-range").textContent = p.eta_low_s === null ? p.eta_note : duration(p.eta_low_s) + " – " + duration(p.eta_high_s);
  $("eta-state").textContent = p.eta_state;
  $("blocked").textContent = p.blocked || "";
  $("blocked").hidden = !p.blocked;
  $("tail").textContent = p.tail || "";
  $("tail").hidden = !p.tail;
  $("bound-summary").textContent = p.bound_summary ? "GPUs: " + p.bound_summary : "";
  $("bound-summary").hidden = !p.bound_summary;
  put("rate", p.rate_per_sec, p.rate_per_sec === null ? "?" : p.rate_per_sec.toFixed(2));
  put("toks", p.output_tokens_per_sec, count(p.output_tokens_per_sec));
  put("elapsed", p.elapsed_s, p.elapsed_s > 0 ? duration(p.elapsed_s) : p.completed + p.failed ? "?" : "not started");
  put("priority", p.priority, p.weight === 1 ? String(p.priority) : p.priority + " (weight " + p.weight + ")");
  put("share", p.share, Math.round(100 * p.share) + "%");
  put("shards", p.shards);
  put("manifest", p.shards);
  put("shard-records", p.shard_records, p.shard_records.toLocaleString());
  put("shard-bytes", p.s3_bytes, bytes(p.s3_bytes));
  const h = s.history;
  drawProgress(h, p);
  drawEta(h);
  drawPerWorker("chart-tok", h, "fleet", "tok_per_s", 1);
  drawPerWorker("chart-prompts", h, "fleet", "req_per_s", 1);
  drawPerWorker("chart-slots", h, null, "slot_utilization", 100);
  drawLengths(s.lengths);
  drawTables(s);
}

async function poll() {
  try {
    const resp = await fetch("api/state" + (job ? "?job=" + encodeURIComponent(job) : ""), {cache: "no-store"});
    if (resp.status === 404) {  // ?job= names no job: say so, and offer the ones there are
      const body = await resp.json();
      fillPicker(body.jobs);
      $("loading").hidden = true;
      $("job-picker").value = "";
      $("status").textContent = "";
      $("error").textContent = body.error + ": pick one above";
    } else {
      if (!resp.ok) throw new Error("HTTP " + resp.status);
      render(await resp.json());
      $("error").textContent = "";
    }
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (e) {
    $("error").textContent = "cannot reach the monitor (" + e.message + "); retrying";
  }
  clearTimeout(timer);
  timer = setTimeout(poll, interval * 1000);
}

window.addEventListener("resize", () => {
  for (const [id, c] of Object.entries(charts)) c.plot.setSize({width: Math.max(300, $(id).clientWidth), height: 240});
});

$("job-picker").addEventListener("change", (e) => {
  job = e.target.value;
  history.replaceState(null, "", "?job=" + encodeURIComponent(job));
  for (const id of Object.keys(charts)) { charts[id].plot.destroy(); delete charts[id]; }
  poll();
});

document.querySelectorAll("#controls button").forEach((b) => b.addEventListener("click", async () => {
  const resp = await fetch("api/control", {
    method: "POST", headers: {"Content-Type": "application/json", "X-Genq-Token": $("token").value},
    body: JSON.stringify({action: b.dataset.action, job: b.dataset.action === "drain" ? null : job || $("job-picker").value}),
  });
  const body = await resp.json();
  $("control-result").textContent = body.ok || body.error;
}));

poll();
