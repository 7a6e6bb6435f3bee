// The learning dashboard: the server's own time series (GET /v1/dashboard/series, polled for the points since the
// last one) as small line charts, the adapters as a table (a row each), and the versions of the one chosen there
// (GET /v1/adapters) as a timeline with a rollback button.
import { api, notice, setupBar } from "./api.js";
import { COLORS, lineChart } from "./chart.js";

const SERIES_MS = 2000;
const ADAPTERS_MS = 3000;
const bytes = (v) => (v >= 1 << 30 ? `${(v / (1 << 30)).toFixed(2)} GiB` : v >= 1 << 20 ? `${(v / (1 << 20)).toFixed(1)} MiB`
  : v >= 1024 ? `${(v / 1024).toFixed(0)} KiB` : `${v} B`);
const seconds = (v) => (v < 1 ? `${(v * 1000).toFixed(0)} ms` : `${v.toFixed(2)} s`);
const number = (v) => (Math.abs(v) >= 100 || Number.isInteger(v) ? v.toFixed(0) : v.toPrecision(3));
const percent = (v) => `${(v * 100).toFixed(0)}%`;

const CHARTS = [
  { title: "Training loss", lines: ["training_loss"] },
  { title: "Training samples / s", lines: ["training_samples_per_s"] },
  { title: "Training tokens / s", lines: ["training_tokens_per_s"] },
  { title: "Feedback backlog (queued)", lines: ["feedback_backlog"] },
  { title: "Replay hit rate", lines: ["replay_hit_rate"], format: percent },
  { title: "Record staleness (versions)", lines: ["replay_staleness"] },
  { title: "TTFT", lines: ["ttft_p50_s", "ttft_p99_s"], names: ["p50", "p99"], format: seconds },
  { title: "TPOT", lines: ["tpot_p50_s", "tpot_p99_s"], names: ["p50", "p99"], format: seconds },
  { title: "Requests", lines: ["requests_running", "requests_waiting"], names: ["running", "waiting"] },
  { title: "Generated tokens / s", lines: ["generation_tokens_per_s"] },
  { title: "KV cache in use", lines: ["kv_cache_usage"], format: percent },
  {
    title: "Activation store", lines: ["activation_bytes_device", "activation_bytes_host", "activation_bytes_disk"],
    names: ["device", "host", "disk"], format: bytes,
  },
];

const data = { t: [], series: {}, capacity: 600 };

function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  node.append(...children);
  return node;
}

function buildCharts() {
  const root = document.getElementById("charts");
  for (const chart of CHARTS) {
    chart.format ??= number;
    chart.last = h("span", { class: "last" }, "–");
    chart.svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    chart.svg.setAttribute("role", "img");
    chart.svg.setAttribute("aria-label", chart.title);
    chart.axis = [h("span", {}, ""), h("span", {}, "")];
    const legend = (chart.names || []).map((name, i) =>
      h("span", {}, h("i", { style: `background:${COLORS[i]}` }), name));
    root.append(h("figure", { class: "chart card", "data-series": chart.lines.join(" ") },
      h("figcaption", {}, chart.title, chart.last), chart.svg, h("div", { class: "axis" }, ...chart.axis),
      h("div", { class: "legend" }, ...legend)));
  }
}

function drawCharts() {
  const { t } = data;
  if (!t.length) return;
  const minutes = ((t[t.length - 1] - t[0]) / 60).toFixed(1);
  document.getElementById("span").textContent = `last ${minutes} min, a point a second`;
  for (const chart of CHARTS) {
    const lines = chart.lines.map((name) => data.series[name] || []);
    const { lo, hi } = lineChart(chart.svg, t, lines);
    const latest = lines.map((line) => line[line.length - 1]);
    chart.last.textContent = latest.every((v) => v == null) ? "–"
      : latest.map((v) => (v == null ? "–" : chart.format(v))).join(" / ");
    chart.axis[0].textContent = hi == null ? "" : `${chart.format(lo)} – ${chart.format(hi)}`;
    chart.axis[1].textContent = "now";
  }
}

async function pollSeries() {
  try {
    const since = data.t.length ? `?since=${data.t[data.t.length - 1]}` : "";
    const got = await api(`/v1/dashboard/series${since}`, { admin: true });  // read as /metrics is: admin unless public
    data.capacity = got.capacity;
    const cut = Math.max(0, data.t.length + got.t.length - data.capacity);
    data.t = data.t.concat(got.t).slice(cut);
    for (const [name, values] of Object.entries(got.series)) {
      data.series[name] = (data.series[name] || []).concat(values).slice(cut);
    }
    drawCharts();
  } catch (e) {
    notice(`Series: ${e.message}`);
  }
  setTimeout(pollSeries, SERIES_MS);
}

function describe(v) {
  const m = v.metrics || {};
  if (m.rollback_of != null) return `rollback to v${m.rollback_of}`;
  const parts = [];
  if (m.loss != null) parts.push(`loss ${number(m.loss)}`);
  if (m.samples != null) parts.push(`${m.samples} samples`);
  if (m.response_tokens != null) parts.push(`${m.response_tokens} tokens`);
  if (m.anchor_kl != null) parts.push(`anchor KL ${number(m.anchor_kl)}`);
  return parts.join(", ");
}

function versionItem(v, serving, adapter) {
  const when = new Date(v.created * 1000).toLocaleTimeString();
  const item = h("li", { class: v.version === serving ? "serving" : "", "data-version": v.version },
    h("span", { class: "v" }, `v${v.version}`), h("span", {}, when), h("span", {}, describe(v)));
  if (v.version === serving) item.append(h("span", { class: "badge" }, "serving"));
  else item.append(rollbackButton(v.version, adapter));
  return item;
}

// ``adapter``: a named adapter's name; null: the shared adapter.
function rollbackButton(version, adapter) {
  const button = h("button", { type: "button" }, `Roll back to v${version}`);
  button.addEventListener("click", async () => {
    const what = version ? `version ${version}` : "the base model (v0)";
    const whose = adapter == null ? "" : ` of ${adapter}`;
    if (!confirm(`Serve ${what}${whose} again? It is published as a new version; training continues from it.`)) return;
    try {
      const body = adapter == null ? { version } : { version, adapter };
      await api("/v1/adapters/rollback", { method: "POST", body, admin: true });
      notice("");
      await pollAdapters(false);
    } catch (e) {
      notice(`Rollback failed: ${e.message}`);
    }
  });
  return button;
}

// The adapters table (GET /v1/adapters/summary: the shared adapter and the named ones the key may use, a row each);
// the row chosen has its versions shown below. Its name is a button, so that the keyboard chooses too.
const RESIDENCE = { engine: "in the engine", memory: "in memory", disk: "on disk" };
let adapters = [];  // the summary's last rows
let chosen = null;  // the adapter whose versions are shown: a named adapter's name; null: the shared adapter

function adapterRow(name) {
  const title = `Show the versions of ${name ?? "the shared adapter"}`;
  const tr = h("tr", { "data-adapter": name ?? "" },
    h("th", { scope: "row" }, h("button", { type: "button", title }, name ?? "shared")),
    h("td", { class: "serving" }), h("td", { class: "training" }), h("td", { class: "backlog" }),
    h("td", { class: "residence" }));
  tr.addEventListener("click", () => choose(name));  // the button's click (mouse or keyboard) bubbles here too
  return tr;
}

function fillRow(tr, row) {
  const mine = row.adapter === chosen;
  tr.classList.toggle("chosen", mine);
  tr.querySelector("button").setAttribute("aria-pressed", String(mine));
  const cells = tr.querySelectorAll("td");
  cells[0].textContent = row.serving_version == null ? "as loaded" : `v${row.serving_version}`;
  cells[1].textContent = row.training;
  cells[1].className = `training ${row.training}`;
  cells[2].textContent = String(row.backlog);
  cells[3].textContent = RESIDENCE[row.residence] || row.residence;
}

// Rows are updated in place, and only added or removed when the adapters change: a redraw every poll would take the
// keyboard's focus off the row button it is on.
function drawAdapters() {
  const body = document.querySelector("#adapters tbody");
  const keys = adapters.map((row) => row.adapter ?? "");
  const kept = new Map([...body.rows].map((tr) => [tr.dataset.adapter, tr]));
  const trs = adapters.map((row, i) => kept.get(keys[i]) ?? adapterRow(row.adapter));
  if (keys.join("\n") !== [...body.rows].map((tr) => tr.dataset.adapter).join("\n")) body.replaceChildren(...trs);
  trs.forEach((tr, i) => fillRow(tr, adapters[i]));
}

function choose(name) {
  if (name === chosen) return;
  chosen = name;
  drawAdapters();
  document.getElementById("serving").textContent = "…";
  document.getElementById("timeline").replaceChildren();  // not the previous adapter's versions under this name
  pollAdapters(false);
}

// The chosen adapter's versions (GET /v1/adapters[?adapter=NAME]) as a timeline, with a rollback button each.
async function drawVersions(row) {
  const name = chosen;
  document.getElementById("versions-of").textContent = name ?? "the shared adapter";
  const serving = document.getElementById("serving");
  const timeline = document.getElementById("timeline");
  if (name != null && row.training !== "on") {  // nothing trains it here: it has no versions (the list is a 404)
    serving.textContent = "Served as loaded from its directory; nothing trains it on this server, so it has no "
      + "versions here.";
    timeline.replaceChildren();
    return;
  }
  const list = await api(name == null ? "/v1/adapters" : `/v1/adapters?adapter=${encodeURIComponent(name)}`);
  if (name !== chosen) return;  // another was chosen meanwhile: its own call draws it
  const version = list.serving_version;
  serving.textContent = `Serving v${version}${version ? "" : " (the base model)"}; `
    + (list.training ? "training on." : "training off (--no-train).");
  const items = list.data.map((v) => versionItem(v, version, name));
  // The base model is the shared adapter's v0 alone: a named adapter serves a version >= 1 (1: as loaded).
  if (name == null && version !== 0) {
    items.push(h("li", { "data-version": 0 }, h("span", { class: "v" }, "v0"), h("span", {}, "the base model"),
      rollbackButton(0, null)));
  }
  if (!items.length) {
    items.push(h("li", { class: "serving", "data-version": 0 }, h("span", { class: "v" }, "v0"),
      h("span", {}, "the base model: nothing trained yet"), h("span", { class: "badge" }, "serving")));
  }
  timeline.replaceChildren(...items);
}

async function pollAdapters(again = true) {
  try {
    adapters = (await api("/v1/adapters/summary")).data;
    if (!adapters.some((row) => row.adapter === chosen)) chosen = null;  // unloaded: back to the shared adapter
    drawAdapters();
    await drawVersions(adapters.find((row) => row.adapter === chosen));
  } catch (e) {
    notice(`Adapters: ${e.message}`);
  }
  if (again) setTimeout(pollAdapters, ADAPTERS_MS);
}

setupBar();
buildCharts();
pollSeries();
pollAdapters();
