// The OpenAI Agents SDK for JavaScript (@openai/agents-realtime), on its defaults, against a duplex
// gateway: two spoken turns and a barge-in (tests/realtime/test_frameworks.py runs it).
//
//   node agents_realtime_two_turns.mjs URL API_KEY Q1.pcm Q2.pcm Q3.pcm
//
// Q*.pcm: the user's three utterances (24 kHz mono pcm16, raw), each ending in a pause. The session is
// the SDK's default one (in Node: the WebSocket transport, semantic_vad, transcription, tracing "auto")
// with an agent that has one function tool. On purpose there is NO 'error' listener: Node throws an
// unhandled 'error' event, so any error the SDK surfaces crashes the process, as it would crash an app
// written from the SDK's quickstart. Every server event is printed to stdout as a JSON line
// ({"event": ...}) as it arrives, then one {"summary": ...} line; the exit status is 0 only when the
// conversation went as planned and the server sent no `error` event.

import { readFileSync } from 'node:fs';
import { RealtimeAgent, RealtimeSession, tool } from '@openai/agents-realtime';
import { z } from 'zod';

const [url, apiKey, ...paths] = process.argv.slice(2);
if (!url || !apiKey || paths.length !== 3) {
  console.error('usage: node agents_realtime_two_turns.mjs URL API_KEY Q1.pcm Q2.pcm Q3.pcm');
  process.exit(2);
}
const [q1, q2, q3] = paths.map((p) => readFileSync(p));
const RATE = 24000;
const CHUNK_MS = 100;
const TIMEOUT_MS = Number(process.env.DUPLEX_JS_TIMEOUT_MS ?? 100000);

// The SDK's own logger writes errors with console.error and warnings with console.warn: count them.
const errorLogs = [];
const warnLogs = [];
for (const [name, kept] of [['error', errorLogs], ['warn', warnLogs]]) {
  const original = console[name];
  console[name] = (...args) => {
    kept.push(args.map((a) => (a instanceof Error ? a.stack : typeof a === 'string' ? a : JSON.stringify(a))).join(' '));
    original(...args);
  };
}

const getWeather = tool({
  name: 'get_weather',
  description: 'The weather in a city.',
  parameters: z.object({ city: z.string() }),
  execute: async ({ city }) => `It is sunny in ${city}.`,
});
const agent = new RealtimeAgent({ name: 'assistant', instructions: 'Be brief.', tools: [getWeather] });
const session = new RealtimeSession(agent); // the defaults: no options at all

// What came back, for the summary and for the waits below.
const serverEvents = []; // [type, response status or null]
const serverErrors = []; // the `error` events' payloads
const audio = new Map(); // response id -> {at: first audio (ms since epoch), ms: audio received}
let interrupted = 0;
let wake = () => {};

function changed() {
  const w = wake;
  wake = () => {};
  w();
}

async function until(what, predicate) {
  while (!predicate()) {
    await new Promise((resolve) => {
      wake = resolve;
    });
  }
  return what;
}

const count = (type) => serverEvents.filter(([t]) => t === type).length;
const done = () => serverEvents.filter(([t]) => t === 'response.done').map(([, s]) => s);

session.on('transport_event', (event) => {
  if (typeof event?.type !== 'string') return;
  process.stdout.write(JSON.stringify({ event }) + '\n');
  serverEvents.push([event.type, event.response?.status ?? null]);
  if (event.type === 'error') serverErrors.push(event.error ?? event);
  changed();
});
session.on('audio', (event) => {
  const a = audio.get(event.responseId) ?? { at: Date.now(), ms: 0 };
  a.ms += (1000 * event.data.byteLength) / (2 * RATE);
  audio.set(event.responseId, a);
  changed();
});
session.on('audio_interrupted', () => {
  interrupted += 1;
  changed();
});

// A microphone at twice real time (within the gateway's input budget), 100 ms per chunk.
async function stream(pcm) {
  const step = (RATE * 2 * CHUNK_MS) / 1000;
  for (let i = 0; i < pcm.length; i += step) {
    const chunk = pcm.subarray(i, i + step);
    session.sendAudio(chunk.buffer.slice(chunk.byteOffset, chunk.byteOffset + chunk.byteLength));
    await new Promise((r) => setTimeout(r, CHUNK_MS / 2));
  }
}

// A listener speaks again only once an answer has played: from its first audio, its length.
async function heardToTheEnd(responseIndex) {
  const a = [...audio.values()][responseIndex];
  await new Promise((r) => setTimeout(r, Math.max(0, a.at + a.ms + 100 - Date.now())));
}

function summary(extra = {}) {
  return {
    transport: session.transport.constructor.name,
    events: serverEvents,
    server_errors: serverErrors,
    response_done: done(),
    speech_started: count('input_audio_buffer.speech_started'),
    audio_ms: [...audio.values()].map((a) => Math.round(a.ms)),
    audio_interrupted: interrupted,
    error_logs: errorLogs,
    warn_logs: warnLogs,
    ...extra,
  };
}

const watchdog = setTimeout(() => {
  process.stdout.write(JSON.stringify({ summary: summary({ timed_out: true }) }) + '\n');
  process.exit(3);
}, TIMEOUT_MS);

await session.connect({ apiKey, url });
await until('session.updated', () => count('session.updated') >= 1);
await stream(q1);
await until('answer 1', () => done().length >= 1);
await heardToTheEnd(0);
await stream(q2);
await until('answer 2 playing', () => audio.size >= 2);
await stream(q3); // over answer 2
await until('barge-in', () => interrupted >= 1);
await until('answer 3', () => done().length >= 3);
session.close();
clearTimeout(watchdog);
process.stdout.write(JSON.stringify({ summary: summary() }) + '\n');
const ok = serverErrors.length === 0 && errorLogs.length === 0 && done().join() === 'completed,cancelled,completed';
process.exit(ok ? 0 : 1);
