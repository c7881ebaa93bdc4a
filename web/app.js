// The duplex demo page: one WebRTC call to the gateway (POST /v1/realtime/calls), events on the
// `oai-events` data channel. No build step, nothing fetched from elsewhere.
//
// The page never keeps the server token: the `?token=` of the link `duplex serve` prints is traded on
// load for a short-lived client key (ek_..., POST /v1/realtime/client_secrets) and wiped from the address
// bar; only that key, in memory, authenticates calls. `?key=ek_...` is a key an operator minted instead.
//
// For tests and operators the page's state machine and counters live on `window.duplex` and are
// mirrored into data- attributes of <body>.

const $ = (id) => document.getElementById(id);

const STATE_TEXT = {
  idle: "not connected",
  connecting: "connecting…",
  listening: "listening",
  speaking: "you are speaking",
  thinking: "thinking…",
  answering: "answering",
  interrupted: "interrupted",
  error: "error",
};

const duplex = (window.duplex = {
  state: "idle",
  sessionId: null,
  turns: 0, // your turns the server's VAD detected
  responses: 0, // answers completed
  interruptions: 0, // answers cut by the user speaking (output_audio_buffer.cleared)
  cleared: 0,
  framesIn: 0, // RTP packets of the answer received (getStats inbound-rtp)
  bytesIn: 0,
  lastTtfaMs: null, // server: end of your speech -> first audio of the answer
  lastRttMs: null, // ICE round trip
  lastResponse: null,
  text: false, // the server's model writes text (session.created's duplex.text): both sides' words are shown
  userTranscripts: 0, // your turns transcribed (conversation.item.input_audio_transcription.completed)
  error: null, // {code, message} of the last fatal error shown
  serverErrors: [], // error events that did not end the call
  events: 0,
  key: "none", // the page's client key: none | minting | ready | expired | refused
  keyExpiresAt: null, // when it ends, epoch ms on this browser's clock (null: not known)
});

const call = { pc: null, dc: null, mic: null, statsTimer: null, audioCtx: null, meters: [], wantOpen: false };

// ---- state and rendering --------------------------------------------------------------------------

function setState(state) {
  duplex.state = state;
  document.body.dataset.state = state;
  $("state").textContent = STATE_TEXT[state] ?? state;
  const live = !["idle", "error"].includes(state);
  $("connect").disabled = live;
  $("hangup").disabled = !live;
}

function publish() {
  const b = document.body.dataset;
  b.turns = duplex.turns;
  b.responses = duplex.responses;
  b.interruptions = duplex.interruptions;
  b.framesIn = duplex.framesIn;
  b.bytesIn = duplex.bytesIn;
  b.ttfaMs = duplex.lastTtfaMs ?? "";
  b.session = duplex.sessionId ?? "";
  b.error = duplex.error?.code ?? "";
  b.text = duplex.text;
  b.key = duplex.key;
  $("responses").textContent = duplex.responses;
  $("interruptions").textContent = duplex.interruptions;
  $("ttfa").textContent = duplex.lastTtfaMs == null ? "–" : `${Math.round(duplex.lastTtfaMs)} ms`;
  $("rtt").textContent = duplex.lastRttMs == null ? "–" : `${Math.round(duplex.lastRttMs)} ms`;
}

function showError(code, message) {
  duplex.error = { code, message };
  $("error-text").textContent = message;
  $("error").hidden = false;
  setState("error");
  publish();
}

function clearError() {
  duplex.error = null;
  $("error").hidden = true;
  publish();
}

// ---- the page's key ---------------------------------------------------------------------------------

// Keys are asked for as long as the server grants (its default cap); a server whose cap is lower answers
// 400, and the page takes its default lifetime instead. A key is needed only to start a call: a call
// goes on past its key's end.
const KEY_SECONDS = 7200;
const KEY_MARGIN_MS = 5000; // a key this close to its end starts no call: the offer could arrive after it
const KEY_LINK = "open the link printed by `duplex serve` again (or paste its token in Settings)";
const said = (message) => message.replace(/[.\s]+$/, ""); // the server's words inside a sentence of ours

const auth = {
  key: null, // the ek_ key; never the server token
  expiresAtMs: null, // on this browser's clock (the server's expires_at, moved by the clocks' difference)
  pending: null, // the mint under way: a call waits for it
  problem: null, // {code, message}: why the page has no usable key
};

function setKey(value, expiresAtMs) {
  auth.key = value;
  auth.expiresAtMs = expiresAtMs;
  auth.problem = null;
  duplex.key = "ready";
  duplex.keyExpiresAt = expiresAtMs;
  showKey();
}

function noKey(code, message, state = "refused") {
  auth.key = null;
  auth.problem = { code, message };
  duplex.key = state;
  showKey();
  showError(code, message);
  $("settings").open = true;
}

function showKey() {
  const until = auth.expiresAtMs == null ? "" : ` until ${new Date(auth.expiresAtMs).toLocaleTimeString()}`;
  $("key-status").textContent = {
    none: "No key yet: open the link printed by `duplex serve`, or paste its token above.",
    minting: "Getting a key…",
    ready: `This page holds a short-lived key${until} (not the token). A call started before then goes on after it.`,
    expired: "The page's key expired.",
    refused: "The page has no key.",
  }[duplex.key];
  publish();
}

/** The server token traded for a client key; the token itself is dropped when this returns. */
async function mint(token) {
  duplex.key = "minting";
  showKey();
  const ask = (body) => fetch("/v1/realtime/client_secrets", {
    method: "POST",
    headers: { Authorization: `Bearer ${token}`, "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  let resp;
  try {
    resp = await ask({ expires_after: { anchor: "created_at", seconds: KEY_SECONDS } });
    if (resp.status === 400) resp = await ask({}); // a lower cap on this server: its default lifetime
  } catch (e) {
    return noKey("server_unreachable", `The server cannot be reached to get the page's key: is \`duplex serve\` running? Then ${KEY_LINK}.`);
  }
  if (!resp.ok) {
    const err = await errorOf(resp);
    if (resp.status === 401) {
      return noKey("bad_token", `The server refused the token (${said(err.message)}): ${KEY_LINK}.`);
    }
    return noKey(err.code, `The page could not get a key from the server (${said(err.message)}).`);
  }
  const body = await resp.json();
  // The server's clock may not be this browser's (the page on another machine): its Date header tells
  // how far apart they are, so the key's end is judged on this clock.
  const serverNow = Date.parse(resp.headers.get("Date") ?? "");
  const skewMs = Number.isNaN(serverNow) ? 0 : Date.now() - serverNow;
  setKey(body.value, typeof body.expires_at === "number" ? body.expires_at * 1000 + skewMs : null);
}

/** The end of an operator's key as the key itself states it (epoch ms on the server's clock), or null. */
async function keyExpiry(key) {
  // realtime/client_secrets.py: ek_<base64url(zlib(JSON {iat, exp, ...}))>.<signature>. Only the end is
  // read here (the signature is the server's to check); a key in another form is used as it is.
  try {
    const b64 = key.slice(3).split(".")[0].replace(/-/g, "+").replace(/_/g, "/");
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const inflated = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    const exp = JSON.parse(await new Response(inflated).text()).exp;
    return typeof exp === "number" ? exp * 1000 : null;
  } catch {
    return null;
  }
}

async function useKey(key) {
  setKey(key, await keyExpiry(key));
  if (expired()) keyExpired(); // said at once, not when Connect is pressed
}

function expired() {
  return auth.expiresAtMs != null && Date.now() > auth.expiresAtMs - KEY_MARGIN_MS;
}

function keyExpired() {
  noKey("key_expired", `The page's key expired: ${KEY_LINK}.`, "expired");
}

/** The key for a new call, or null with the reason shown. Waits for a mint under way. */
async function callKey() {
  await auth.pending;
  if (auth.key && !expired()) return auth.key;
  if (auth.key) return keyExpired(), null;
  const p = auth.problem ?? { code: "no_key", message: `This page has no key: ${KEY_LINK}.` };
  fail(p.code, p.message, true);
  return null;
}

async function errorOf(resp) {
  // OpenAI-shaped: {"error": {"type", "code", "message", "param"}}
  let code = `http_${resp.status}`;
  let message = `HTTP ${resp.status}.`;
  try {
    const body = await resp.clone().json();
    code = body.error?.code ?? code;
    message = body.error?.message ?? message;
  } catch {}
  return { code, message };
}

/** ?token= / ?key= out of the address bar at once (the rest of the query stays), then the token traded. */
function takeCredentials() {
  localStorage.removeItem("duplex.token"); // where pages before this one kept it
  const url = new URL(location.href);
  const token = url.searchParams.get("token");
  const key = url.searchParams.get("key");
  if (token === null && key === null) return showKey();
  url.searchParams.delete("token");
  url.searchParams.delete("key");
  history.replaceState(history.state, "", url.pathname + url.search + url.hash);
  if (key || token) trade(key || token);
  else showKey();
}

function trade(tokenOrKey) {
  const taking = tokenOrKey.startsWith("ek_") ? useKey(tokenOrKey) : mint(tokenOrKey);
  const pending = taking.finally(() => auth.pending === pending && (auth.pending = null));
  auth.pending = pending;
}

// ---- settings --------------------------------------------------------------------------------------

function loadSettings() {
  $("silence").value = localStorage.getItem("duplex.silence_ms") ?? "500";
  $("instructions").value = localStorage.getItem("duplex.instructions") ?? "";
}

function saveSettings() {
  const pasted = $("token").value.trim();
  $("token").value = ""; // traded for a key, never stored
  if (pasted) trade(pasted); // (an error shown stays until Retry: the call then waits for this key)
  localStorage.setItem("duplex.silence_ms", $("silence").value);
  localStorage.setItem("duplex.instructions", $("instructions").value);
  $("saved").hidden = false;
  setTimeout(() => ($("saved").hidden = true), 1200);
  if (call.dc?.readyState === "open") sendSessionUpdate();
}

function sendSessionUpdate() {
  const silence = Math.max(100, Math.min(5000, Number($("silence").value) || 500));
  const input = { turn_detection: { type: "server_vad", silence_duration_ms: silence } };
  // Your words, as the model heard them, when it writes text: it transcribes your answered turns itself
  // (any model name does; a model without text would refuse the field, so it is only asked of one with).
  if (duplex.text) input.transcription = { model: "duplex" };
  send({ type: "session.update", session: { instructions: $("instructions").value, audio: { input } } });
}

function send(event) {
  if (call.dc?.readyState === "open") call.dc.send(JSON.stringify(event));
}

// ---- the call --------------------------------------------------------------------------------------

async function connect() {
  clearError();
  setState("connecting");
  if (!(await callKey())) return; // an expired or missing key is said now, not by a refused call
  call.wantOpen = true;
  try {
    call.mic = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (e) {
    const refused = e.name === "NotAllowedError" || e.name === "SecurityError";
    return fail(
      refused ? "microphone_refused" : "microphone_unavailable",
      refused
        ? "The microphone was refused. Allow it for this page in the browser's site settings, then retry."
        : `No microphone could be opened (${e.name}). Plug one in or pick another input, then retry.`,
    );
  }
  const pc = (call.pc = new RTCPeerConnection({ iceServers: [] }));
  pc.ontrack = (e) => {
    const stream = e.streams[0] ?? new MediaStream([e.track]);
    $("remote").srcObject = stream;
    addMeter(stream, $("out-meter"), "#c4a8ff");
  };
  for (const track of call.mic.getTracks()) pc.addTrack(track, call.mic);
  addMeter(call.mic, $("mic-meter"), "#8fb8ff");

  const dc = (call.dc = pc.createDataChannel("oai-events"));
  dc.onopen = () => {
    if (duplex.state === "connecting") setState("listening");
  };
  dc.onmessage = (m) => onEvent(JSON.parse(m.data));
  pc.onconnectionstatechange = () => {
    if (!call.wantOpen) return;
    if (pc.connectionState === "failed" || pc.connectionState === "closed") {
      lost("The connection to the server was lost.");
    }
  };
  dc.onclose = () => call.wantOpen && lost("The server ended the call.");

  await pc.setLocalDescription(await pc.createOffer());
  await iceGatheringDone(pc, 2000);
  if (expired()) {
    teardown(); // the key ended while the microphone was being allowed
    return keyExpired();
  }
  let resp;
  try {
    resp = await fetch("/v1/realtime/calls?duplex=1", {  // duplex=1: our additions (latency marks, epochs)
      method: "POST",
      body: pc.localDescription.sdp,
      headers: { "Content-Type": "application/sdp", Authorization: `Bearer ${auth.key}` },
    });
  } catch (e) {
    return fail("server_unreachable", "The server cannot be reached. Is `duplex serve` running?");
  }
  if (!resp.ok) {
    const { code, message } = await errorOf(resp);
    if (resp.status === 401) {
      // a key this page believed good: the server's clock, or a server restarted with another secret
      teardown();
      return noKey("bad_key", `The server refused the page's key (${said(message)}): ${KEY_LINK}.`);
    }
    if (resp.status === 503 || code === "server_at_capacity") {
      return fail("server_at_capacity", "The server is at capacity right now. Please retry in a few seconds.");
    }
    return fail(code, `The server refused the call (HTTP ${resp.status}): ${message}`);
  }
  await pc.setRemoteDescription({ type: "answer", sdp: await resp.text() });
  call.statsTimer = setInterval(pollStats, 500);
}

function iceGatheringDone(pc, timeoutMs) {
  // The server does not trickle: the offer must carry our candidates.
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((resolve) => {
    const t = setTimeout(resolve, timeoutMs);
    pc.addEventListener("icegatheringstatechange", () => {
      if (pc.iceGatheringState === "complete") {
        clearTimeout(t);
        resolve();
      }
    });
  });
}

function teardown() {
  call.wantOpen = false;
  clearInterval(call.statsTimer);
  call.statsTimer = null;
  call.dc?.close();
  call.pc?.close();
  call.mic?.getTracks().forEach((t) => t.stop());
  call.pc = call.dc = call.mic = null;
  call.meters = [];
  $("remote").srcObject = null;
}

function hangup() {
  teardown();
  setState("idle");
}

function fail(code, message, openSettings = false) {
  teardown();
  showError(code, message);
  if (openSettings) $("settings").open = true;
}

function lost(message) {
  fail("connection_lost", `${message} Press Retry to call again.`);
}

async function pollStats() {
  if (!call.pc) return;
  const stats = await call.pc.getStats();
  stats.forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") {
      duplex.bytesIn = s.bytesReceived ?? 0;
      duplex.framesIn = s.packetsReceived ?? 0;
    }
    if (s.type === "candidate-pair" && s.nominated && s.currentRoundTripTime != null) {
      duplex.lastRttMs = s.currentRoundTripTime * 1000;
    }
  });
  publish();
}

// ---- server events -> state ------------------------------------------------------------------------

let interruptedTimer = null;
let currentAnswer = null;
const userLines = new Map(); // item id -> its line: "(you spoke)" until the model's transcript of it comes

function setLineText(li, text) {
  li.firstChild.textContent = text;
}

function onEvent(ev) {
  duplex.events++;
  switch (ev.type) {
    case "session.created":
      duplex.sessionId = ev.session.id;
      duplex.text = ev.session.duplex?.text === true; // (this page connects with ?duplex=1)
      sendSessionUpdate();
      break;
    case "input_audio_buffer.speech_started":
      if (duplex.state !== "interrupted") setState("speaking");
      userLines.set(ev.item_id, addLine("user", "(you spoke)"));
      if (userLines.size > 40) userLines.delete(userLines.keys().next().value);
      break;
    case "conversation.item.input_audio_transcription.delta": {
      const li = userLines.get(ev.item_id);
      if (li) setLineText(li, (li.dataset.heard ? li.firstChild.textContent : "") + (ev.delta ?? ""));
      if (li) li.dataset.heard = "1";
      break;
    }
    case "conversation.item.input_audio_transcription.completed": {
      const li = userLines.get(ev.item_id) ?? addLine("user", "");
      setLineText(li, ev.transcript || "(nothing heard)");
      li.dataset.heard = "1";
      duplex.userTranscripts++;
      break;
    }
    case "conversation.item.input_audio_transcription.failed": {
      const li = userLines.get(ev.item_id);
      if (li) li.classList.add("failed");
      break;
    }
    case "input_audio_buffer.speech_stopped":
      duplex.turns++;
      setState("thinking");
      break;
    case "response.created":
      setState("answering");
      currentAnswer = addLine("assistant", "…");
      break;
    case "response.output_audio_transcript.delta": // the model's text of its spoken answer
    case "response.output_text.delta": // a text-only answer
      if (currentAnswer) {
        const t = currentAnswer.firstChild;
        t.textContent = (t.textContent === "…" ? "" : t.textContent) + ev.delta;
      }
      break;
    case "duplex.latency":
      if (ev.mark === "first_audio" && ev.ttfa_ms != null) duplex.lastTtfaMs = ev.ttfa_ms;
      break;
    case "output_audio_buffer.cleared":
      duplex.cleared++;
      duplex.interruptions++;
      currentAnswer?.classList.add("cut");
      setState("interrupted");
      clearTimeout(interruptedTimer);
      interruptedTimer = setTimeout(() => duplex.state === "interrupted" && setState("speaking"), 800);
      break;
    case "response.done": {
      const r = ev.response;
      duplex.lastResponse = { id: r.id, status: r.status, reason: r.status_details?.reason ?? null, ...r.duplex };
      if (r.status === "completed") duplex.responses++;
      if (r.duplex?.ttfa_ms != null) duplex.lastTtfaMs = r.duplex.ttfa_ms;
      if (currentAnswer) {
        if (currentAnswer.firstChild.textContent === "…") currentAnswer.firstChild.textContent = "(answered in audio)";
        const meta = document.createElement("span");
        meta.className = "meta";
        const ttfa = r.duplex?.ttfa_ms == null ? "" : ` · first audio after ${Math.round(r.duplex.ttfa_ms)} ms`;
        meta.textContent = `${(r.duplex?.played_ms / 1000).toFixed(1)} s${ttfa}`;
        currentAnswer.appendChild(meta);
      }
      currentAnswer = null;
      if (duplex.state === "answering" || duplex.state === "thinking") setState("listening");
      break;
    }
    case "output_audio_buffer.stopped":
      if (duplex.state === "answering") setState("listening");
      break;
    case "error":
      duplex.serverErrors.push(ev.error);
      if (["server_shutting_down", "idle_timeout"].includes(ev.error?.code)) {
        fail(ev.error.code, `The server ended the call: ${ev.error.message}. Press Retry to call again.`);
      }
      break;
  }
  publish();
}

function addLine(role, text) {
  const li = document.createElement("li");
  li.className = role;
  li.appendChild(document.createTextNode(text));
  const list = $("transcript");
  list.appendChild(li);
  while (list.children.length > 40) list.removeChild(list.firstChild);
  list.scrollTop = list.scrollHeight;
  return li;
}

// ---- level meters ----------------------------------------------------------------------------------

function addMeter(stream, canvas, color) {
  call.audioCtx ??= new AudioContext();
  const src = call.audioCtx.createMediaStreamSource(stream);
  const analyser = call.audioCtx.createAnalyser();
  analyser.fftSize = 1024;
  src.connect(analyser);
  call.meters.push({ analyser, canvas, color, buf: new Float32Array(analyser.fftSize), history: [] });
  call.audioCtx.resume?.();
}

function drawMeters() {
  for (const m of call.meters) {
    m.analyser.getFloatTimeDomainData(m.buf);
    let sum = 0;
    for (const x of m.buf) sum += x * x;
    // dBFS over a 60 dB range: quiet speech still moves the bars
    const db = 10 * Math.log10(sum / m.buf.length + 1e-12);
    const level = Math.max(0, Math.min(1, (db + 60) / 60));
    m.history.push(level);
    const ctx = m.canvas.getContext("2d");
    const { width, height } = m.canvas;
    const bars = Math.floor(width / 6);
    if (m.history.length > bars) m.history.splice(0, m.history.length - bars);
    ctx.clearRect(0, 0, width, height);
    ctx.fillStyle = m.color;
    m.history.forEach((v, i) => {
      const h = Math.max(2, v * height);
      ctx.fillRect(width - (m.history.length - i) * 6, (height - h) / 2, 4, h);
    });
  }
  requestAnimationFrame(drawMeters);
}

// ---- wiring ----------------------------------------------------------------------------------------

$("connect").onclick = () => connect().catch((e) => fail("unexpected", `The call could not start: ${e.message ?? e}`));
$("hangup").onclick = hangup;
$("retry").onclick = () => connect().catch((e) => fail("unexpected", `The call could not start: ${e.message ?? e}`));
$("save").onclick = saveSettings;
window.addEventListener("pagehide", teardown);
loadSettings();
setState("idle");
takeCredentials();
publish();
requestAnimationFrame(drawMeters);
