"""The Python client SDK (realtime/client/) and `duplex client` against a real gateway on 127.0.0.1
with the real engine (tiny model, CPU, vLLM): conversations, an interruption, a connection cut
mid-answer by a TCP proxy (reconnect + resume), typed errors, the CLI as a subprocess.

One engine + gateway for the module (on the shared loop thread); each test's client runs on its own loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
import wave
from pathlib import Path

import numpy as np
import pytest
import websockets
from rt_helpers import running_gateway, silence

from engine.service_api import Role
from realtime.client import (
    AudioChunk, ConnectError, DuplexClient, OutputCleared, ProtocolError, Reconnect, Reconnecting, ResponseCreated,
    ResponseDone, Resumed, ServerAtCapacity, SessionCreated, SessionEnded, SessionLost, SimulatedSpeaker, SpeechStopped, Unauthorized,
)

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]
TOKEN = "client-test-token"
CAPACITY = 3
MAX_RESPONSE_MS = 4000.0


@pytest.fixture(scope="module")
def gateway(loop_thread, tiny_model):
    with running_gateway(loop_thread, tiny_model, CAPACITY, {
        "server": {"port": 0, "token": TOKEN},
        "vad": {"silence_duration_ms": 400},
        "session": {"max_response_ms": MAX_RESPONSE_MS, "temperature": 0.0},
        "limits": {"resume_grace_s": 20.0},
    }) as gw:
        yield gw


def url(gw, port: int | None = None) -> str:
    return f"ws://127.0.0.1:{port or gw.port}/v1/realtime"


def run(coro, timeout: float = 180):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def utterance(speech, text: str, rate: int = 16_000) -> np.ndarray:
    return np.concatenate([silence(200, rate), speech(text, rate), silence(800, rate)])


class Talk:
    """Consumes a client's events (playing answers into a simulated speaker) while the test talks."""

    def __init__(self, client: DuplexClient, ack_interval_ms: float = 100.0) -> None:
        self.client = client
        self.ack_interval_ms = ack_interval_ms
        self.speaker = SimulatedSpeaker()
        self.events: list = []
        self._new = asyncio.Event()
        self.task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        async for ev in self.client.play(self.speaker, self.ack_interval_ms):
            self.events.append(ev)
            self._new.set()

    async def wait_for(self, kind: type, pred=lambda e: True, timeout: float = 60.0, speaking: bool = True):
        """The first event of `kind` matching `pred`; meanwhile the microphone stays open (silence)."""
        deadline = time.monotonic() + timeout
        while True:
            for e in self.events:
                if isinstance(e, kind) and pred(e):
                    return e
            if time.monotonic() > deadline:
                raise AssertionError(f"no {kind.__name__} within {timeout}s; got {[type(e).__name__ for e in self.events]}")
            if self.task.done():
                self.task.result()
                raise AssertionError(f"events ended before a {kind.__name__}")
            if speaking:
                await self.client.stream_audio(silence(60, 16_000), 16_000)
            else:
                self._new.clear()
                try:
                    await asyncio.wait_for(self._new.wait(), 0.1)
                except asyncio.TimeoutError:
                    pass

    async def say(self, pcm: np.ndarray) -> ResponseDone:
        """Say it at real-time pace and wait for the answer to it."""
        n = len(self.events)
        await self.client.stream_audio(pcm, 16_000)
        created = await self.wait_for(ResponseCreated, lambda e: self.events.index(e) >= n)
        return await self.wait_for(ResponseDone, lambda e: e.response_id == created.response_id)

    def audio(self, response_id: str) -> list[AudioChunk]:
        return [e for e in self.events if isinstance(e, AudioChunk) and e.response_id == response_id]


def assert_whole(chunks: list[AudioChunk], done: ResponseDone) -> None:
    """Every sample of the answer arrived exactly once, in order (24 kHz, within one resampler tail)."""
    assert chunks, "no audio"
    pos = 0.0
    for ch in chunks:
        assert ch.start_ms == pytest.approx(pos, abs=1e-6)
        pos += ch.duration_ms
    assert pos == pytest.approx(done.audio_ms, abs=2.0)


def test_two_turn_conversation_opus_both_ways(gateway, speech):
    async def main():
        async with DuplexClient(url(gateway), TOKEN, input_format="opus", output_format="opus") as c:
            assert c.session["audio"]["output"]["format"]["type"] == "audio/opus"
            talk = Talk(c)
            done1 = await talk.say(utterance(speech, "hello, how are you doing today"))
            done2 = await talk.say(utterance(speech, "and what are you doing tomorrow"))
            history = list(gateway.conversation(c.session_id).history)
            await talk.speaker.drain()
        await talk.task
        return talk, done1, done2, history

    talk, done1, done2, history = run(main())
    assert isinstance(talk.events[0], SessionCreated)
    assert [d.status for d in (done1, done2)] == ["completed", "completed"]
    assert sum(isinstance(e, SpeechStopped) for e in talk.events) >= 2
    for done in (done1, done2):
        assert_whole(talk.audio(done.response_id), done)
        assert done.ttfa_ms is not None
    assert [t.role for t in history] == [Role.USER, Role.ASSISTANT, Role.USER, Role.ASSISTANT]
    assert history[1].audio_frames == round(done1.audio_ms / 20)
    heard = talk.speaker.heard()
    assert heard.size == pytest.approx(24 * (done1.audio_ms + done2.audio_ms), abs=2 * 48)
    assert np.abs(heard).max() > 0


def test_interrupt_keeps_what_was_played(gateway, speech):
    played_ms = 300.0

    async def main():
        async with DuplexClient(url(gateway), TOKEN) as c:
            talk = Talk(c, ack_interval_ms=1e9)  # the only acknowledgement is the interrupt's
            await c.stream_audio(utterance(speech, "tell me a long story please"), 16_000)
            created = await talk.wait_for(ResponseCreated)
            # at least played_ms of the answer has arrived (the server caps an ack at what it sent)
            await talk.wait_for(AudioChunk, lambda e: e.response_id == created.response_id and e.start_ms + e.duration_ms >= played_ms)
            await asyncio.sleep(0.2)
            done = await c.interrupt(played_ms=played_ms)
            await talk.wait_for(ResponseDone, lambda e: e.response_id == created.response_id, speaking=False)
            # response.done (cancelled) goes out at once; the engine's answer turn enters the history
            # when its generation has wound down (the next step): wait for that, bounded
            conv = gateway.conversation(c.session_id)
            for _ in range(100):
                if len(conv.history) >= 2:
                    break
                await asyncio.sleep(0.05)
            history = list(conv.history)
        await talk.task
        return talk, created, done, history

    talk, created, done, history = run(main())
    if done.status == "completed":
        pytest.skip("the tiny model ended its answer before the interruption (random weights)")
    assert done.status == "cancelled" and done.reason == "client_cancelled"
    assert done.played_ms == played_ms
    assert any(isinstance(e, OutputCleared) and e.response_id == created.response_id for e in talk.events)
    assert [t.role for t in history] == [Role.USER, Role.ASSISTANT]
    assert history[1].audio_frames == played_ms // 20  # the engine's next prompt holds exactly what was played
    assert talk.speaker.heard().size < 24 * done.audio_ms  # the speaker dropped what it had not played


class CuttingProxy:
    """A TCP proxy to the gateway; `cut()` kills its connections without a WebSocket close (a network drop)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.connections = 0
        self.blackhole = False  # True: what the server sends is dropped (the client stops hearing it)
        self._transports: list[asyncio.Transport] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._transports += [writer.transport, up_writer.transport]

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter, downstream: bool) -> None:
            try:
                while data := await r.read(1 << 16):
                    if downstream and self.blackhole:
                        continue
                    w.write(data)
                    await w.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                w.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    def cut(self) -> None:
        for t in self._transports:
            t.abort()
        self._transports.clear()
        self.blackhole = False

    async def close(self) -> None:
        self.cut()
        self._server.close()
        await self._server.wait_closed()


def test_connection_cut_mid_answer_resumes_the_same_session(gateway, speech):
    """The network drops mid-answer: first the client stops receiving (what the server sends is lost),
    then the connection dies. The client reconnects, resumes, and gets the lost messages replayed."""
    async def main():
        proxy = CuttingProxy(gateway.port)
        await proxy.start()
        async with DuplexClient(url(gateway, proxy.port), TOKEN, reconnect=Reconnect(initial_s=0.1), seed=1) as c:
            sid = c.session_id
            talk = Talk(c)
            await c.stream_audio(utterance(speech, "hello there, tell me about your day"), 16_000)
            created = await talk.wait_for(ResponseCreated)
            rid = created.response_id
            await talk.wait_for(AudioChunk, lambda e: e.response_id == rid and e.start_ms >= 200)
            runner = gateway.sessions[sid]
            proxy.blackhole = True
            received = c.stats.messages_received
            await talk.wait_for(AudioChunk, lambda e: runner.messages_sent >= received + 3, timeout=60)  # 3 messages lost
            proxy.cut()  # mid-answer: the server keeps generating while the client reconnects
            resumed = await talk.wait_for(Resumed)
            done1 = await talk.wait_for(ResponseDone, lambda e: e.response_id == rid)
            prompt1 = gateway.conversation(sid).last_prompt.copy()
            done2 = await talk.say(utterance(speech, "and what happens next"))
            conv = gateway.conversation(sid)
            history, prompt2 = list(conv.history), conv.last_prompt.copy()
            same_runner = gateway.sessions[sid] is runner
        await talk.task
        await proxy.close()
        return talk, c, proxy, resumed, rid, done1, done2, history, prompt1, prompt2, runner, same_runner

    talk, c, proxy, resumed, rid, done1, done2, history, prompt1, prompt2, runner, same_runner = run(main())
    assert any(isinstance(e, Reconnecting) for e in talk.events)
    assert resumed.session_id == c.session_id and resumed.missed == 0 and resumed.replayed >= 3
    assert c.stats.reconnects == 1 and proxy.connections == 2
    assert same_runner and runner.resumes == 1
    # Nothing was lost: the answer that was cut arrived whole, each sample once, and completed.
    assert done1.status == "completed"
    assert_whole(talk.audio(rid), done1)
    assert_whole(talk.audio(done2.response_id), done2)
    # The history survived: the next turn's engine prompt still holds the earlier turns.
    assert [t.role for t in history] == [Role.USER, Role.ASSISTANT, Role.USER, Role.ASSISTANT]
    assert history[1].audio_frames == round(done1.audio_ms / 20)
    from engine import vocab
    from engine.prompt import open_audio_segment

    turn1 = prompt1.shape[0] - len(open_audio_segment(vocab.ASSISTANT))  # the first user turn, without the opener
    assert np.array_equal(prompt2[:turn1], prompt1[:turn1])
    assert prompt2.shape[0] > prompt1.shape[0] + history[1].audio_frames


def test_a_session_not_resumed_in_time_ends(gateway):
    import dataclasses

    async def main():
        proxy = CuttingProxy(gateway.port)
        await proxy.start()
        c = DuplexClient(url(gateway, proxy.port), TOKEN, reconnect=Reconnect(enabled=False))
        await c.connect()
        sid = c.session_id
        proxy.cut()
        with pytest.raises(SessionLost) as lost:
            async for _ in c.events():
                pass
        for _ in range(100):
            if sid not in gateway.sessions:
                break
            await asyncio.sleep(0.1)
        gone = sid not in gateway.sessions
        await c.close()
        await proxy.close()
        return lost.value, gone

    deps = gateway.admission.deps  # what new sessions' runners read their limits from
    gateway.admission.deps = dataclasses.replace(deps, limits=dataclasses.replace(deps.limits, resume_grace_s=1.0))
    try:
        lost, gone = run(main())
    finally:
        gateway.admission.deps = deps
    assert lost.code == "connection_lost"
    assert gone  # the server freed it after the grace


def test_a_resume_takes_over_a_connection_the_server_still_holds(gateway):
    """The client noticed the drop first: its resume replaces the old connection, which is closed."""
    async def main():
        c = DuplexClient(url(gateway), TOKEN, reconnect=Reconnect(enabled=False))
        await c.connect()
        ws = await websockets.connect(f"{url(gateway)}?resume={c.resume_token}&last_seq={c.stats.messages_received}",
                                      additional_headers={"Authorization": f"Bearer {TOKEN}"})
        resumed = json.loads(await ws.recv())
        with pytest.raises(SessionEnded) as old:
            async for _ in c.events():
                pass
        await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
        cleared = json.loads(await ws.recv())
        sessions = list(gateway.sessions)
        await ws.close()
        await c.close()
        return c.session_id, resumed, old.value, cleared, sessions

    sid, resumed, old, cleared, sessions = run(main())
    assert resumed["type"] == "session.resumed" and resumed["session"]["id"] == sid
    assert resumed["replayed"] == 0 and resumed["missed"] == 0
    assert old.code == "closed_1000"
    assert cleared["type"] == "input_audio_buffer.cleared" and sid in sessions


def test_resume_with_an_unknown_token_is_refused(gateway):
    async def main():
        ws = await websockets.connect(url(gateway) + "?resume=resume_nope&last_seq=3",
                                      additional_headers={"Authorization": f"Bearer {TOKEN}"})
        first = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed):
            await ws.recv()
        return first

    first = run(main())
    assert first["type"] == "error" and first["error"]["code"] == "resume_failed"


def test_errors_are_typed_exceptions(gateway):
    async def main():
        with pytest.raises(Unauthorized) as bad_token:
            async with DuplexClient(url(gateway), "wrong-token"):
                pass
        with pytest.raises(ConnectError) as refused:
            async with DuplexClient("ws://127.0.0.1:1/v1/realtime", TOKEN):
                pass
        async with DuplexClient(url(gateway), TOKEN) as c:
            with pytest.raises(ProtocolError) as bad_value:
                await c.update_session(temperature=99.0)
            ok = await c.update_session(instructions="Be brief.")  # the session goes on
        return bad_token.value, refused.value, bad_value.value, ok

    bad_token, refused, bad_value, ok = run(main())
    assert bad_token.code == "unauthorized" and "401" in bad_token.message
    assert refused.code == "connect_failed"
    assert bad_value.code == "invalid_value" and bad_value.param == "session.temperature"
    assert ok["instructions"] == "Be brief."
    with pytest.raises(ConnectError) as bad_url:
        DuplexClient("ftp://nowhere", TOKEN)
    assert bad_url.value.code == "invalid_url"


def test_capacity_refusal_raises_server_at_capacity(gateway):
    async def main():
        for _ in range(100):  # sessions of earlier tests finish closing on the server side
            if gateway.engine.load().conversations == 0:
                break
            await asyncio.sleep(0.1)
        clients = [DuplexClient(url(gateway), TOKEN) for _ in range(CAPACITY)]
        for c in clients:
            await c.connect()
        try:
            with pytest.raises(ServerAtCapacity) as full:
                async with DuplexClient(url(gateway), TOKEN):
                    pass
        finally:
            for c in clients:
                await c.close()
        return full.value

    full = run(main())
    assert full.code == "server_at_capacity" and "capacity" in full.message


def _write_wav(path: Path, pcm: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())


def _duplex(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "realtime.cli", "client", *args], capture_output=True, text=True, cwd=REPO, timeout=300)


def test_duplex_client_cli_two_turns(gateway, speech, tmp_path):
    wav, out = tmp_path / "question.wav", tmp_path / "reply.wav"
    _write_wav(wav, np.concatenate([speech("good morning, what is the weather like", 22_050), silence(300, 22_050)]), 22_050)
    r = _duplex("--url", url(gateway), "--token", TOKEN, "--wav", str(wav), "--out", str(out), "--turns", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    turns = [ln for ln in lines if ln.startswith("turn ")]
    assert len(turns) == 2 and all("ttfa" in ln and "completed" in ln for ln in turns), r.stdout
    assert "2 turns" in lines[-1] and str(out) in lines[-1]
    with wave.open(str(out)) as w:
        assert w.getframerate() == 24_000 and w.getnchannels() == 1 and w.getnframes() > 24_000 // 10

    # Each answer stopped once 300 ms of it had played, over Opus both ways.
    r = _duplex("--url", url(gateway), "--token", TOKEN, "--wav", str(wav), "--turns", "2", "--interrupt-after", "300", "--opus")
    assert r.returncode == 0, r.stderr
    turns = [ln for ln in r.stdout.splitlines() if ln.startswith("turn ")]
    assert len(turns) == 2, r.stdout
    for ln in turns:
        short = re.search(r"answer (\d+\.\d+) s completed", ln)
        assert "cancelled (client_cancelled)" in ln or (short and float(short.group(1)) < 0.3), ln


def test_duplex_client_cli_bad_input(gateway, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not audio\n")
    wav = tmp_path / "tone.wav"
    _write_wav(wav, (3000 * np.sin(np.arange(16_000) / 8)).astype(np.int16), 16_000)
    cases = [
        (["--wav", str(tmp_path / "missing.wav")], 2, "file not found"),
        (["--wav", str(text)], 2, "not a PCM WAV"),
        (["--url", "ftp://host", "--wav", str(wav)], 2, "bad --url"),
        (["--url", url(gateway), "--token", "wrong", "--wav", str(wav)], 1, "refused the token"),
        (["--wav", str(wav), "--mic"], 2, "--wav"),
    ]
    for args, code, message in cases:
        r = _duplex(*args)
        assert r.returncode == code, (args, r.returncode, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
