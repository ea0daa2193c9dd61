// mtpx playground: chat over a Responses WebSocket session (SSE fallback) with a live engine
// panel fed by GET /v1/stats. No dependencies, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  ws: null, wsReady: null, previousId: null, conversation: null,
  current: null, // the reply being streamed: {id, el, items, start, ttft, abort}
};

function settings() {
  const num = (id) => Number($(id).value);
  const body = {
    instructions: $("system").value.trim() || undefined,
    temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k"),
    max_output_tokens: Math.max(1, num("max_tokens")),
    // `speculative`: false turns drafting off for this reply; a drafter's name uses only that
    // one (the server's drafters are listed from /v1/stats); true leaves it to the server.
    speculative: !$("speculative").checked ? false : ($("drafter").value === "auto" ? true : $("drafter").value),
  };
  if (state.previousId) body.previous_response_id = state.previousId;
  return body;
}

const DRAFTER_NAMES = { ngram: "n-gram lookup", prediction: "predicted output", draft: "draft model", mtp: "MTP heads" };

// The drafter choice lists what this server runs; "auto" leaves the choice to it per step.
function listDrafters(drafters) {
  const select = $("drafter");
  const key = drafters.join(",");
  if (select.dataset.key === key) return;
  select.dataset.key = key;
  const chosen = select.value;
  select.textContent = "";
  const options = drafters.length ? [["auto", "auto (" + drafters.map((d) => DRAFTER_NAMES[d] || d).join(", ") + ")"]] : [["auto", "off on this server"]];
  for (const d of drafters) if (d !== "prediction") options.push([d, DRAFTER_NAMES[d] || d]);
  for (const [value, label] of options) {
    const o = document.createElement("option"); o.value = value; o.textContent = label; select.appendChild(o);
  }
  select.disabled = drafters.length === 0;
  if (options.some(([v]) => v === chosen)) select.value = chosen;
}

function headers() {
  const h = { "content-type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.authorization = "Bearer " + key;
  return h;
}

// ---------------------------------------------------------------- transports

function connectSocket() {
  if (state.wsReady) return state.wsReady;
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/responses";
  state.wsReady = new Promise((resolve) => {
    let ws;
    try { ws = new WebSocket(url); } catch (e) { resolve(null); return; }
    ws.onopen = () => { state.ws = ws; $("transport").textContent = "WebSocket"; resolve(ws); };
    ws.onmessage = (m) => { try { onEvent(JSON.parse(m.data)); } catch (e) { console.warn(e); } };
    ws.onerror = () => resolve(null);
    ws.onclose = () => {
      state.ws = null; state.wsReady = null;
      if (state.current && state.current.transport === "ws") finishReply("connection closed");
    };
  });
  return state.wsReady;
}

async function sendOverSocket(body) {
  const ws = await connectSocket();
  if (!ws) return false;
  ws.send(JSON.stringify({ type: "response.create", ...body }));
  state.current.transport = "ws";
  return true;
}

async function sendOverSse(body) {
  $("transport").textContent = "HTTP + SSE";
  const abort = new AbortController();
  state.current.transport = "sse";
  state.current.abort = abort;
  let res;
  try {
    res = await fetch("/v1/responses", { method: "POST", headers: headers(), body: JSON.stringify({ ...body, stream: true }), signal: abort.signal });
  } catch (e) { if (!abort.signal.aborted) finishReply(String(e)); else finishReply(null, "cancelled"); return; }
  if (!res.ok) { const j = await res.json().catch(() => ({})); onEvent({ type: "error", error: j.error || { message: res.statusText } }); return; }
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let at;
      while ((at = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, at); buf = buf.slice(at + 2);
        const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
        if (data && data !== "[DONE]") onEvent(JSON.parse(data));
      }
    }
  } catch (e) { if (abort.signal.aborted) finishReply(null, "cancelled"); }
  if (state.current) finishReply(null, "cancelled");
}

// ---------------------------------------------------------------- chat

function bubble(kind, text) {
  const el = document.createElement("div");
  el.className = "msg " + kind;
  if (text) el.textContent = text;
  $("messages").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

async function send(text) {
  if (state.current || !text.trim()) return;
  bubble("user", text);
  const el = bubble("assistant", "");
  state.current = { el, items: {}, start: performance.now(), ttft: null, id: null };
  setBusy(true);
  const body = { input: text, ...settings() };
  const useWs = $("transport_choice").value === "ws";
  if (!(useWs && await sendOverSocket(body))) await sendOverSse(body);
}

function stop() {
  const c = state.current;
  if (!c) return;
  if (c.transport === "ws" && state.ws) {
    // The reply ends when the server's response.cancelled arrives, behind every delta it sent
    // before it saw the cancel: those are no longer rendered (a fast stream can queue
    // thousands, and laying out each one kept Stop from taking effect for seconds).
    c.stopping = true;
    state.ws.send(JSON.stringify({ type: "response.cancel", response_id: c.id || undefined }));
  } else if (c.abort) {
    c.abort.abort();
  }
}

function reset() {
  if (state.current) stop();
  state.previousId = null; state.conversation = null;
  $("messages").textContent = "";
  refreshStats();
}

function itemEl(item) {
  const c = state.current;
  if (c.items[item.id]) return c.items[item.id];
  let el;
  if (item.type === "reasoning") {
    el = document.createElement("details"); el.className = "reasoning";
    const s = document.createElement("summary"); s.textContent = "Reasoning"; el.appendChild(s);
    el.body = document.createElement("div"); el.appendChild(el.body);
  } else if (item.type === "function_call") {
    el = document.createElement("div"); el.className = "tool";
    const title = document.createElement("strong"); title.textContent = "Tool call: " + item.name; el.appendChild(title);
    el.body = document.createElement("pre"); el.appendChild(el.body);
  } else {
    el = document.createElement("span"); el.body = el;
  }
  c.el.appendChild(el);
  c.items[item.id] = el;
  return el;
}

// Text from accepted speculative drafts is tinted; its title says the draft depth.
function appendText(el, text, depths) {
  const drafted = (depths || []).filter((d) => d > 0);
  if (!drafted.length) { el.appendChild(document.createTextNode(text)); return; }
  const span = document.createElement("span");
  span.className = "draft";
  span.title = "accepted draft, depth " + drafted.join(", ");
  span.textContent = text;
  el.appendChild(span);
}

// Per-depth acceptance of the last reply, from its timings.
function showSpeculation(t) {
  const rows = (t && t.draft_by_depth) || [];
  const table = $("spec_depths");
  table.textContent = "";
  if (!rows.length) { $("m_spec").textContent = t && t.draft_n === 0 ? "no drafts" : "–"; return; }
  const rounds = rows[0].drafted;
  $("m_spec").textContent = `${(t.draft_n_accepted / rounds).toFixed(2)} drafts/round · ${t.draft_n_accepted}/${t.draft_n} accepted`;
  for (const r of rows) {
    const tr = document.createElement("tr");
    const rate = r.drafted ? r.accepted / r.drafted : 0;
    for (const v of [r.depth, `${r.accepted}/${r.drafted}`, (100 * rate).toFixed(0) + "%"]) {
      const td = document.createElement("td"); td.textContent = v; tr.appendChild(td);
    }
    const bar = document.createElement("td");
    const fill = document.createElement("span"); fill.className = "bar"; fill.style.width = (100 * rate) + "%";
    bar.appendChild(fill); tr.appendChild(bar);
    table.appendChild(tr);
  }
}

function firstToken() {
  const c = state.current;
  if (c && c.ttft === null) c.ttft = performance.now() - c.start;
}

function onEvent(e) {
  const c = state.current;
  if (e.type === "error") {
    bubble("error", (e.error && e.error.message) || "error");
    if (c && !c.id) finishReply(null, "failed");
    return;
  }
  if (!c) return;
  if (c.stopping && e.type.endsWith(".delta")) return;
  switch (e.type) {
    case "response.created":
      c.id = e.response.id;
      if (e.response.conversation) state.conversation = e.response.conversation.id;
      break;
    case "response.output_item.added": itemEl(e.item); break;
    case "response.output_text.delta":
    case "response.reasoning_text.delta":
      firstToken();
      appendText(itemEl({ id: e.item_id }).body, e.delta, e.draft_depths);
      c.el.scrollIntoView({ block: "end" });
      break;
    case "response.function_call_arguments.delta":
      firstToken();
      appendText(itemEl({ id: e.item_id }).body, e.delta, e.draft_depths);
      break;
    case "response.output_item.done":
      if (e.item.type === "function_call") {
        try { itemEl(e.item).body.textContent = JSON.stringify(JSON.parse(e.item.arguments), null, 2); } catch (_) { /* keep raw */ }
      }
      break;
    case "response.completed": case "response.incomplete": case "response.cancelled": case "response.failed":
      finishReply(null, e.response.status, e.response);
      break;
  }
}

function finishReply(error, status, response) {
  const c = state.current;
  if (!c) return;
  state.current = null;
  setBusy(false);
  if (error) bubble("error", error);
  if (response && status !== "failed") state.previousId = response.id;
  const meta = document.createElement("span"); meta.className = "meta";
  const elapsed = (performance.now() - c.start) / 1000;
  const u = response && response.usage;
  const t = response && response.timings;
  let tps = null;
  if (t && t.predicted_per_second) tps = t.predicted_per_second;
  else if (u && c.ttft !== null && elapsed > c.ttft / 1000) tps = Math.max(0, u.output_tokens - 1) / (elapsed - c.ttft / 1000);
  meta.textContent = [status, u ? u.output_tokens + " tokens" : null, elapsed.toFixed(2) + " s"].filter(Boolean).join(" · ");
  c.el.appendChild(meta);
  $("m_tps").textContent = tps !== null ? tps.toFixed(1) : "–";
  $("m_ttft").textContent = c.ttft !== null ? c.ttft.toFixed(0) + " ms" : "–";
  $("m_cached").textContent = u ? `${u.input_tokens_details.cached_tokens} / ${u.input_tokens}` : "–";
  showSpeculation(t);
  refreshStats();
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  if (busy) pollWhileBusy();
}

// ---------------------------------------------------------------- engine panel

async function refreshStats() {
  try {
    const q = state.conversation ? "?session=" + encodeURIComponent(state.conversation) : "";
    const res = await fetch("/v1/stats" + q, { headers: headers() });
    if (!res.ok) return;
    const s = await res.json();
    $("model").textContent = s.model + " · " + s.context_window + " tokens";
    listDrafters((s.speculation && s.speculation.drafters) || []);
    const p = s.pool;
    const cachedOnly = p.num_evictable;
    const used = p.num_used;
    $("kv_used").style.width = (100 * used / p.num_pages) + "%";
    $("kv_cached").style.width = (100 * cachedOnly / p.num_pages) + "%";
    const mine = s.session ? ` · this session ${s.session.num_pages}` : "";
    $("kv_text").textContent = `pages: ${used} used, ${p.num_cached} cached, ${p.num_free} free of ${p.num_pages}${mine}`;
    $("m_queue").textContent = `${s.scheduler.num_running} / ${s.scheduler.num_waiting}`;
    $("m_updated").textContent = "updated " + new Date().toLocaleTimeString();
    if (state.current) {
      const c = state.current;
      const streamed = c.el.textContent.length;
      if (c.ttft !== null) $("m_ttft").textContent = c.ttft.toFixed(0) + " ms";
      $("m_tps").textContent = streamed ? "streaming…" : $("m_tps").textContent;
    }
  } catch (e) { /* the server may be restarting */ }
}

async function pollWhileBusy() {
  while (state.current) {
    await refreshStats();
    await new Promise((r) => setTimeout(r, 250));
  }
}

// ---------------------------------------------------------------- wiring

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); $("composer").requestSubmit(); }
  if (ev.key === "Escape") stop();
});
$("stop").addEventListener("click", stop);
$("reset").addEventListener("click", reset);
$("transport_choice").addEventListener("change", () => { $("transport").textContent = $("transport_choice").value === "ws" ? "WebSocket" : "HTTP + SSE"; });
connectSocket().then((ws) => { if (!ws) $("transport").textContent = "HTTP + SSE"; });
refreshStats();
setInterval(() => { if (!state.current) refreshStats(); }, 3000);
