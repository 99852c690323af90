// pagedllm's web page: chat, speech (audio models) and live memory, over the server's own API. No framework, no
// build step, nothing fetched from elsewhere: the page works on a machine with no internet.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "pagedllm.conversations";
const state = {
  key: sessionStorage.getItem("pagedllm.key") || "",
  model: null,
  conversations: JSON.parse(localStorage.getItem(STORE) || "[]"),
  current: null, // the conversation shown
  abort: null, // the reply being streamed
  series: [], // the last minutes of /metrics samples
  lastCounters: null,
};
const SERIES_SECONDS = 300;

// -- the API ----------------------------------------------------------------------------------------------------
function headers(json = true) {
  const h = json ? { "Content-Type": "application/json" } : {};
  if (state.key) h["Authorization"] = `Bearer ${state.key}`;
  return h;
}

class APIError extends Error {}

async function api(path, body, signal) {
  const response = await fetch(path, body === undefined ? { headers: headers(false), signal }
    : { method: "POST", headers: headers(), body: JSON.stringify(body), signal });
  if (!response.ok) throw new APIError(await errorText(response));
  return response;
}

async function errorText(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    message = (body.error && (body.error.message || body.error)) || body.detail || message;
  } catch (e) { /* not JSON */ }
  if (response.status === 401) askForKey();
  return `${response.status}: ${message}`;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = !message;
}

function askForKey() {
  const dialog = $("key-dialog");
  if (!dialog.open) dialog.showModal();
}

$("key-form").addEventListener("submit", () => {
  state.key = $("key-input").value.trim();
  sessionStorage.setItem("pagedllm.key", state.key); // this tab only
  showError("");
  start();
});
$("key-button").addEventListener("click", askForKey);

// Server-sent events of a streamed response: each `data:` payload, parsed, up to [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// -- views ------------------------------------------------------------------------------------------------------
for (const button of document.querySelectorAll("nav button")) {
  button.addEventListener("click", () => showView(button.dataset.view));
}

function showView(name) {
  for (const button of document.querySelectorAll("nav button")) button.classList.toggle("active", button.dataset.view === name);
  for (const view of ["chat", "speech", "memory"]) $(`${view}-view`).hidden = view !== name;
  if (name === "memory") refreshMemory();
}

// -- chat -------------------------------------------------------------------------------------------------------
function save() {
  localStorage.setItem(STORE, JSON.stringify(state.conversations));
}

function newConversation() {
  const conversation = { id: Date.now().toString(36), title: "New chat", messages: [] };
  state.conversations.unshift(conversation);
  state.current = conversation;
  save();
  render();
}

function render() {
  const list = $("conversation-list");
  list.replaceChildren();
  for (const c of state.conversations) {
    const item = document.createElement("li");
    item.textContent = c.title;
    item.classList.toggle("current", c === state.current);
    item.addEventListener("click", () => { state.current = c; render(); });
    list.append(item);
  }
  const messages = $("messages");
  messages.replaceChildren();
  if (!state.current) return;
  state.current.messages.forEach((m, i) => messages.append(messageElement(m, i)));
  messages.scrollTop = messages.scrollHeight;
}

function messageElement(m, index) {
  const box = document.createElement("div");
  box.className = `message ${m.role}` + (m.error ? " failed" : "");
  if (m.reasoning) {
    const fold = document.createElement("details");
    fold.className = "reasoning";
    fold.innerHTML = "<summary>Reasoning</summary>";
    const text = document.createElement("div");
    text.className = "reasoning-text";
    text.textContent = m.reasoning;
    fold.append(text);
    box.append(fold);
  }
  const text = document.createElement("div");
  text.className = "text";
  text.textContent = m.error ? m.error : m.content;
  box.append(text);
  const meta = document.createElement("div");
  meta.className = "meta";
  if (m.stats) meta.append(Object.assign(document.createElement("span"), { className: "stats", textContent: m.stats }));
  const action = (label, fn) => {
    const button = Object.assign(document.createElement("button"), { type: "button", textContent: label });
    button.addEventListener("click", fn);
    meta.append(button);
  };
  action("Copy", () => copy(m.content));
  if (m.role === "user") action("Edit", () => editFrom(index));
  if (m.role === "assistant" && index === state.current.messages.length - 1) action("Regenerate", regenerate);
  box.append(meta);
  return box;
}

async function copy(text) {
  try {
    await navigator.clipboard.writeText(text);
  } catch (e) { // (no clipboard API on plain http): a hidden textarea, selected
    const area = Object.assign(document.createElement("textarea"), { value: text });
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
}

function editFrom(index) {
  if (state.abort) return;
  $("prompt").value = state.current.messages[index].content;
  state.current.messages.splice(index);
  save();
  render();
  $("prompt").focus();
}

function regenerate() {
  if (state.abort) return;
  state.current.messages.pop();
  save();
  reply();
}

$("new-chat").addEventListener("click", newConversation);
$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.abort) return;
  if (!state.current) newConversation();
  if (!state.current.messages.length) state.current.title = text.slice(0, 40);
  state.current.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  save();
  reply();
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => state.abort && state.abort.abort());

function requestMessages() {
  const system = $("system-prompt").value.trim();
  const turns = state.current.messages.filter((m) => !m.error).map((m) => ({ role: m.role, content: m.content }));
  return system ? [{ role: "system", content: system }, ...turns] : turns;
}

async function reply() {
  const conversation = state.current;
  const message = { role: "assistant", content: "", reasoning: "" };
  const body = {
    model: state.model, messages: requestMessages(), stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: Number($("max-tokens").value),
  };
  conversation.messages.push(message);
  render();
  const box = $("messages").lastElementChild;
  state.abort = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  const started = performance.now();
  let first = null, usage = null;
  try {
    const response = await api("/v1/chat/completions", body, state.abort.signal);
    for await (const chunk of events(response)) {
      if (chunk.error) throw new APIError(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (!delta) continue;
      if (delta.reasoning_content || delta.content) first = first || performance.now();
      message.reasoning += delta.reasoning_content || "";
      message.content += delta.content || "";
      if (delta.tool_calls) message.content += delta.tool_calls.map((t) => JSON.stringify(t.function)).join("\n");
      updateStreaming(box, message);
    }
  } catch (e) {
    if (e.name !== "AbortError") message.error = `${e.message}`;
  } finally {
    const end = performance.now();
    const tokens = usage ? usage.completion_tokens : null;
    const parts = [];
    if (tokens !== null) parts.push(`${usage.prompt_tokens} prompt + ${tokens} tokens`);
    if (first !== null) parts.push(`first token ${((first - started) / 1000).toFixed(2)} s`);
    if (tokens && first !== null && end > first) parts.push(`${(tokens / ((end - first) / 1000)).toFixed(1)} tokens/s`);
    if (state.abort.signal.aborted) parts.push("stopped");
    message.stats = parts.join(" · ");
    state.abort = null;
    $("send").hidden = false;
    $("stop").hidden = true;
    save();
    if (conversation === state.current) render();
  }
}

function updateStreaming(box, message) {
  let fold = box.querySelector("details.reasoning");
  if (message.reasoning && !fold) {
    fold = document.createElement("details");
    fold.className = "reasoning";
    fold.innerHTML = "<summary>Reasoning…</summary><div class='reasoning-text'></div>";
    box.prepend(fold);
  }
  if (fold) fold.querySelector(".reasoning-text").textContent = message.reasoning;
  box.querySelector(".text").textContent = message.content;
  $("messages").scrollTop = $("messages").scrollHeight;
}

// -- speech (audio models) ---------------------------------------------------------------------------------------
const SAMPLE_RATE = 24000; // the audio tokenizer's; a WAV stream's header says it too

async function setUpSpeech() {
  let voices;
  try {
    voices = await (await api("/v1/audio/voices")).json();
  } catch (e) {
    return; // a text model: no speech view
  }
  $("speech-tab").hidden = false;
  const select = $("voice");
  select.replaceChildren(new Option("the model's choice", ""));
  for (const v of voices.data) select.append(new Option(v.name, v.id));
}

$("speak").addEventListener("click", speak);

async function speak() {
  showError("");
  const text = $("speech-text").value.trim();
  const clip = $("reference-clip").files[0];
  const player = new Player();
  $("speech-status").textContent = "speaking…";
  $("speech-download").hidden = true;
  try {
    const body = { model: state.model, input: text, response_format: "wav", stream: true };
    if (clip) { // a reference in the request: the clip and what it says (the server caches its codes)
      body.ref_audio = await base64(clip);
      body.ref_text = $("reference-text").value;
    } else if ($("voice").value) {
      body.voice = $("voice").value;
    }
    const reader = (await api("/v1/audio/speech", body)).body.getReader();
    let header = new Uint8Array(0);
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      if (header.length < 44) { // the WAV header first: its sample rate, then PCM
        const joined = new Uint8Array(header.length + value.length);
        joined.set(header);
        joined.set(value, header.length);
        if (joined.length < 44) { header = joined; continue; }
        player.rate = new DataView(joined.buffer).getUint32(24, true);
        header = joined.slice(0, 44);
        player.add(joined.slice(44));
      } else {
        player.add(value);
      }
    }
    $("speech-status").textContent = `${(player.samples / player.rate).toFixed(1)} s of audio`;
    const link = $("speech-download");
    link.href = URL.createObjectURL(player.wav());
    link.hidden = false;
  } catch (e) {
    $("speech-status").textContent = "";
    showError(e.message);
  }
}

function base64(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result.split(",", 2)[1]);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// PCM16 pieces played as they arrive (Web Audio, one buffer each, back to back) and kept for the WAV download.
class Player {
  constructor() {
    this.rate = SAMPLE_RATE;
    this.chunks = [];
    this.samples = 0;
    this.pending = new Uint8Array(0); // an odd byte waiting for its pair
    this.context = null;
    this.next = 0;
  }

  add(bytes) {
    const all = new Uint8Array(this.pending.length + bytes.length);
    all.set(this.pending);
    all.set(bytes, this.pending.length);
    const even = all.length - (all.length % 2);
    this.pending = all.slice(even);
    const pcm = new Int16Array(all.slice(0, even).buffer);
    if (!pcm.length) return;
    this.chunks.push(pcm);
    this.samples += pcm.length;
    try {
      this.context = this.context || new AudioContext();
      const buffer = this.context.createBuffer(1, pcm.length, this.rate);
      const channel = buffer.getChannelData(0);
      for (let i = 0; i < pcm.length; i++) channel[i] = pcm[i] / 32768;
      const source = this.context.createBufferSource();
      source.buffer = buffer;
      source.connect(this.context.destination);
      this.next = Math.max(this.next, this.context.currentTime);
      source.start(this.next);
      this.next += buffer.duration;
    } catch (e) { /* no audio output here: the download still has it */ }
  }

  wav() {
    const bytes = this.samples * 2;
    const header = new DataView(new ArrayBuffer(44));
    const ascii = (offset, s) => [...s].forEach((c, i) => header.setUint8(offset + i, c.charCodeAt(0)));
    ascii(0, "RIFF"); header.setUint32(4, 36 + bytes, true); ascii(8, "WAVE"); ascii(12, "fmt ");
    header.setUint32(16, 16, true); header.setUint16(20, 1, true); header.setUint16(22, 1, true);
    header.setUint32(24, this.rate, true); header.setUint32(28, this.rate * 2, true);
    header.setUint16(32, 2, true); header.setUint16(34, 16, true); ascii(36, "data"); header.setUint32(40, bytes, true);
    return new Blob([header, ...this.chunks], { type: "audio/wav" });
  }
}

// -- live memory --------------------------------------------------------------------------------------------------
const PARTS = [ // /v1/memory's fields, the memory plan's bar, left to right
  ["device_used_bytes", "used by others", "#9e9e9e"], ["weights_bytes", "weights", "#1f77b4"],
  ["activation_peak_bytes", "activation peak", "#ff7f0e"], ["overhead_bytes", "runtime overhead", "#8c564b"],
  ["cuda_graph_pool_bytes", "CUDA graphs", "#e377c2"], ["structured_output_bitmask_bytes", "bitmask", "#bcbd22"],
  ["worker_process_bytes", "worker processes", "#7f7f7f"], ["kv_cache_bytes", "KV cache", "#2ca02c"],
];

function formatBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 2 : 0)} ${units[i]}`;
}

async function refreshMemory() {
  if ($("memory-view").hidden) return;
  try {
    const memory = await (await api("/v1/memory")).json();
    drawBar(memory);
  } catch (e) {
    showError(e.message);
  }
}

function drawBar(memory) {
  const total = memory.device_total_bytes;
  const bar = $("memory-bar"), legend = $("memory-legend"), table = $("memory-table");
  bar.replaceChildren();
  legend.replaceChildren();
  table.replaceChildren();
  const parts = PARTS.map(([field, name, colour]) => [field, name, colour, memory[field] || 0]);
  for (const c of memory.components || []) parts.push([`component:${c.name}`, c.name, "#9467bd",
    c.weight_bytes + c.activation_peak_bytes]);
  for (const [field, name, colour, bytes] of parts) {
    if (bytes <= 0) continue;
    const segment = document.createElement("div");
    segment.className = "segment";
    segment.dataset.field = field;
    segment.dataset.bytes = String(bytes);
    segment.style.width = `${(100 * bytes) / total}%`;
    segment.style.background = colour;
    segment.title = `${name}: ${formatBytes(bytes)}`;
    if (bytes / total > 0.08) segment.textContent = formatBytes(bytes);
    bar.append(segment);
    const key = document.createElement("span");
    key.style.setProperty("--swatch", colour);
    key.textContent = name;
    legend.append(key);
    const row = table.insertRow();
    row.insertCell().textContent = name;
    const cell = row.insertCell();
    cell.className = "bytes";
    cell.dataset.field = field;
    cell.textContent = formatBytes(bytes);
  }
  const budget = document.createElement("div");
  budget.className = "budget";
  budget.style.left = `${(100 * memory.budget_bytes) / total}%`;
  budget.title = `budget: gpu_memory_utilization ${memory.gpu_memory_utilization}`;
  bar.append(budget);
  const usage = memory.kv_cache_usage || {};
  const row = table.insertRow();
  row.insertCell().textContent = "KV blocks in use";
  row.insertCell().textContent = `${usage.blocks_used} of ${usage.blocks_total}`;
  $("memory-fits").textContent = `${formatBytes(total)} ${memory.unified_memory ? "unified " : ""}${memory.device} memory, ` +
    `budget ${formatBytes(memory.budget_bytes)}; ${memory.fits ? "fits" : "does not fit"}`;
}

// A /metrics sample: the gauges and counters the charts draw (summed over their labels).
function readMetrics(text) {
  const wanted = {
    "pagedllm:kv_cache_usage_perc": "kv", "pagedllm:num_requests_running": "running",
    "pagedllm:num_requests_waiting": "waiting", "pagedllm:prefix_cache_queries_total": "queries",
    "pagedllm:prefix_cache_hits_total": "hits", "pagedllm:num_preemptions_total": "preemptions",
  };
  const sample = { kv: 0, running: 0, waiting: 0, queries: 0, hits: 0, preemptions: 0 };
  for (const line of text.split("\n")) {
    if (line.startsWith("#")) continue;
    const name = line.split(/[{ ]/, 1)[0];
    if (name in wanted) sample[wanted[name]] += Number(line.slice(line.lastIndexOf(" ") + 1));
  }
  return sample;
}

async function pollMetrics() {
  try {
    const response = await fetch("/metrics", { headers: headers(false) });
    if (!response.ok) return;
    const sample = readMetrics(await response.text());
    const last = state.lastCounters;
    const dq = last ? sample.queries - last.queries : 0, dh = last ? sample.hits - last.hits : 0;
    sample.hitRate = dq > 0 ? dh / dq : (state.series.length ? state.series[state.series.length - 1].hitRate : 0);
    sample.newPreemptions = last ? sample.preemptions - last.preemptions : 0;
    state.lastCounters = sample;
    state.series.push(sample);
    if (state.series.length > SERIES_SECONDS) state.series.shift();
    drawCharts();
  } catch (e) { /* the next second tries again */ }
}

function drawSeries(svg, values, max, className = "") {
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  const step = 300 / Math.max(values.length - 1, 1); // the samples so far across the width (up to SERIES_SECONDS)
  line.setAttribute("points", values.map((v, i) => `${(i * step).toFixed(1)},${(98 - (96 * v) / (max || 1)).toFixed(1)}`).join(" "));
  line.dataset.values = values.join(",");
  if (className) line.setAttribute("class", className);
  svg.append(line);
}

function drawCharts() {
  if ($("memory-view").hidden) return;
  const s = state.series, now = s[s.length - 1];
  // Each chart scaled to its own peak (a large KV cache's use is a small fraction); the hit rate to 100%.
  const charts = { "kv-chart": [["kv"]], "requests-chart": [["running"], ["waiting", null, "waiting"]],
    "hit-chart": [["hitRate", 1]], "preemption-chart": [["newPreemptions"]] };
  for (const [id, lines] of Object.entries(charts)) {
    const svg = $(id);
    svg.replaceChildren();
    const peak = Math.max(...lines.flatMap(([field]) => s.map((x) => x[field])));
    const max = peak > 0 ? peak : 1;
    for (const [field, fixed, className] of lines) drawSeries(svg, s.map((x) => x[field]), fixed || max, className);
  }
  const kvPeak = Math.max(...s.map((x) => x.kv));
  $("kv-now").textContent = `${(100 * now.kv).toFixed(2)}% (peak ${(100 * kvPeak).toFixed(2)}%)`;
  $("requests-now").textContent = `${now.running} / ${now.waiting}`;
  $("hit-now").textContent = `${(100 * now.hitRate).toFixed(0)}%`;
  $("preemptions-now").textContent = `${now.preemptions} in all`;
}

// -- start ------------------------------------------------------------------------------------------------------
async function start() {
  try {
    const models = await (await api("/v1/models")).json();
    state.model = models.data[0].id;
    $("model-name").textContent = state.model;
    document.body.dataset.ready = "true";
  } catch (e) {
    showError(e.message);
    return;
  }
  await setUpSpeech();
}

state.current = state.conversations[0] || null;
render();
start();
setInterval(pollMetrics, 1000);
setInterval(refreshMemory, 1000);
