// Small hand-written SVG charts for the status page: per-minute columns, percentile lines, and
// horizontal bars. Each function redraws one <svg> at its current pixel width (so text stays
// legible on a phone) and marks every data shape with the class "mark"; colours come from CSS
// classes (s-blue, s-red, …) so the page's light and dark themes apply.

const NS = "http://www.w3.org/2000/svg";

/** Append an SVG element with attributes (and text) to parent; return it. */
export function el(parent, name, attrs = {}, text = null) {
  const node = document.createElementNS(NS, name);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  if (text !== null) node.textContent = text;
  parent.append(node);
  return node;
}

function tip(node, text) {
  el(node, "title", {}, text);
  return node;
}

/** Format a duration in seconds: 850 µs, 12.5 ms, 1.2 s. */
export function formatDuration(s) {
  if (s === null || s === undefined || !Number.isFinite(s)) return "—";
  const abs = Math.abs(s);
  // Three significant digits, trailing zeros dropped: 17.5 ms, 1 s, 250 µs.
  const fmt = (v) => String(Number(v.toPrecision(3)));
  if (abs === 0) return "0 s";
  if (abs < 1e-3) return `${fmt(s * 1e6)} µs`;
  if (abs < 1) return `${fmt(s * 1e3)} ms`;
  return `${fmt(s)} s`;
}

/** Format a count compactly: 950, 1.2k, 3.4M. */
export function formatCount(n) {
  const abs = Math.abs(n);
  if (abs >= 1e6) return `${(n / 1e6).toFixed(abs >= 1e7 ? 0 : 1)}M`;
  if (abs >= 1e4) return `${(n / 1e3).toFixed(0)}k`;
  if (abs >= 1e3) return `${(n / 1e3).toFixed(1)}k`;
  return Number.isInteger(n) ? String(n) : n.toFixed(1);
}

/** Local time of Unix seconds as HH:MM. */
export function formatClock(t) {
  const d = new Date(t * 1000);
  return `${String(d.getHours()).padStart(2, "0")}:${String(d.getMinutes()).padStart(2, "0")}`;
}

// A "nice" linear axis from 0: the smallest 1/2/5×10^k step giving at most `ticks` intervals.
function linearAxis(max, ticks = 4) {
  if (!(max > 0)) return { max: 1, step: 1 };
  const raw = max / ticks;
  const mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  return { max: Math.ceil(max / step) * step, step };
}

// A log axis over whole decades, at least two of them, covering every value.
function logAxis(values) {
  const positive = values.filter((v) => v > 0);
  if (!positive.length) return { lo: 1e-3, hi: 1 };
  let lo = 10 ** Math.floor(Math.log10(Math.min(...positive)));
  const hi = 10 ** Math.ceil(Math.log10(Math.max(...positive)) + 1e-9);
  if (hi / lo < 100) lo = hi / 100;
  return { lo, hi };
}

function decades({ lo, hi }) {
  const out = [];
  for (let e = Math.round(Math.log10(lo)); e <= Math.round(Math.log10(hi)); e += 1) out.push(10 ** e);
  return out;
}

function frame(svg, height, margin) {
  svg.replaceChildren();
  const width = Math.max(240, Math.round(svg.getBoundingClientRect().width || svg.parentElement.clientWidth));
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("height", String(height));
  const plot = {
    left: margin.left,
    top: margin.top,
    right: width - margin.right,
    bottom: height - margin.bottom,
  };
  plot.width = plot.right - plot.left;
  plot.height = plot.bottom - plot.top;
  return { width, height, plot };
}

function emptyNote(svg, box, text) {
  el(svg, "text", { class: "empty", x: box.width / 2, y: box.height / 2, "text-anchor": "middle" }, text);
}

// The time axis of per-minute charts: a label every k minutes, k chosen to fit the width.
function timeAxis(svg, plot, points, band) {
  const axis = el(svg, "g", { class: "axis" });
  const fit = Math.max(2, Math.floor(plot.width / 64));
  const k = [1, 2, 5, 10, 15, 30, 60, 120].find((m) => points.length / m <= fit) ?? 240;
  points.forEach((p, i) => {
    if (Math.round(p.t / 60) % k !== 0) return;
    const x = plot.left + (i + 0.5) * band;
    el(axis, "text", { x, y: plot.bottom + 17, "text-anchor": "middle" }, formatClock(p.t));
  });
}

function yGridLinear(svg, plot, axis, format) {
  const grid = el(svg, "g", { class: "grid" });
  const labels = el(svg, "g", { class: "axis" });
  for (let v = 0; v <= axis.max + axis.step / 2; v += axis.step) {
    const y = plot.bottom - (v / axis.max) * plot.height;
    el(grid, "line", { x1: plot.left, x2: plot.right, y1: y, y2: y });
    el(labels, "text", { x: plot.left - 8, y: y + 4, "text-anchor": "end" }, format(v));
  }
}

/**
 * Stacked columns, one per minute. points: [{t, values: [..]}]; series: [{label, cls}] (bottom first);
 * describe(point) gives each column's tooltip. Returns the number of non-empty columns.
 */
export function columns(svg, { points, series, describe, format = formatCount, emptyText, height = 210 }) {
  const box = frame(svg, height, { left: 46, right: 10, top: 12, bottom: 26 });
  const { plot } = box;
  const totals = points.map((p) => p.values.reduce((a, b) => a + b, 0));
  const axis = linearAxis(Math.max(0, ...totals));
  yGridLinear(svg, plot, axis, format);
  const band = plot.width / Math.max(1, points.length);
  const barWidth = Math.max(1, Math.min(28, band * 0.72));
  const marks = el(svg, "g");
  let drawn = 0;
  points.forEach((p, i) => {
    if (!totals[i]) return;
    drawn += 1;
    const group = tip(el(marks, "g"), describe(p));
    let y = plot.bottom;
    p.values.forEach((v, s) => {
      if (!v) return;
      const h = Math.max(1, (v / axis.max) * plot.height);
      y -= h;
      const x = plot.left + (i + 0.5) * band - barWidth / 2;
      el(group, "rect", { class: `mark ${series[s].cls}`, x, y, width: barWidth, height: h, rx: Math.min(2, barWidth / 4) });
    });
  });
  el(svg, "line", { class: "baseline", x1: plot.left, x2: plot.right, y1: plot.bottom, y2: plot.bottom });
  timeAxis(svg, plot, points, band);
  if (!drawn) emptyNote(svg, box, emptyText);
  return drawn;
}

/**
 * Lines over minutes on a log scale (durations), with an optional threshold line.
 * points: [{t, values: [v | null, ..]}]; series: [{label, cls}]. Returns the number of points drawn.
 */
export function lines(svg, { points, series, threshold = null, describe, emptyText, height = 210 }) {
  const box = frame(svg, height, { left: 58, right: 10, top: 14, bottom: 26 });
  const { plot } = box;
  const all = points.flatMap((p) => p.values).filter((v) => v !== null && v > 0);
  const scale = logAxis(threshold ? [...all, threshold.value] : all);
  const y = (v) => plot.bottom - (Math.log10(v / scale.lo) / Math.log10(scale.hi / scale.lo)) * plot.height;
  const grid = el(svg, "g", { class: "grid" });
  const labels = el(svg, "g", { class: "axis" });
  for (const v of decades(scale)) {
    el(grid, "line", { x1: plot.left, x2: plot.right, y1: y(v), y2: y(v) });
    el(labels, "text", { x: plot.left - 8, y: y(v) + 4, "text-anchor": "end" }, formatDuration(v));
  }
  const band = plot.width / Math.max(1, points.length);
  const x = (i) => plot.left + (i + 0.5) * band;
  if (threshold) {
    el(svg, "line", { class: "threshold", x1: plot.left, x2: plot.right, y1: y(threshold.value), y2: y(threshold.value) });
    el(svg, "text", { class: "threshold-label", x: plot.right - 4, y: y(threshold.value) - 6, "text-anchor": "end" }, threshold.label);
  }
  let drawn = 0;
  series.forEach((s, k) => {
    let d = "";
    let open = false;
    points.forEach((p, i) => {
      const v = p.values[k];
      if (v === null || !(v > 0)) {
        open = false;
        return;
      }
      d += `${open ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)}`;
      open = true;
    });
    if (d) el(svg, "path", { class: `line ${s.cls}`, d });
  });
  const dots = el(svg, "g");
  points.forEach((p, i) => {
    if (!p.values.some((v) => v !== null && v > 0)) return;
    const group = tip(el(dots, "g"), describe(p));
    series.forEach((s, k) => {
      const v = p.values[k];
      if (v === null || !(v > 0)) return;
      drawn += 1;
      el(group, "circle", { class: `mark dot ${s.cls}`, cx: x(i), cy: y(v), r: 3.5 });
    });
  });
  el(svg, "line", { class: "baseline", x1: plot.left, x2: plot.right, y1: plot.bottom, y2: plot.bottom });
  timeAxis(svg, plot, points, band);
  if (!drawn) emptyNote(svg, box, emptyText);
  return drawn;
}

/**
 * Horizontal bars in labelled groups. groups: [{label, bars: [{label, value, cls, text}]}];
 * log: a log scale (durations) instead of linear from zero. Returns the number of bars drawn.
 */
export function bars(svg, { groups, log = false, format = formatCount, emptyText, barHeight = 14 }) {
  const rows = groups.reduce((n, g) => n + g.bars.length, 0);
  const gap = 12;
  const height = 30 + rows * (barHeight + 4) + groups.length * gap;
  const labelWidth = Math.max(...groups.map((g) => g.label.length), 3) * 7.5 + 14;
  const box = frame(svg, height, { left: labelWidth, right: 118, top: 6, bottom: 24 });
  const { plot } = box;
  const values = groups.flatMap((g) => g.bars.map((b) => b.value)).filter((v) => v !== null && v > 0);
  let pos;
  const grid = el(svg, "g", { class: "grid" });
  const labels = el(svg, "g", { class: "axis" });
  if (log) {
    const scale = logAxis(values);
    pos = (v) => plot.left + (Math.log10(v / scale.lo) / Math.log10(scale.hi / scale.lo)) * plot.width;
    const ticks = decades(scale);
    const every = Math.ceil(ticks.length / Math.max(2, Math.floor(plot.width / 56)));
    ticks.forEach((v, i) => {
      el(grid, "line", { x1: pos(v), x2: pos(v), y1: plot.top, y2: plot.bottom });
      if (i % every === 0) el(labels, "text", { x: pos(v), y: plot.bottom + 17, "text-anchor": "middle" }, formatDuration(v));
    });
  } else {
    const axis = linearAxis(Math.max(0, ...values), Math.max(2, Math.floor(plot.width / 70)));
    pos = (v) => plot.left + (v / axis.max) * plot.width;
    for (let v = 0; v <= axis.max + axis.step / 2; v += axis.step) {
      el(grid, "line", { x1: pos(v), x2: pos(v), y1: plot.top, y2: plot.bottom });
      el(labels, "text", { x: pos(v), y: plot.bottom + 17, "text-anchor": "middle" }, format(v));
    }
  }
  let y = plot.top + gap / 2;
  let drawn = 0;
  for (const group of groups) {
    const top = y;
    for (const bar of group.bars) {
      const has = bar.value !== null && bar.value > 0;
      if (has) {
        drawn += 1;
        const w = Math.max(2, pos(bar.value) - plot.left);
        tip(el(svg, "rect", { class: `mark ${bar.cls}`, x: plot.left, y, width: w, height: barHeight, rx: 2 }), bar.text);
      }
      const end = has ? pos(bar.value) : plot.left;
      el(svg, "text", { class: "value-label", x: end + 6, y: y + barHeight - 3 }, bar.text);
      y += barHeight + 4;
    }
    const mid = (top + y - 4) / 2;
    el(labels, "text", { x: plot.left - 10, y: mid + 4, "text-anchor": "end", class: "label" }, group.label);
    y += gap;
  }
  el(svg, "line", { class: "baseline", x1: plot.left, x2: plot.left, y1: plot.top, y2: plot.bottom });
  if (!drawn) emptyNote(svg, box, emptyText);
  return drawn;
}
