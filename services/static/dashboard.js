// TurnRL dashboard: polls /v1/runs/{id}/metrics with a byte cursor (only new rows travel) and
// redraws small SVG line charts. No libraries: the service runs where there may be no network.
"use strict";

const CHARTS = [
  {id: "chart-gen", series: [["throughput/gen_tokens_per_s", "generated tokens/s"]]},
  {id: "chart-train", series: [["throughput/samples_per_s", "samples/s (trained)"],
                               ["throughput/episodes_per_s", "episodes/s (generated)"]]},
  {id: "chart-reward", series: [["reward/outcome_mean", "mean outcome reward"],
                                ["rollout/success_rate", "training success rate"],
                                ["eval/success", "held-out success"]]},
  {id: "chart-staleness", series: [["staleness/mean", "mean"], ["staleness/max", "max"]]},
  {id: "chart-replay", series: [["replay/ready", "ready"], ["replay/running", "being generated"]]},
  // shown only for runs that serve live traffic (their rows carry live/* metrics)
  {id: "chart-live", optional: true, series: [["live/requests_per_s", "requests/s"], ["live/recorded_per_s", "episodes recorded/s"],
                              ["live/sessions_open", "sessions open"], ["live/shed", "shed (total)"]]},
];
const COLORS = ["#2e90fa", "#f79009", "#12b76a", "#9e77ed"];
const KEYS = ["step", ...CHARTS.flatMap((c) => c.series.map((s) => s[0]))];
const TERMINAL = new Set(["succeeded", "stopped", "failed", "lost"]);
const SVG_NS = "http://www.w3.org/2000/svg";

let view = {run: null, cursor: 0, rows: [], timer: null};

async function api(path, options = {}) {
  const res = await fetch(path, {credentials: "same-origin", ...options});
  if (res.status === 401) { location.reload(); throw new Error("signed out"); }
  if (!res.ok) throw new Error(`${path}: HTTP ${res.status}`);
  return res.status === 204 ? null : res.json();
}

function el(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function fmt(v) {
  const a = Math.abs(v);
  if (a >= 1000) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  if (a >= 1 || a === 0) return v.toFixed(2);
  return v.toPrecision(2);
}

function niceTicks(lo, hi, count) {
  const raw = (hi - lo) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const ticks = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) ticks.push(t);
  return ticks;
}

function points(rows, key) {
  return rows.filter((r) => typeof r[key] === "number" && Number.isFinite(r[key]) && typeof r.step === "number")
             .map((r) => [r.step, r[key]]);
}

function drawChart(chart) {
  const svg = document.getElementById(chart.id);
  const W = svg.clientWidth || 420, H = svg.clientHeight || 210;
  const pad = {l: 50, r: 12, t: 10, b: 24};
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const series = chart.series.map(([key, label], i) => ({key, label, color: COLORS[i], pts: points(view.rows, key)}))
                             .filter((s) => s.pts.length > 0);
  const all = series.flatMap((s) => s.pts);
  svg.dataset.points = String(all.length);
  if (chart.optional) svg.closest("section").hidden = all.length === 0;
  renderLegend(svg, series);
  if (!all.length) {
    svg.appendChild(el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, "waiting for data"));
    return;
  }
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(0, ...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) y1 = y0 + 1;
  y1 += (y1 - y0) * 0.05;
  const sx = (x) => pad.l + ((x - x0) / (x1 - x0)) * (W - pad.l - pad.r);
  const sy = (y) => H - pad.b - ((y - y0) / (y1 - y0)) * (H - pad.t - pad.b);
  for (const t of niceTicks(y0, y1, 4)) {
    svg.appendChild(el("line", {x1: pad.l, x2: W - pad.r, y1: sy(t), y2: sy(t), class: "grid"}));
    svg.appendChild(el("text", {x: pad.l - 6, y: sy(t) + 4, "text-anchor": "end"},
                       Number.isInteger(t) ? String(t) : fmt(t)));
  }
  for (const t of niceTicks(x0, x1, 5).filter(Number.isInteger)) {
    svg.appendChild(el("text", {x: sx(t), y: H - 6, "text-anchor": "middle"}, String(t)));
  }
  svg.appendChild(el("line", {x1: pad.l, x2: pad.l, y1: pad.t, y2: H - pad.b, class: "axis"}));
  svg.appendChild(el("line", {x1: pad.l, x2: W - pad.r, y1: H - pad.b, y2: H - pad.b, class: "axis"}));
  for (const s of series) {
    const path = s.pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
    svg.appendChild(el("polyline", {points: path, fill: "none", stroke: s.color, "stroke-width": 1.8,
                                    "data-key": s.key}));
    if (s.pts.length <= 300) {  // dots help with few points and only clutter with many
      for (const p of s.pts) svg.appendChild(el("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 2.6, fill: s.color,
                                                           class: "point"}));
    }
  }
}

function renderLegend(svg, series) {
  const legend = svg.nextElementSibling;
  legend.replaceChildren(...series.map((s) => {
    const item = document.createElement("span");
    const swatch = document.createElement("span");
    swatch.className = "swatch";
    swatch.style.background = s.color;
    item.append(swatch, `${s.label}: ${fmt(s.pts[s.pts.length - 1][1])}`);
    return item;
  }));
}

function renderStatus(run) {
  const status = document.getElementById("status");
  status.textContent = run.status;
  status.className = "status " + run.status;
  document.getElementById("progress").textContent = `step ${run.step} / ${run.total_steps}`;
  document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
}

async function tick() {
  clearTimeout(view.timer);
  const run = view.run;
  if (!run) return;
  let delay = 1000;
  try {
    const query = `cursor=${view.cursor}&keys=${encodeURIComponent(KEYS.join(","))}`;
    const [detail, page] = await Promise.all([api(`/v1/runs/${encodeURIComponent(run)}`),
                                              api(`/v1/runs/${encodeURIComponent(run)}/metrics?${query}`)]);
    if (run !== view.run) return;  // another run was chosen while this request was in flight
    view.cursor = page.cursor;
    view.rows.push(...page.rows);
    renderStatus(detail);
    CHARTS.forEach(drawChart);
    if (TERMINAL.has(detail.status)) delay = 10000;  // finished: nothing new is coming soon
  } catch (err) {
    document.getElementById("updated").textContent = String(err.message || err);
    delay = 3000;
  }
  view.timer = setTimeout(tick, delay);
}

function selectRun(id) {
  clearTimeout(view.timer);
  view = {run: id || null, cursor: 0, rows: [], timer: null};
  const url = new URL(location.href);
  if (id) url.searchParams.set("run", id); else url.searchParams.delete("run");
  history.replaceState(null, "", url);
  CHARTS.forEach(drawChart);
  tick();
}

async function listRuns() {
  const {runs} = await api("/v1/runs");
  const select = document.getElementById("run");
  if (runs.length) {
    const current = select.value;
    select.replaceChildren(...runs.map((r) => new Option(`${r.id} (${r.status})`, r.id)));
    if (current && runs.some((r) => r.id === current)) select.value = current;
  }
  return runs;
}

async function loadRuns() {
  const runs = await listRuns();
  const wanted = new URL(location.href).searchParams.get("run");
  const chosen = runs.some((r) => r.id === wanted) ? wanted : (runs[0] && runs[0].id);
  if (chosen) document.getElementById("run").value = chosen;
  selectRun(chosen);
  setInterval(() => listRuns().catch(() => null), 15000);  // runs submitted after the page loaded
}

document.getElementById("run").addEventListener("change", (e) => selectRun(e.target.value));
document.getElementById("logout").addEventListener("click", async () => {
  await api("/v1/session", {method: "DELETE"}).catch(() => null);
  location.reload();
});
window.addEventListener("resize", () => CHARTS.forEach(drawChart));
loadRuns().catch((err) => { document.getElementById("updated").textContent = String(err.message || err); });
