// The status page: poll /stats and /stats/history, fill the tiles, redraw the charts.
//
// /stats gives totals, last-minute rates, latency percentiles (since start), load, workers,
// each model and variant's traffic and each shadow variant's comparisons;
// /stats/history gives per-minute series, the TTFT objective and the 7-day error budget. Polling
// pauses while the tab is hidden; charts are redrawn at their new width when the page is resized.

import { bars, columns, formatClock, formatCount, formatDuration, lines } from "./charts.js";

const root = document.getElementById("status");
const REFRESH_MS = Number(root.dataset.refreshS || 5) * 1000;
const windowSelect = document.getElementById("window");
const $ = (id) => document.getElementById(id);
let latest = null;
let timer = 0;

async function getJSON(url) {
  const response = await fetch(url, { cache: "no-store", headers: { Accept: "application/json" } });
  if (!response.ok) throw new Error(`${url} answered ${response.status}`);
  return response.json();
}

function tile(id, value, sub, tone = "") {
  const node = $(id);
  node.querySelector(".value").replaceChildren(...value);
  node.querySelector(".sub").textContent = sub;
  node.classList.remove("good", "warn", "bad");
  if (tone) node.classList.add(tone);
}

// A big number with a small unit after it.
function figure(number, unit = "") {
  const parts = [document.createTextNode(number)];
  if (unit) {
    const small = document.createElement("small");
    small.textContent = ` ${unit}`;
    parts.push(small);
  }
  return parts;
}

function plural(n, word) {
  return `${formatCount(n)} ${word}${n === 1 ? "" : "s"}`;
}

function renderTiles(stats, history) {
  const { rates, totals, latency, load, workers } = stats;
  const slo = history.slo.ttft_s;
  tile(
    "tile-requests",
    figure(formatCount(rates.requests_per_s * 60), "/min"),
    `${plural(totals.requests, "request")} since start, ${formatCount(totals.failed)} failed`,
    totals.failed ? "warn" : "",
  );
  tile(
    "tile-tokens",
    figure((rates.completion_tokens_per_s).toFixed(1), "tokens/s"),
    `${formatCount(totals.generation_tokens)} generated since start`,
  );
  const slots = workers.reduce((n, w) => n + (w.slots_total || 0), 0);
  tile(
    "tile-load",
    figure(String(load.running), "running"),
    `${load.queued} queued · ${slots} slots on ${plural(workers.length, "worker")}`,
    load.queued ? "warn" : "",
  );
  const ttft = latency.ttft;
  tile(
    "tile-ttft",
    figure(formatDuration(ttft.p50)),
    ttft.count ? `median · p99 ${formatDuration(ttft.p99)} · objective ${formatDuration(slo)}` : "no requests yet",
    ttft.p99 === null ? "" : ttft.p99 > slo ? "bad" : ttft.p50 > slo / 2 ? "warn" : "good",
  );
  const itl = latency.itl;
  tile(
    "tile-itl",
    figure(formatDuration(itl.p50)),
    itl.count ? `median · p90 ${formatDuration(itl.p90)} · p99 ${formatDuration(itl.p99)}` : "no tokens yet",
  );
  const budget = history.error_budget;
  const left = budget.remaining;
  const tone = left <= 0 ? "bad" : left < 0.5 ? "warn" : "good";
  tile(
    "tile-budget",
    left <= 0 ? figure("spent") : figure(`${Math.floor(left * 1000) / 10}%`),
    `7 days: ${formatCount(budget.bad)} bad of ${budget.allowed_bad.toFixed(1)} allowed` +
      ` · burn rate ${budget.burn_rate_1h.toFixed(1)}× in the last hour`,
    tone,
  );
  const pct = Math.max(0, Math.min(100, left * 100));
  const meter = $("tile-budget").querySelector(".meter");
  meter.setAttribute("aria-valuenow", pct.toFixed(1));
  meter.querySelector("span").style.width = `${pct}%`;
}

function label(svg, text) {
  svg.setAttribute("aria-label", text);
}

function renderCharts(stats, history) {
  const minutes = history.minutes;
  const span = `the last ${minutes.length} minutes`;
  const sum = (key) => minutes.reduce((n, m) => n + m[key], 0);

  const requests = $("chart-requests");
  columns(requests, {
    points: minutes.map((m) => ({ t: m.t, values: [m.requests - m.failed, m.failed], m })),
    series: [{ cls: "s-blue" }, { cls: "s-red" }],
    describe: (p) => `${formatClock(p.t)}: ${plural(p.m.requests, "request")}, ${p.m.failed} failed`,
    emptyText: "No requests in this window",
  });
  label(requests, `Requests per minute over ${span}: ${sum("requests")} requests, ${sum("failed")} failed.`);

  const tokens = $("chart-tokens");
  columns(tokens, {
    points: minutes.map((m) => ({ t: m.t, values: [m.completion_tokens, m.prompt_tokens], m })),
    series: [{ cls: "s-green" }, { cls: "s-purple" }],
    describe: (p) =>
      `${formatClock(p.t)}: ${formatCount(p.m.completion_tokens)} generated, ${formatCount(p.m.prompt_tokens)} prompt tokens`,
    emptyText: "No tokens in this window",
  });
  label(tokens, `Tokens per minute over ${span}: ${sum("completion_tokens")} generated, ${sum("prompt_tokens")} prompt tokens.`);

  const ttft = $("chart-ttft");
  const slo = history.slo.ttft_s;
  const slow = sum("slow_ttft");
  lines(ttft, {
    points: minutes.map((m) => ({ t: m.t, values: [m.ttft_p50_s, m.ttft_p95_s] })),
    series: [{ cls: "s-blue" }, { cls: "s-purple" }],
    threshold: { value: slo, label: `objective ${formatDuration(slo)}` },
    describe: (p) => `${formatClock(p.t)}: p50 ${formatDuration(p.values[0])}, p95 ${formatDuration(p.values[1])}`,
    emptyText: "No first tokens in this window",
  });
  label(ttft, `Time to first token per minute over ${span}, objective ${formatDuration(slo)}: ${slow} requests slower.`);

  const latency = $("chart-latency");
  const kinds = [
    ["ttft", "TTFT"],
    ["itl", "Inter-token"],
    ["e2e", "End-to-end"],
    ["queue_wait", "Queue wait"],
  ];
  bars(latency, {
    log: true,
    groups: kinds.map(([key, name]) => ({
      label: name,
      bars: [
        ["p50", "s-blue"],
        ["p90", "s-purple"],
        ["p99", "s-orange"],
      ].map(([q, cls]) => ({ value: stats.latency[key][q], cls, text: `${q} ${formatDuration(stats.latency[key][q])}` })),
    })),
    emptyText: "No requests yet",
  });
  label(
    latency,
    `Latency percentiles since start: ${kinds
      .map(([key, name]) => `${name} p50 ${formatDuration(stats.latency[key].p50)}, p99 ${formatDuration(stats.latency[key].p99)}`)
      .join("; ")}.`,
  );

  const statuses = $("chart-statuses");
  const byStatus = Object.entries(stats.totals.by_status);
  const total = byStatus.reduce((n, [, c]) => n + c, 0);
  const tone = (code) => (code.startsWith("2") ? "s-green" : code.startsWith("4") ? "s-amber" : code.startsWith("5") ? "s-red" : "s-gray");
  bars(statuses, {
    groups: byStatus.map(([code, count]) => ({
      label: code,
      bars: [{ value: count, cls: tone(code), text: `${formatCount(count)} · ${((100 * count) / total).toFixed(1)}%` }],
    })),
    barHeight: 18,
    emptyText: "No requests yet",
  });
  label(statuses, `Responses by status since start: ${byStatus.map(([c, n]) => `${c}: ${n}`).join(", ") || "none"}.`);
}

function uptime(s) {
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
}

function renderWorkers(workers) {
  const rows = workers.map((w) => {
    const tr = document.createElement("tr");
    const state = w.draining ? "draining" : !w.engine_ok ? "engine failed" : w.ready ? "ready" : "not ready";
    const cells = [String(w.pid), state, `${w.slots_busy} / ${w.slots_total}`, String(w.queued), formatCount(w.served), uptime(w.uptime_s)];
    cells.forEach((text, i) => {
      const td = document.createElement("td");
      if (i === 1) {
        const pill = document.createElement("span");
        pill.className = state === "ready" ? "pill" : "pill bad";
        pill.textContent = text;
        td.append(pill);
      } else {
        td.textContent = text;
      }
      if (i === 5) td.className = "wide-only";
      tr.append(td);
    });
    return tr;
  });
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 6;
    td.textContent = "No live worker has reported yet.";
    tr.append(td);
    rows.push(tr);
  }
  $("workers").replaceChildren(...rows);
}

// One table row per model and variant of /stats' `byModel` ({model: {variant: counts}}, in its
// order): the cells `cells(model, variant, counts)` gives, those at `wideOnly` hidden at phone width.
function variantRows(byModel, cells, wideOnly) {
  const rows = [];
  for (const [model, variants] of Object.entries(byModel)) {
    for (const [variant, m] of Object.entries(variants)) {
      const tr = document.createElement("tr");
      cells(model, variant, m).forEach((text, i) => {
        const td = document.createElement("td");
        td.textContent = text;
        if (wideOnly.includes(i)) td.className = "wide-only";
        tr.append(td);
      });
      rows.push(tr);
    }
  }
  return rows;
}

// One row per model and variant (/stats' "models": primary first): requests, failed, tokens, TTFT.
function renderModels(models) {
  const rows = variantRows(
    models,
    (model, variant, m) => [
      model,
      variant,
      formatCount(m.requests),
      formatCount(m.errors),
      formatCount(m.generation_tokens),
      formatDuration(m.ttft.p50),
      formatDuration(m.ttft.p90),
    ],
    [4, 6],
  );
  if (!rows.length) {
    const tr = document.createElement("tr");
    const td = document.createElement("td");
    td.colSpan = 7;
    td.textContent = "No model has answered yet.";
    tr.append(td);
    rows.push(tr);
  }
  $("models").replaceChildren(...rows);
}

// A share as a percentage, rounded down so that 100% means every one ("–" for none compared).
function percent(ratio) {
  return ratio === null ? "–" : `${Math.floor(ratio * 1000) / 10}%`;
}

// One row per shadow variant (/stats' "shadows"); the card stays hidden while there is none.
function renderShadows(shadows) {
  const rows = variantRows(
    shadows,
    (model, variant, s) => [
      model,
      variant,
      formatCount(s.mirrored),
      formatCount(s.exact),
      formatCount(s.diverged),
      formatCount(s.dropped),
      percent(s.exact_ratio),
    ],
    [3, 4, 5], // a phone shows the traffic and its exact share: the table fits without scrolling
  );
  $("shadows").replaceChildren(...rows);
  $("shadows-card").hidden = !rows.length;
}

function render() {
  if (!latest) return;
  const { stats, history } = latest;
  renderTiles(stats, history);
  renderCharts(stats, history);
  renderModels(stats.models);
  renderShadows(stats.shadows);
  renderWorkers(stats.workers);
}

async function refresh() {
  clearTimeout(timer);
  if (!document.hidden) {
    try {
      const minutes = windowSelect.value;
      const [stats, history] = await Promise.all([getJSON("/stats"), getJSON(`/stats/history?minutes=${minutes}`)]);
      latest = { stats, history };
      render();
      $("banner").hidden = true;
      $("updated").textContent = `Updated ${new Date().toLocaleTimeString()} · refreshes every ${REFRESH_MS / 1000} s`;
      root.dataset.updates = String(Number(root.dataset.updates) + 1);
    } catch (err) {
      $("banner").textContent = `Could not load the statistics (${err.message}); retrying every ${REFRESH_MS / 1000} s.`;
      $("banner").hidden = false;
    }
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

let pending = 0;
new ResizeObserver(() => {
  cancelAnimationFrame(pending);
  pending = requestAnimationFrame(render);
}).observe(document.querySelector(".charts"));
windowSelect.addEventListener("change", refresh);
document.addEventListener("visibilitychange", () => {
  if (!document.hidden) refresh();
});
refresh();
