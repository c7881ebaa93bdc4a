// The `openai` npm package's Realtime client for Node (`OpenAIRealtimeWS`, `openai/realtime/ws`) against a
// duplex gateway serving TLS: it always connects with wss:// (the client's baseURL, https://..., with its
// scheme swapped). tests/realtime/test_browser_clients.py runs it with NODE_EXTRA_CA_CERTS naming the CA
// that signed the gateway's certificate (Node's ordinary way to trust a private CA).
//
//   node openai_ws_tls.mjs BASE_URL API_KEY      (BASE_URL: https://127.0.0.1:PORT/v1)
//
// It sends a session.update, waits for session.updated, asks for a response and collects it: one JSON
// line on stdout, {"summary": ...}; exit 0 when the response completed with audio and no error came.

import OpenAI from 'openai';
import { OpenAIRealtimeWS } from 'openai/realtime/ws';

const [baseURL, apiKey] = process.argv.slice(2);
if (!baseURL || !apiKey) {
  console.error('usage: node openai_ws_tls.mjs BASE_URL API_KEY');
  process.exit(2);
}
const TIMEOUT_MS = Number(process.env.DUPLEX_JS_TIMEOUT_MS ?? 30000);

const events = []; // server event types, in order
const errors = []; // the client's 'error' events (server error events and transport failures), as text
let audioBytes = 0;
let audioPeak = 0;
let url = null;
let done = null;

function finish(extra = {}) {
  const summary = { url, events, errors, audio_bytes: audioBytes, audio_peak: audioPeak, response: done, ...extra };
  process.stdout.write(JSON.stringify({ summary }) + '\n');
  const ok = errors.length === 0 && done?.status === 'completed' && audioBytes > 0;
  process.exit(extra.timed_out ? 3 : ok ? 0 : 1);
}

const watchdog = setTimeout(() => finish({ timed_out: true }), TIMEOUT_MS);

const client = new OpenAI({ apiKey, baseURL });
const rt = new OpenAIRealtimeWS({ model: 'gpt-realtime' }, client);
url = rt.url?.toString() ?? null;
rt.on('error', (err) => {
  errors.push(err?.error ? JSON.stringify(err.error) : `${err?.name}: ${err?.message}`);
  clearTimeout(watchdog);
  finish();
});
rt.on('event', (ev) => events.push(ev.type));
rt.socket.on('open', () => {
  rt.send({
    type: 'session.update',
    session: { type: 'realtime', instructions: 'Be brief.', output_modalities: ['audio'],
      audio: { output: { format: { type: 'audio/pcm', rate: 24000 } } } },
  });
});
rt.on('session.updated', () => {
  if (!events.includes('response.created')) rt.send({ type: 'response.create' });
});
rt.on('response.output_audio.delta', (ev) => {
  const pcm = Buffer.from(ev.delta, 'base64');
  audioBytes += pcm.length;
  for (let i = 0; i + 1 < pcm.length; i += 2) audioPeak = Math.max(audioPeak, Math.abs(pcm.readInt16LE(i)));
});
rt.on('response.done', (ev) => {
  done = { status: ev.response.status };
  clearTimeout(watchdog);
  rt.close();
  finish();
});
