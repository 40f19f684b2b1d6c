// forerun's web page: a streaming chat and a live view of the engine. Plain JS, no build.
// URLs are relative, so the page also works behind a proxy's path prefix (--root-path).
"use strict";

const POLL_MS = 250;
const RATE_WINDOW_S = 2.0;
const COLORS = {
  schedule: "#4e79a7", update: "#59a14f", output: "#9c755f", deferred_sample_wait: "#bab0ac",
  prepare: "#edc948", forward: "#e15759", sample: "#f28e2b",
};
// "output" is the offline engine's span: a server never shows it.
const ENGINE_NAMES = ["schedule", "update", "deferred_sample_wait"];
const WORKER_NAMES = ["prepare", "forward", "sample"];

// What the page shows, readable from outside (tests, the console): window.forerun.
const dashboard = {
  polls: 0, running: 0, waiting: 0, kvUsage: 0, promptTps: 0, genTps: 0,
  workerBusy: 0, stepsPerS: 0, spansDrawn: { engine: 0, worker: 0 }, online: false,
};
const chat = { streaming: false, tokens: 0, tokensPerS: 0, finishReason: null, stopped: false };
window.forerun = { dashboard, chat };

const $ = (id) => document.getElementById(id);
const conversation = [];   // {role, content} of the conversation so far
let model = null;      // the served model's name, from /forerun/engine
let controller = null; // aborts the request streaming now

// ----- chat -----------------------------------------------------------------------------
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "body";
  body.textContent = text;
  div.appendChild(body);
  $("log").appendChild(div);
  $("log").scrollTop = $("log").scrollHeight;
  return div;
}

function note(div, text) {
  const n = document.createElement("span");
  n.className = "note";
  n.textContent = text;
  div.appendChild(n);
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function showChatStats(start, first, last) {
  const parts = [chat.tokens + " tokens"];
  // Decode speed: tokens after the first over the time they took (prefill excluded).
  if (chat.tokens > 1 && last > first) {
    chat.tokensPerS = (chat.tokens - 1) / ((last - first) / 1000);
    parts.push(chat.tokensPerS.toFixed(1) + " tokens/s");
  }
  if (first) parts.push("first token " + Math.round(first - start) + " ms");
  $("chat-stats").textContent = parts.join(" · ");
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  const out = div.querySelector(".body");
  const body = {
    messages: conversation.slice(), stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  if (model) body.model = model;
  controller = new AbortController();
  Object.assign(chat, { streaming: true, tokens: 0, tokensPerS: 0, finishReason: null,
                        stopped: false });
  setBusy(true);
  const start = performance.now();
  let first = 0, last = 0, usageTokens = null, failed = false;
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => null);
      throw new Error((err && err.error && err.error.message) || "HTTP " + resp.status);
    }
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const msg = JSON.parse(line.slice(6));
          if (msg.error) throw new Error(msg.error.message);
          if (msg.usage) usageTokens = msg.usage.completion_tokens;
          const choice = msg.choices && msg.choices[0];
          if (!choice) continue;
          if (choice.delta && choice.delta.content) {
            out.textContent += choice.delta.content;
            // A chunk is a token as a rule; the usage chunk corrects the count at the end.
            chat.tokens += 1;
            last = performance.now();
            if (!first) first = last;
            showChatStats(start, first, last);
            $("log").scrollTop = $("log").scrollHeight;
          }
          if (choice.finish_reason) chat.finishReason = choice.finish_reason;
        }
      }
    }
    if (usageTokens !== null) chat.tokens = usageTokens;
    showChatStats(start, first, last);
    if (chat.finishReason === "length") note(div, "(stopped at max tokens)");
  } catch (err) {
    if (err.name === "AbortError") {
      chat.stopped = true;
      note(div, "(stopped)");
    } else {
      failed = true;
      div.className = "msg error";
      out.textContent += (out.textContent ? "\n" : "") + String(err.message || err);
    }
  } finally {
    // A failed turn leaves the conversation as it was, so the question can be asked again.
    if (failed) conversation.pop();
    else conversation.push({ role: "assistant", content: out.textContent });
    controller = null;
    chat.streaming = false;
    setBusy(false);
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

$("ask").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("ask").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  conversation.length = 0;
  $("log").textContent = "";
  $("chat-stats").textContent = "";
});

// ----- dashboard ------------------------------------------------------------------------
const samples = []; // {t, prompt, gen}: token totals as polled, for rates

function rate(key) {
  const lastS = samples[samples.length - 1];
  const firstS = samples[0];
  const dt = lastS.t - firstS.t;
  return dt > 0 ? (lastS[key] - firstS[key]) / dt : 0;
}

function update(view) {
  dashboard.polls += 1;
  if (!model) {
    model = view.model;
    $("model").textContent = view.model;
  }
  const t = performance.now() / 1000;
  samples.push({ t, prompt: view.prompt_tokens_total, gen: view.generation_tokens_total });
  while (samples.length > 2 && t - samples[1].t >= RATE_WINDOW_S) samples.shift();
  Object.assign(dashboard, {
    running: view.num_requests_running, waiting: view.num_requests_waiting,
    kvUsage: view.kv_cache_usage, promptTps: rate("prompt"), genTps: rate("gen"),
  });
  $("running").textContent = dashboard.running;
  $("waiting").textContent = dashboard.waiting;
  $("kv").textContent = (100 * dashboard.kvUsage).toFixed(1) + " %";
  $("prompt-tps").textContent = dashboard.promptTps.toFixed(1);
  $("gen-tps").textContent = dashboard.genTps.toFixed(1);
  $("async").textContent = view.async_scheduling ? "on" : "off";
  drawTimeline(view);
  $("busy").textContent = (100 * dashboard.workerBusy).toFixed(0) + " %";
  $("steps").textContent = dashboard.stepsPerS.toFixed(1);
}

function drawTimeline(view) {
  const canvas = $("timeline");
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, width, height);
  const win = view.window_s, left = 118, right = width - 8;
  const x = (s) => left + (right - left) * (1 + Math.max(-win, Math.min(0, s)) / win);
  const laneH = 36;
  const lanes = [
    { key: "engine", lane: view.lanes.engine, label: ["engine", "schedule · update"], y: 8 },
    { key: "worker", lane: view.lanes.worker, label: ["worker", "forward · sample"], y: 52 },
  ];
  g.font = "12px system-ui, sans-serif";
  g.textBaseline = "middle";
  for (const l of lanes) {
    g.fillStyle = "#1d1d1f";
    g.fillText(l.label[0], 4, l.y + laneH / 2 - 7);
    g.fillStyle = "#6b6b70";
    g.fillText(l.label[1], 4, l.y + laneH / 2 + 8);
    g.fillStyle = "#f4f4f6";
    g.fillRect(left, l.y, right - left, laneH);
  }
  // Ticks every half second, labelled in seconds before now.
  g.fillStyle = "#9a9aa0";
  g.textBaseline = "top";
  for (let s = -win; s <= 0.0001; s += 0.5) {
    const px = x(s);
    g.fillRect(px, 4, 1, height - 22);
    g.fillText(s === 0 ? "now" : s.toFixed(1) + " s", Math.min(px + 2, right - 24), height - 15);
  }
  const drawn = { engine: 0, worker: 0 };
  let busy = 0;
  const steps = new Set();
  for (const [name, lane, start, end, step] of view.spans) {
    const l = lanes.find((c) => c.lane === lane);
    if (!l || end < -win) continue;
    const x0 = x(start), x1 = x(end);
    g.fillStyle = COLORS[name] || "#999";
    g.fillRect(x0, l.y + 2, Math.max(1, x1 - x0), laneH - 4);
    drawn[l.key] += 1;
    if (l.key === "worker" && (name === "forward" || name === "sample")) {
      busy += Math.min(0, end) - Math.max(-win, start);
    }
    if (name === "forward") steps.add(step);
  }
  dashboard.spansDrawn = drawn;
  dashboard.workerBusy = Math.min(1, busy / win);
  dashboard.stepsPerS = steps.size / win;
  canvas.dataset.engineSpans = drawn.engine;
  canvas.dataset.workerSpans = drawn.worker;
}

function legend() {
  for (const name of [...ENGINE_NAMES, ...WORKER_NAMES]) {
    const item = document.createElement("span");
    const swatch = document.createElement("i");
    swatch.style.background = COLORS[name];
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(name));
    $("legend").appendChild(item);
  }
}

function setOnline(on) {
  dashboard.online = on;
  $("link").textContent = on ? "live" : "offline";
  $("link").className = on ? "badge on" : "badge";
}

async function poll() {
  try {
    const resp = await fetch("forerun/engine", { cache: "no-store" });
    if (resp.ok) {
      update(await resp.json());
      setOnline(true);
    } else {
      setOnline(false);
    }
  } catch (err) {
    setOnline(false); // the server is gone or restarting: keep polling
  }
  setTimeout(poll, POLL_MS);
}

legend();
poll();
