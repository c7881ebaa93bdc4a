// The duplex demo page: one WebRTC call to the gateway (POST /v1/realtime/calls), events on the
// `oai-events` data channel. No build step, nothing fetched from elsewhere.
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

// ---- settings --------------------------------------------------------------------------------------

function loadSettings() {
  const url = new URL(location.href);
  const fromUrl = url.searchParams.get("token");
  if (fromUrl) localStorage.setItem("duplex.token", fromUrl);
  $("token").value = fromUrl ?? localStorage.getItem("duplex.token") ?? "";
  $("silence").value = localStorage.getItem("duplex.silence_ms") ?? "500";
  $("instructions").value = localStorage.getItem("duplex.instructions") ?? "";
}

function saveSettings() {
  localStorage.setItem("duplex.token", $("token").value.trim());
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
  let resp;
  try {
    resp = await fetch("/v1/realtime/calls?duplex=1", {  // duplex=1: our additions (latency marks, epochs)
      method: "POST",
      body: pc.localDescription.sdp,
      headers: { "Content-Type": "application/sdp", Authorization: `Bearer ${$("token").value.trim()}` },
    });
  } catch (e) {
    return fail("server_unreachable", "The server cannot be reached. Is `duplex serve` running?");
  }
  if (!resp.ok) {
    let code = `http_${resp.status}`;
    let message = `The server refused the call (HTTP ${resp.status}).`;
    try {
      const body = await resp.clone().json();
      code = body.error?.code ?? code;
      message = body.error?.message ?? message;
    } catch {}
    if (resp.status === 401) {
      return fail("bad_token", "The server refused the token. Open Settings and paste the token `duplex serve` printed.", true);
    }
    if (resp.status === 503 || code === "server_at_capacity") {
      return fail("server_at_capacity", "The server is at capacity right now. Please retry in a few seconds.");
    }
    return fail(code, message);
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
publish();
requestAnimationFrame(drawMeters);
