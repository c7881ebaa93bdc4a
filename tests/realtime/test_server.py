"""The gateway over real sockets on 127.0.0.1 with the real engine (tiny model, CPU, vLLM).

One engine + gateway per module (on the shared loop thread); each test is a client on its own loop.
Speech is espeak-ng, streamed at real-time pace as the OpenAI Realtime clients do.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import websockets
from rt_helpers import espeak, running_gateway, silence

from engine.service_api import Role
from realtime.audio import InputDecoder, OutputEncoder, WireFormat
from realtime.soak.server_process import read_metrics

pytestmark = pytest.mark.vllm

TOKEN = "test-token"
CAPACITY = 3
MAX_RESPONSE_MS = 4000.0


@pytest.fixture(scope="module")
def narrator_wav(tmp_path_factory):
    """A voice for the server's `session.voices` (espeak at 22.05 kHz: the server resamples)."""
    import wave

    path = tmp_path_factory.mktemp("voices") / "narrator.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(22_050)
        w.writeframes(espeak("this is how I sound when I talk", 22_050).astype("<i2").tobytes())
    return path


@pytest.fixture(scope="module")
def gateway(loop_thread, tiny_model, narrator_wav):
    with running_gateway(loop_thread, tiny_model, CAPACITY, {
        "server": {"port": 0, "token": TOKEN},
        "vad": {"silence_duration_ms": 400},
        "session": {"max_response_ms": MAX_RESPONSE_MS, "temperature": 0.0, "voices": {"narrator": str(narrator_wav)}},
        "limits": {"max_message_bytes": 256 * 1024, "max_append_bytes": 64 * 1024},
    }) as gw:
        yield gw


def url(gw, path="/v1/realtime", scheme="ws"):
    return f"{scheme}://127.0.0.1:{gw.port}{path}"


class RtClient:
    """A minimal Realtime client: paced appends, a receiver collecting every event."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.events: list = []
        self.binary: list[bytes] = []
        self._new = asyncio.Event()
        self._rx = asyncio.create_task(self._recv())

    async def _recv(self) -> None:
        try:
            async for m in self.ws:
                if isinstance(m, bytes):
                    self.binary.append(m)
                else:
                    self.events.append(json.loads(m))
                self._new.set()
        except websockets.ConnectionClosed:
            pass

    async def send(self, **event) -> None:
        await self.ws.send(json.dumps(event))

    async def stream(self, pcm24: np.ndarray, piece_ms: int = 20, opus: bool = False) -> None:
        """Append audio at real-time pace on an absolute schedule."""
        n = 24 * piece_ms
        enc = OutputEncoder(WireFormat.OPUS) if opus else None
        dec16 = InputDecoder(WireFormat.PCM16) if opus else None
        t0 = time.monotonic()
        for k, i in enumerate(range(0, pcm24.size, n)):
            piece = pcm24[i : i + n]
            if opus:
                for pkt in enc.encode(dec16.decode(piece.astype("<i2").tobytes())):
                    await self.ws.send(b"\x01" + pkt)
            else:
                await self.send(type="input_audio_buffer.append", audio=base64.b64encode(piece.astype("<i2").tobytes()).decode())
            await asyncio.sleep(max(0.0, t0 + (k + 1) * piece_ms / 1000 - time.monotonic()))

    async def wait_for(self, kind: str, timeout: float = 60.0, after: int = 0, pred=lambda e: True) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events[after:]:
                if e["type"] == kind and pred(e):
                    return e
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {kind} within {timeout}s; got {[e['type'] for e in self.events]}")
            self._new.clear()
            try:
                await asyncio.wait_for(self._new.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    async def close(self) -> None:
        await self.ws.close()
        await self._rx


async def connect(gw, **kw) -> RtClient:
    # ?duplex=1: these tests read our additions (duplex fields, epochs); test_conformance covers plain clients
    ws = await websockets.connect(url(gw) + "?duplex=1", additional_headers={"Authorization": f"Bearer {TOKEN}"}, **kw)
    c = RtClient(ws)
    await c.wait_for("session.created", timeout=10)
    return c


def utterance(speech, text: str, tail_ms: int = 800) -> np.ndarray:
    return np.concatenate([silence(200, 24_000), speech(text, 24_000), silence(tail_ms, 24_000)])


def run(coro, timeout: float = 180):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_pcm16_turn_over_websocket(gateway, speech):
    async def main():
        c = await connect(gateway)
        await c.stream(utterance(speech, "hello, how are you doing today"))
        done = await c.wait_for("response.done")
        await c.close()
        return c, done

    c, done = run(main())
    t = c.types()
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
                 "response.created", "response.output_audio.delta", "response.done"):
        assert kind in t, (kind, t)
    assert t.index("input_audio_buffer.speech_started") < t.index("input_audio_buffer.speech_stopped") < t.index("response.created")
    assert done["response"]["status"] == "completed"
    audio = b"".join(base64.b64decode(e["delta"]) for e in c.events if e["type"] == "response.output_audio.delta")
    assert len(audio) // 2 == pytest.approx(24 * done["response"]["duplex"]["audio_ms"], abs=48)
    assert len(audio) > 0 and done["response"]["duplex"]["ttfa_ms"] is not None


def test_max_output_tokens_bounds_each_answer_on_the_real_engine(gateway, speech):
    """max_output_tokens N (docs/protocol.md, "Every session field"): an answer of at most N model steps,
    20 ms of audio each; the session's, then one response's own; "inf": the server's max_response_ms."""
    async def main():
        c = await connect(gateway)
        await c.send(type="session.update", session={"max_output_tokens": 10, "audio": {"input": {"turn_detection": None}}})
        await c.wait_for("session.updated")
        pcm = utterance(speech, "tell me a long story about the sea", tail_ms=200)
        for i in range(0, pcm.size, 24 * 100):
            await c.send(type="input_audio_buffer.append", audio=base64.b64encode(pcm[i:i + 2400].astype("<i2").tobytes()).decode())
        await c.send(type="input_audio_buffer.commit")
        dones = []
        for response in ({}, {"max_output_tokens": 3}, {"max_output_tokens": "inf"}):
            await c.send(type="response.create", response=response)
            dones.append(await c.wait_for("response.done", after=len(c.events)))
        await c.close()
        return c, [d["response"] for d in dones]

    c, (session_bound, own_bound, unbounded) = run(main())
    assert [e for e in c.events if e["type"] == "error"] == []
    assert 0 < session_bound["duplex"]["audio_ms"] <= 200.0
    assert 0 < own_bound["duplex"]["audio_ms"] <= 60.0
    assert unbounded["duplex"]["audio_ms"] > 200.0  # so the bounds above are what cut the answers


def test_binary_opus_turn(gateway, speech):
    async def main():
        c = await connect(gateway)
        await c.send(type="session.update", session={"audio": {"output": {"format": {"type": "audio/opus"}}}})
        await c.wait_for("session.updated")
        await c.stream(utterance(speech, "please answer me in opus"), opus=True)
        done = await c.wait_for("response.done")
        await c.close()
        return c, done

    c, done = run(main())
    assert "input_audio_buffer.speech_stopped" in c.types()
    assert done["response"]["status"] == "completed"
    assert c.binary and all(b[0] == 1 for b in c.binary)
    assert len(c.binary) == pytest.approx(done["response"]["duplex"]["audio_ms"] / 20, abs=1)
    dec = InputDecoder(WireFormat.OPUS)
    pcm = np.concatenate([dec.decode(b[5:]) for b in c.binary])
    assert pcm.size == 320 * len(c.binary)


def test_openai_sdk_realtime_client_holds_a_turn(gateway, speech):
    from openai import AsyncOpenAI

    async def main():
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{gateway.port}/v1", api_key=TOKEN)
        got, audio = [], bytearray()
        async with client.realtime.connect(model="duplex-opuslm") as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"],
                                               "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                                                                   "turn_detection": {"type": "server_vad", "silence_duration_ms": 400}},
                                                         "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alloy"}}})
            pcm = utterance(speech, "good morning, what is the weather like")

            async def send():
                t0 = time.monotonic()
                for k, i in enumerate(range(0, pcm.size, 480)):
                    await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + 480].astype("<i2").tobytes()).decode())
                    await asyncio.sleep(max(0.0, t0 + (k + 1) * 0.02 - time.monotonic()))

            sender = asyncio.create_task(send())
            async for event in conn:
                got.append(event.type)
                if event.type == "response.output_audio.delta":
                    audio.extend(base64.b64decode(event.delta))
                if event.type == "response.done":
                    status = event.response.status
                    break
            await sender
        return got, audio, status

    got, audio, status = run(main())
    assert got[0] == "session.created" and "session.updated" in got
    assert "input_audio_buffer.speech_started" in got and "response.created" in got
    assert status == "completed" and len(audio) > 0


def test_barge_in_truncates_history_to_played_ms(gateway, speech):
    played_ms = 300

    async def main():
        c = await connect(gateway)
        sid = c.events[0]["session"]["id"]
        await c.stream(utterance(speech, "tell me a long story please"))
        created = await c.wait_for("response.created")
        rid = created["response"]["id"]
        # Play some audio, acknowledge exactly played_ms, then talk over the answer.
        def received_ms() -> float:  # pcm16 24 kHz: 48 bytes per ms
            return sum(len(base64.b64decode(e["delta"])) / 48 for e in c.events
                       if e["type"] == "response.output_audio.delta" and e["response_id"] == rid)

        deadline = time.monotonic() + 60
        while received_ms() < played_ms + 100 and time.monotonic() < deadline:  # an ack is capped at what was sent
            if any(e["type"] == "response.done" for e in c.events):
                break
            await asyncio.sleep(0.02)
        await c.send(type="output_audio_buffer.played", response_id=rid, played_ms=played_ms)
        n = len(c.events)
        await c.stream(utterance(speech, "stop, wait a moment"))
        done1 = await c.wait_for("response.done", pred=lambda e: e["response"]["id"] == rid)
        await c.wait_for("response.done", after=n, pred=lambda e: e["response"]["id"] != rid, timeout=90)
        conv = gateway.conversation(sid)
        history = list(conv.history)
        await c.close()
        return c, rid, done1, history

    c, rid, done1, history = run(main())
    if done1["response"]["status"] == "completed":
        pytest.skip("the tiny model ended its answer before the barge-in (random weights)")
    assert done1["response"]["status"] == "cancelled"
    assert done1["response"]["status_details"]["reason"] == "turn_detected"
    assert any(e["type"] == "output_audio_buffer.cleared" and e["response_id"] == rid for e in c.events)
    roles = [t.role for t in history]
    assert roles[:3] == [Role.USER, Role.ASSISTANT, Role.USER]
    assert history[1].audio_frames == played_ms // 20  # the engine's next prompt holds exactly the played frames


def _speculations(gw) -> dict[str, float]:
    base = url(gw, "", "http")
    return {o: read_metrics(base, TOKEN).get(f'duplex_speculative_responses_total{{outcome="{o}"}}', 0.0)
            for o in ("confirmed", "discarded")}


def test_speculative_answers_reach_the_client_only_once_confirmed(gateway, speech):
    """A pause within the user's speech starts an answer that the speech coming back discards: the
    client never sees it; the answer to the whole turn, started at its last pause, is the one it gets."""
    before = _speculations(gateway)

    async def main():
        c = await connect(gateway)
        sid = c.events[0]["session"]["id"]
        pcm = np.concatenate([silence(200, 24_000), speech("hello there", 24_000), silence(60, 24_000),  # (espeak's own silence, and this: < 400 ms)
                              speech("how are you doing today", 24_000), silence(800, 24_000)])
        await c.stream(pcm)
        done = await c.wait_for("response.done")
        latency = await c.wait_for("duplex.latency")
        await asyncio.sleep(0.3)  # anything of the discarded answer would have arrived by now
        history = list(gateway.conversation(sid).history)
        await c.close()
        return c, done, latency, history

    c, done, latency, history = run(main())
    rid = done["response"]["id"]
    assert done["response"]["status"] == "completed", [e["type"] for e in c.events if "delta" not in e["type"]]
    assert [e["response"]["id"] for e in c.events if e["type"] == "response.created"] == [rid]
    assert c.types().count("input_audio_buffer.speech_started") == 1 and c.types().count("input_audio_buffer.committed") == 1
    assert {e["response_id"] for e in c.events if e["type"] == "response.output_audio.delta"} == {rid}
    assert not any(e["type"] == "error" for e in c.events)
    after = _speculations(gateway)
    assert after["discarded"] >= before["discarded"] + 1 and after["confirmed"] == before["confirmed"] + 1
    # the engine heard one user turn (through the pause) and one answer
    assert [t.role for t in history] == [Role.USER, Role.ASSISTANT]
    assert history[0].audio_frames * 20 >= 1500  # both phrases and the pause between them
    # its first audio went out as the end of the turn was confirmed: ready by then
    assert latency["response_id"] == rid and latency["after_confirm_ms"] is not None and latency["after_confirm_ms"] < 200
    assert done["response"]["duplex"]["after_confirm_ms"] == latency["after_confirm_ms"]


def test_two_sessions_at_once(gateway, speech):
    async def one(text):
        c = await connect(gateway)
        await c.stream(utterance(speech, text))
        done = await c.wait_for("response.done")
        await c.close()
        return done["response"]["status"]

    async def main():
        return await asyncio.gather(one("first caller speaking now"), one("and here is the second caller"))

    assert run(main()) == ["completed", "completed"]


def test_idle_sessions_are_closed_and_active_ones_kept(gateway):
    """limits.idle_timeout_s after a session's last client event it gets an `idle_timeout` error and
    a close; a client that keeps sending events is kept however long it stays."""
    idle_s = 1.5  # 5x the busy client's spacing: a loaded machine does not make it look idle

    async def main():
        quiet, busy = await connect(gateway), await connect(gateway)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2.5 * idle_s:  # busy: an event every 0.3 s
            await busy.send(type="input_audio_buffer.clear")
            await asyncio.sleep(0.3)
        quiet_error = await quiet.wait_for("error", timeout=5 * idle_s)
        await quiet._rx  # the server closed it
        busy_kept = "error" not in busy.types() and busy.ws.close_code is None
        t1 = time.monotonic()
        busy_error = await busy.wait_for("error", timeout=5 * idle_s)
        await busy._rx
        return quiet_error, quiet.ws.close_code, busy_kept, busy_error, time.monotonic() - t1

    deps = gateway.admission.deps  # what new sessions' runners read their limits from
    gateway.admission.deps = dataclasses.replace(deps, limits=dataclasses.replace(deps.limits, idle_timeout_s=idle_s))
    try:
        quiet_error, quiet_code, busy_kept, busy_error, busy_waited = run(main())
    finally:
        gateway.admission.deps = deps
    assert quiet_error["error"]["code"] == "idle_timeout" and quiet_code == 1000
    assert busy_kept
    assert busy_error["error"]["code"] == "idle_timeout" and 0.5 * idle_s < busy_waited < 4 * idle_s


def test_bad_inputs_get_errors_and_the_session_continues(gateway, speech):
    bad = [
        ("{nope", "invalid_json"),
        (json.dumps({"type": "what.is.this"}), "unknown_event_type"),
        (json.dumps({"type": "input_audio_buffer.append"}), "missing_required_parameter"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": 12}), "invalid_type"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": "!!!"}), "invalid_base64"),
        (json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode()}), "invalid_audio"),
        (b"\x01\xff\xfe\xfd\x00\x00corrupt", "invalid_audio"),
        (json.dumps({"type": "conversation.item.truncate", "item_id": "item_x", "audio_end_ms": 5}), "item_truncate_invalid_item_id"),
        (json.dumps({"type": "response.cancel"}), "response_cancel_not_active"),
    ]

    async def main():
        c = await connect(gateway)
        for msg, _ in bad:
            await c.ws.send(msg)
        for k in range(len(bad)):
            await c.wait_for("error", pred=lambda e, k=k: sum(x["type"] == "error" for x in c.events[: c.events.index(e) + 1]) == k + 1)
        # audio_end_ms beyond the audio of a real item
        await c.stream(utterance(speech, "one more time"))
        added = await c.wait_for("response.output_item.added")
        await c.wait_for("response.done")
        await c.send(type="conversation.item.truncate", item_id=added["item"]["id"], content_index=0, audio_end_ms=10**7)
        await c.wait_for("error", pred=lambda e: e["error"]["code"] == "invalid_value" and e["error"]["param"] == "audio_end_ms")
        # an oversize message closes with 1009; the server and other sessions are fine
        other = await connect(gateway)
        await c.ws.send("x" * (300 * 1024))
        await c._rx
        code = c.ws.close_code
        await other.send(type="input_audio_buffer.clear")
        await other.wait_for("input_audio_buffer.cleared")
        await other.close()
        return c, code

    c, code = run(main())
    codes = [e["error"]["code"] for e in c.events if e["type"] == "error"]
    assert codes[: len(bad)] == [code for _, code in bad]
    assert code == 1009


def test_auth_health_metrics(gateway):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url(gateway, "/metrics", "http"))
    assert e.value.code == 401
    with urllib.request.urlopen(url(gateway, "/healthz", "http")) as r:
        assert json.loads(r.read())["ready"] is True
    with urllib.request.urlopen(url(gateway, f"/metrics?token={TOKEN}", "http")) as r:
        text = r.read().decode()
    for name in ("duplex_sessions_active", "duplex_sessions_total", "duplex_sessions_refused_total", "duplex_time_to_first_audio_seconds_bucket",
                 "duplex_chunks_late_total", "duplex_client_underruns_total", "duplex_barge_ins_total", "duplex_engine_step_ms", "duplex_engine_batch_size"):
        assert name in text, name

    async def refused():
        with pytest.raises(websockets.InvalidStatus) as e:
            await websockets.connect(url(gateway))
        with pytest.raises(websockets.InvalidStatus) as e2:
            await websockets.connect(url(gateway) + "?token=wrong")
        return e.value.response.status_code, e2.value.response.status_code

    assert run(refused()) == (401, 401)


def test_capacity_refusal(gateway):
    async def main():
        for _ in range(100):  # sessions of earlier tests finish closing on the server side
            if gateway.engine.load().conversations == 0:
                break
            await asyncio.sleep(0.1)
        assert gateway.engine.load().conversations == 0
        clients = [await connect(gateway) for _ in range(CAPACITY)]
        ws = await websockets.connect(url(gateway) + f"?token={TOKEN}")
        first = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        for c in clients:
            await c.close()
        return first, ws.close_code

    first, close_code = run(main())
    assert first["type"] == "error" and first["error"]["code"] == "server_at_capacity"
    assert close_code == 1013


def test_gateway_audio_equals_the_engine_output(gateway, speech, tiny_model):
    """With greedy sampling the audio a client receives is what the engine makes of the same turn:
    the reference LM + offline codec decode of the prompt the server's conversation used,
    resampled 16 -> 24 kHz. Tolerance: 25 dB SNR at the best alignment within 2 ms (streamed vs
    offline codec decode, int16 rounding, and the gateway's streaming resampler vs one-shot soxr)."""
    import soxr
    import torch

    from engine import vocab
    from engine.codec.dac import DAC
    from engine.codec.streaming import snr_db
    from engine.reference import ReferenceOpusLM
    from engine.request import AudioRequest
    from engine.sampling import GREEDY

    async def main():
        c = await connect(gateway)
        sid = c.events[0]["session"]["id"]
        await c.stream(utterance(speech, "could you tell me the time please"))
        done = await c.wait_for("response.done")
        prompt = gateway.conversation(sid).last_prompt.copy()
        await c.close()
        return c, done, prompt

    c, done, prompt = run(main())
    assert done["response"]["status"] == "completed"
    got = np.frombuffer(b"".join(base64.b64decode(e["delta"]) for e in c.events
                                 if e["type"] == "response.output_audio.delta"), dtype="<i2").astype(np.float32)
    frames = ReferenceOpusLM.from_dir(tiny_model).generate(
        AudioRequest(prompt, max_frames=int(MAX_RESPONSE_MS // 20), min_frames=1, sampling=GREEDY)).frames
    codes = torch.from_numpy(vocab.global_to_dac(frames[:, 1:]).T[None].copy())
    want16 = DAC.from_dir(tiny_model).decode(codes)[0, 0].numpy()
    want = soxr.resample(want16, 16_000, 24_000) * 32767.0
    assert abs(len(got) - len(want)) <= 48
    n = min(len(got), len(want)) - 96
    best = max(snr_db(want[48 : 48 + n], got[48 + lag : 48 + lag + n]) for lag in range(-48, 49))
    assert best > 25.0, best


def test_a_named_voice_is_the_speaker_prompt_of_every_answer(gateway, speech):
    """session.update voice=NAME (a server voice) puts that audio as OpusLM's speaker prompt at the
    head of the engine's prompt; any other name (OpenAI's "alloy") keeps the model's own voice."""
    from engine import vocab
    from engine.prompt import special_rows

    async def turn(voice: str):
        c = await connect(gateway)
        sid = c.events[0]["session"]["id"]
        assert c.events[0]["session"]["duplex"]["voices"] == ["default", "narrator"]
        await c.send(type="session.update", session={"audio": {"output": {"voice": voice}}})
        updated = await c.wait_for("session.updated")
        await c.stream(utterance(speech, "what do you sound like"))
        done = await c.wait_for("response.done")
        prompt = gateway.conversation(sid).last_prompt.copy()
        await c.close()
        return updated, done, prompt

    updated, done, prompt = run(turn("narrator"))
    assert updated["session"]["audio"]["output"]["voice"] == "narrator"
    assert done["response"]["status"] == "completed"
    np.testing.assert_array_equal(prompt[2:4], special_rows(vocab.SYSTEM, vocab.SPEAKER))
    from engine.dialogue import SPEAKER_PROMPT_FRAMES

    voice_frames = -(-gateway.voices["narrator"].size // 320)  # ceil: a last partial frame counts
    assert voice_frames < SPEAKER_PROMPT_FRAMES
    # the voice's frames, then all-PAD frames up to ESPnet's fixed speaker-prompt length (the last 8 steps
    # of the voice's interleaved frames reach into the padding)
    assert (prompt[4 + voice_frames + 8 : 4 + SPEAKER_PROMPT_FRAMES] == vocab.PAD).all()
    assert (prompt[4 : 4 + voice_frames, 0] != vocab.PAD).all()
    user_at = 4 + SPEAKER_PROMPT_FRAMES + 8  # the speaker segment: marker rows, its 500 frames, the 8-step flush
    np.testing.assert_array_equal(prompt[user_at : user_at + 2], special_rows(vocab.USER, vocab.CODEC_SSL))

    _, done, prompt = run(turn("alloy"))
    assert done["response"]["status"] == "completed"
    np.testing.assert_array_equal(prompt[2:4], special_rows(vocab.USER, vocab.CODEC_SSL))
