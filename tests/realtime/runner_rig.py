"""The session runner's test rig: an Admission over the fake engine, an in-memory link, audio helpers.

Shared by test_runner.py and test_hostile.py (imported by name: tests/ has no packages). Everything here
reads the running loop's time, so the same rig runs on the wall clock (`run`) or on virtual time
(`run_virtual`, tests/realtime/virtual_time.py: the Rig hands the loop's virtual clock to the Admission).
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import soxr
from fake_engine import FakeEngine, answer_pcm

from engine.codec.synth import speech_like
from realtime.admission import Admission
from realtime.audio import OutputEncoder, WireFormat
from realtime.config import config_from_dict
from realtime.metrics import GatewayMetrics
from realtime.protocol import OpusOutput, ProtocolLimits, RealtimeProtocol, ResumeOffer, SessionSettings
from realtime.resume import new_resume_token
from realtime.runner import SessionRunner
from realtime.vad_batch import VadBatcher
from virtual_time import current_clock, run_virtual as _run_virtual

RATE = 16_000  # engine side
WIRE_RATE = 24_000  # audio/pcm on the wire
LEAD_MS = 150.0  # config default audio.lead_ms
FRAME_MS = 40  # config default audio.output_frame_ms
TEST_TIMEOUT_S = 15.0
STALL_MS = 0.0  # slack where the cursor is checked against the pacer's ideal schedule: none on virtual time (no stalls)


# ---- the in-memory link ---------------------------------------------------------------------------

_EOF = object()


class MemoryLink:
    """The runner's `Link`: messages() fed from a queue, send() recorded with the loop's time,
    close() recorded, lost() a settable flag."""

    def __init__(self, block_send: bool = False) -> None:
        self._in: asyncio.Queue = asyncio.Queue()
        self.sent: list[tuple[float, str | bytes]] = []
        self.closes: list[tuple[int, str]] = []
        self.is_lost = False
        self.block_send = block_send
        self.send_calls = 0

    # Link
    async def messages(self):
        while True:
            m = await self._in.get()
            if m is _EOF:
                return
            yield m

    async def send(self, message: str | bytes) -> None:
        self.send_calls += 1
        if self.block_send:
            await asyncio.get_running_loop().create_future()  # a client that never reads
        self.sent.append((asyncio.get_running_loop().time(), message))

    async def close(self, code: int, reason: str) -> None:
        self.closes.append((code, reason))

    def lost(self) -> bool:
        return self.is_lost

    # the client's side
    def feed(self, *events: dict | str) -> None:
        for ev in events:
            self._in.put_nowait(ev if isinstance(ev, str) else json.dumps(ev))

    def hang_up(self, lost: bool = False) -> None:
        """The client goes away: with a goodbye (lost=False) or the connection dies (lost=True)."""
        self.is_lost = lost
        self._in.put_nowait(_EOF)

    def events(self) -> list[dict]:
        return [json.loads(m) for _, m in self.sent if isinstance(m, str)]

    def timed_events(self) -> list[tuple[float, dict]]:
        return [(t, json.loads(m)) for t, m in self.sent if isinstance(m, str)]

    def types(self) -> list[str]:
        return [e["type"] for e in self.events()]

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events() if e["type"] == kind]

    def deltas(self, response_id: str | None = None) -> list[dict]:
        return [e for e in self.of("response.output_audio.delta") if response_id is None or e["response_id"] == response_id]


class FloodLink(MemoryLink):
    """A client that sends harmless events as fast as the session takes them, after `first`."""

    def __init__(self, first: list[dict], flood: dict) -> None:
        super().__init__()
        self.first = [json.dumps(e) for e in first]
        self.flood = json.dumps(flood)
        self.flooding = True
        self.flood_sent = 0

    async def messages(self):
        for m in self.first:
            yield m
        while self.flooding:
            self.flood_sent += 1
            yield self.flood  # never suspends here: the reader waits only for room in the client lane


# ---- the server side --------------------------------------------------------------------------------


class Rig:
    """An Admission over a FakeEngine with a config from realtime.config (`config_from_dict(config)`), on the
    running loop's clock (made inside the test's loop)."""

    def __init__(self, engine: FakeEngine | None = None, config: dict | None = None) -> None:
        self.engine = engine or FakeEngine(capacity=4)
        self.cfg = config_from_dict(config or {})
        self.metrics = GatewayMetrics()
        self.vad = VadBatcher(self.cfg.audio.vad_batch_ms) if self.cfg.audio.vad_batch_ms > 0 else None
        self.clock = current_clock()
        self.adm = Admission(self.engine, self.cfg, self.metrics, self.vad, clock=self.clock)
        self.tasks: dict[str, asyncio.Task] = {}

    def open(self, link: MemoryLink, resumable: bool = False) -> SessionRunner:
        """Admit a session over `link` (raises AtCapacity) and start running it."""
        runner = self.admit(link, resumable)
        self.tasks[runner.id] = asyncio.create_task(self.adm.run(runner))
        return runner

    def admit(self, link: MemoryLink, resumable: bool = False) -> SessionRunner:
        cfg = self.cfg
        session = self.adm.new_session()
        token = new_resume_token() if resumable else None
        proto = RealtimeProtocol(session, ProtocolLimits(max_append_bytes=cfg.limits.max_append_bytes),
                                 SessionSettings.of(cfg.session, {}), OpusOutput(cfg.audio.opus_bitrate, cfg.audio.opus_complexity),
                                 ResumeOffer(token, cfg.limits.resume_grace_s) if token else None, extensions=True,
                                 text_model=self.engine.supports_text)
        return self.adm.open_session("websocket", link, proto, resume_token=token)

    def conv(self, runner: SessionRunner):
        return self.engine.conversation(runner.id)

    async def ended(self, runner: SessionRunner, timeout: float = 5.0) -> None:
        await asyncio.wait_for(asyncio.shield(self.tasks[runner.id]), timeout)

    def metric(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def run(coro_fn) -> None:
    """Run one test's coroutine on its own event loop, bounded in time."""
    async def main():
        await asyncio.wait_for(coro_fn(), TEST_TIMEOUT_S)
    asyncio.run(main())


def run_virtual(coro_fn, busy_s: float = 0.0) -> None:
    """`run` on virtual time: its own virtual-time loop, bounded in virtual time (and in wall time by the
    loop itself). `busy_s`: virtual seconds each busy turn of the loop costs (virtual_time.py)."""
    async def main():
        await asyncio.wait_for(coro_fn(), TEST_TIMEOUT_S)
    _run_virtual(main, busy_s=busy_s)


async def until(pred, what: str, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


# ---- audio ------------------------------------------------------------------------------------------


def silence16(ms: float) -> np.ndarray:
    return np.zeros(int(RATE * ms / 1000), np.int16)


def speech16(seconds: float, seed: int) -> np.ndarray:
    return (speech_like(seconds, seed=seed) * 20000).astype(np.int16)


def appends(pcm16: np.ndarray, piece_ms: int = 20) -> list[dict]:
    """16 kHz audio as the client sends it: input_audio_buffer.append events of pcm16 at 24 kHz."""
    wire = soxr.resample(pcm16, RATE, WIRE_RATE).astype("<i2")
    n = WIRE_RATE * piece_ms // 1000
    return [{"type": "input_audio_buffer.append", "event_id": f"ev_a{i}",
             "audio": base64.b64encode(wire[i : i + n].tobytes()).decode("ascii")} for i in range(0, wire.size, n)]


def user_turn16() -> np.ndarray:
    """300 ms silence, ~1 s of speech, 700 ms silence: one server-VAD turn."""
    return np.concatenate([silence16(300), speech16(1.0, seed=3), silence16(700)])


def decode_deltas(deltas: list[dict]) -> np.ndarray:
    return np.frombuffer(b"".join(base64.b64decode(d["delta"]) for d in deltas), "<i2")


def delta_ms(d: dict) -> float:
    return len(base64.b64decode(d["delta"])) / 2 / (WIRE_RATE / 1000)


def wire_answer(conv_index: int, response_index: int, answer_ms: float) -> np.ndarray:
    """What the fake's answer (its ramp) is on the wire: 16 kHz -> 24 kHz pcm16, fed to the encoder in the
    session's 40 ms pacing frames exactly as the protocol does, then flushed (response.done)."""
    enc = OutputEncoder(WireFormat.PCM16, frame_ms=FRAME_MS)
    enc.reset()
    pcm = answer_pcm(conv_index, response_index, 0, int(RATE * answer_ms / 1000))
    step = RATE * FRAME_MS // 1000
    frames = [f for i in range(0, pcm.size, step) for f in enc.encode(pcm[i : i + step])] + enc.flush()
    return np.frombuffer(b"".join(frames), "<i2")


def assert_audio_equal(got: np.ndarray, want: np.ndarray) -> None:
    """Equal sample for sample, within soxr's int16 dither (+-2 LSB: the streaming resampler is not bit-exact
    from one run to the next). A ramp of step 7 at 16 kHz moves ~4.7 per 24 kHz sample: a sample missing,
    repeated or shifted fails this."""
    assert got.size == want.size, (got.size, want.size)
    diff = np.abs(got.astype(np.int32) - want.astype(np.int32))
    assert diff.max(initial=0) <= 2, (int(diff.max()), int(np.argmax(diff)))


def index_of(types: list[str], kind: str, start: int = 0) -> int:
    return types.index(kind, start)
