"""`duplex client`: talk to a running `duplex serve` from a terminal, through the Python SDK
(realtime/client/).

    duplex client --url ws://127.0.0.1:8000/v1/realtime --token TOKEN --wav question.wav --out reply.wav

Streams the WAV at real-time pace, then silence (as an open microphone would) until the answer is
over; the server's VAD ends the turn. With --turns N this is repeated N times in one session. Each
answer is played on a simulated speaker in real time (its playback acknowledged as it goes) and what
was heard is written to --out (24 kHz mono). --interrupt-after MS stops each answer once MS of it has
been played. Per turn it prints: time to first audio measured here (last WAV sample sent -> first
answer audio received) and by the server (end of speech -> first audio sent), when the end of the turn
was detected, the answer's length, status and what the history kept. With --mic and/or --speaker (needs
the `sounddevice` package) the microphone replaces the WAV and/or the answer plays on the speaker.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import sys
import time
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from realtime.sample_queue import SampleQueue

if TYPE_CHECKING:
    from realtime.client import AudioSink, DuplexClient

OUT_RATE_HZ = 24_000
_SILENCE_MS = 100  # the open microphone's silence between turns, sent in pieces of this size
_TURN_GAP_MS = 300  # silence after an answer before the next turn


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("client", help="talk to a running server: stream a WAV (or the microphone), print per-turn latency",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime", help="the server's WebSocket URL (default %(default)s)")
    p.add_argument("--token", default=os.environ.get("DUPLEX_TOKEN"), help="bearer token (default: $DUPLEX_TOKEN)")
    p.add_argument("--wav", help="what to say: a PCM WAV file (any rate; stereo is mixed down)")
    p.add_argument("--out", help="write the answers as heard to this WAV (24 kHz mono)")
    p.add_argument("--turns", type=int, default=1, help="say the WAV this many times in one session (default 1)")
    p.add_argument("--interrupt-after", type=float, metavar="MS", help="interrupt each answer after MS of it was played")
    p.add_argument("--opus", action="store_true", help="Opus on the wire both ways (default pcm16 24 kHz)")
    p.add_argument("--instructions", help="session instructions (system prompt)")
    p.add_argument("--turn-timeout", type=float, default=120.0, metavar="S", help="give up on a turn after S seconds (default 120)")
    p.add_argument("--mic", action="store_true", help="talk into the microphone instead of --wav (needs sounddevice)")
    p.add_argument("--speaker", action="store_true", help="play the answers on the speaker (needs sounddevice)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.cli import CliError
    from realtime.client import ConnectError, DuplexError, realtime_url

    if args.turns < 1:
        raise CliError("--turns must be >= 1")
    if args.interrupt_after is not None and args.interrupt_after < 0:
        raise CliError("--interrupt-after must be >= 0 ms")
    if bool(args.wav) == bool(args.mic):
        raise CliError("give --wav IN.wav or --mic (one of them)")
    if (args.mic or args.speaker) and importlib.util.find_spec("sounddevice") is None:
        raise CliError("--mic/--speaker need the sounddevice package (pip install sounddevice; it uses PortAudio)")
    try:
        url = realtime_url(args.url)
    except ConnectError as e:
        raise CliError(f"bad --url: {e.message}") from None
    pcm, rate = read_wav(args.wav) if args.wav else (None, 0)
    if args.out:
        out = Path(args.out)
        if not out.parent.is_dir():
            raise CliError(f"--out: no such directory: {out.parent}")
    try:
        return asyncio.run(_main(args, url, pcm, rate))
    except DuplexError as e:
        print(f"duplex client: error: {e.message} ({e.code})", file=sys.stderr)
        return 1
    except asyncio.TimeoutError:
        print(f"duplex client: error: no answer within {args.turn_timeout:.0f} s (--turn-timeout)", file=sys.stderr)
        return 1


def read_wav(path: str) -> tuple[np.ndarray, int]:
    """A PCM WAV as mono int16 and its rate; clear errors for a missing file or anything else."""
    from engine.cli import CliError

    p = Path(path)
    if not p.is_file():
        raise CliError(f"--wav: file not found: {path}")
    try:
        with wave.open(str(p)) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise CliError(f"--wav: {path} is not a PCM WAV file ({str(e) or 'too short to be one'})") from None
    if width not in (1, 2, 4):
        raise CliError(f"--wav: {path}: {8 * width}-bit samples are not supported (8, 16 or 32-bit PCM)")
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.int16) - 128) << 8
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.int16)
    else:
        x = (np.frombuffer(raw, "<i4") >> 16).astype(np.int16)
    x = x[: x.size - x.size % channels].reshape(-1, channels)
    pcm = x[:, 0] if channels == 1 else x.astype(np.int32).mean(axis=1).astype(np.int16)
    if pcm.size == 0:
        raise CliError(f"--wav: {path} holds no audio")
    return pcm, rate


def write_wav(path: str, pcm: np.ndarray, rate: int) -> None:
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())


@dataclass
class TurnFigures:
    """One turn as seen from the client (times in ms; None when it did not happen)."""

    speech_end: float = 0.0  # monotonic s: the last WAV sample was sent
    response_id: str | None = None  # the answer to this turn
    endpoint_ms: float | None = None  # speech end -> the server's speech_stopped received
    ttfa_ms: float | None = None  # speech end -> first answer audio received
    server_ttfa_ms: float | None = None  # the server's: end of speech (VAD) -> first audio sent
    answer_ms: float = 0.0  # answer audio received
    status: str = "-"
    reason: str | None = None
    kept_ms: float = 0.0  # what the server's history kept of the answer
    transcript: str = ""

    def line(self, k: int) -> str:
        ms = lambda v: "-" if v is None else f"{v:.0f} ms"  # noqa: E731
        status = self.status + (f" ({self.reason})" if self.reason else "")
        text = f", transcript {self.transcript!r}" if self.transcript else ""
        return (f"turn {k}: ttfa {ms(self.ttfa_ms)} after the WAV ended (server: {ms(self.server_ttfa_ms)} after the end of "
                f"speech), end of turn detected {ms(self.endpoint_ms)} after the WAV ended, answer {self.answer_ms / 1000:.2f} s "
                f"{status}, kept {self.kept_ms / 1000:.2f} s{text}")


async def _main(args: argparse.Namespace, url: str, pcm: np.ndarray | None, rate: int) -> int:
    from realtime.client import DuplexClient, SimulatedSpeaker

    fmt = "opus" if args.opus else "pcm16"
    sink = DeviceSink(OUT_RATE_HZ) if args.speaker else SimulatedSpeaker(OUT_RATE_HZ)
    async with DuplexClient(url, args.token, input_format=fmt, output_format=fmt, output_rate_hz=OUT_RATE_HZ) as c:
        print(f"session {c.session_id} on {url} ({fmt})", flush=True)
        if args.instructions:
            await c.update_session(instructions=args.instructions)
        talk = _Conversation(c, sink)
        consumer = asyncio.create_task(talk.consume())
        try:
            if pcm is None:  # --mic (run() takes --wav or --mic, one of them)
                await _mic(c, talk)
                return 0
            for k in range(1, args.turns + 1):
                fig = await asyncio.wait_for(talk.turn(pcm, rate, args.interrupt_after), args.turn_timeout)
                print(fig.line(k), flush=True)
        finally:
            consumer.cancel()
        await _drain(sink)
        figs = talk.figures
        ttfas = [f.ttfa_ms for f in figs if f.ttfa_ms is not None]
        summary = f"{len(figs)} turns, ttfa median {statistics.median(ttfas):.0f} ms" if ttfas else f"{len(figs)} turns, no answer audio"
        if c.stats.reconnects:
            summary += f", {c.stats.reconnects} reconnects ({c.stats.replayed} messages replayed, {c.stats.missed} missed)"
    if args.out and isinstance(sink, SimulatedSpeaker):
        heard = sink.heard()
        write_wav(args.out, heard, OUT_RATE_HZ)
        summary += f"; wrote {args.out} ({heard.size / OUT_RATE_HZ:.2f} s)"
    print(summary, flush=True)
    return 0


class _Conversation:
    """The events side of `duplex client`: plays answers into the sink and records each turn's figures."""

    def __init__(self, client: DuplexClient, sink: AudioSink) -> None:
        from realtime.client import Player

        self.client, self.sink = client, sink
        self.player = Player(client, sink)
        self.figures: list[TurnFigures] = []
        self._fig: TurnFigures | None = None
        self._done = asyncio.Event()

    async def consume(self) -> None:
        from realtime.client import (
            AudioChunk, FirstAudio, Reconnecting, ResponseCreated, ResponseDone, Resumed, SpeechStopped, TranscriptDelta,
        )

        ticker = asyncio.create_task(self.player.ack_every(0.1))
        try:
            async for ev in self.client.events():
                await self.player.on_event(ev)
                fig, now = self._fig, time.monotonic()
                if isinstance(ev, (Reconnecting, Resumed)):
                    print(f"  {ev}", flush=True)
                if fig is None:
                    continue
                if isinstance(ev, ResponseCreated) and fig.response_id is None:
                    fig.response_id = ev.response_id
                elif isinstance(ev, SpeechStopped) and fig.endpoint_ms is None and fig.speech_end:
                    fig.endpoint_ms = 1000.0 * (now - fig.speech_end)
                elif isinstance(ev, FirstAudio):
                    fig.server_ttfa_ms = ev.ttfa_ms
                elif isinstance(ev, AudioChunk):
                    if fig.ttfa_ms is None and fig.speech_end:
                        fig.ttfa_ms = 1000.0 * (now - fig.speech_end)
                    fig.answer_ms += ev.duration_ms
                elif isinstance(ev, TranscriptDelta):
                    fig.transcript += ev.delta
                elif isinstance(ev, ResponseDone):
                    fig.status, fig.reason, fig.kept_ms = ev.status, ev.reason, ev.played_ms
                    self._done.set()
        finally:
            ticker.cancel()

    async def turn(self, pcm: np.ndarray, rate: int, interrupt_after_ms: float | None) -> TurnFigures:
        c = self.client
        self._fig, self._done = TurnFigures(), asyncio.Event()
        fig = self._fig
        self.figures.append(fig)
        await c.stream_audio(pcm, rate)
        fig.speech_end = time.monotonic()
        silence = np.zeros(rate * _SILENCE_MS // 1000, np.int16)
        interrupted = False
        while not self._done.is_set():  # the open microphone while the server answers
            ours = fig.response_id is not None and self.player.response_id == fig.response_id
            if ours and not interrupted and interrupt_after_ms is not None and self.player.played_ms() >= interrupt_after_ms:
                interrupted = True
                await c.interrupt(played_ms=self.player.played_ms())
            await c.stream_audio(silence, rate)
        await _drain(self.sink)
        await c.stream_audio(np.zeros(rate * _TURN_GAP_MS // 1000, np.int16), rate)
        return fig


async def _drain(sink: AudioSink) -> None:
    drain = getattr(sink, "drain", None)
    if drain is not None:
        await drain()


async def _mic(c: DuplexClient, talk: _Conversation) -> None:
    """The microphone until Ctrl-C (16 kHz mono, 20 ms blocks)."""
    import sounddevice as sd

    loop = asyncio.get_running_loop()
    blocks: asyncio.Queue[np.ndarray] = asyncio.Queue(maxsize=100)

    def put(block: np.ndarray) -> None:  # on the loop
        if not blocks.full():  # 2 s queued already (the sender is behind): this block is dropped
            blocks.put_nowait(block)

    def on_block(indata: np.ndarray, frames: int, t: object, status: object) -> None:  # on PortAudio's thread
        loop.call_soon_threadsafe(put, indata[:, 0].copy())

    print("listening: talk (Ctrl-C ends)", flush=True)
    with sd.InputStream(samplerate=16_000, channels=1, dtype="int16", blocksize=320, callback=on_block):
        while True:
            await c.send_audio(await blocks.get(), 16_000)


class DeviceSink:
    """The speaker through sounddevice: its callback pulls queued audio; what it handed over counts as played."""

    def __init__(self, rate_hz: int) -> None:
        import threading

        import sounddevice as sd

        self.rate_hz = rate_hz
        self._lock = threading.Lock()
        self._queue = SampleQueue()
        self._played = 0
        self._stream = sd.OutputStream(samplerate=rate_hz, channels=1, dtype="int16", callback=self._pull)
        self._stream.start()

    def _pull(self, outdata: np.ndarray, frames: int, t: object, status: object) -> None:
        out = outdata[:, 0]
        out[:] = 0
        n = 0
        with self._lock:
            for part in self._queue.take(frames):
                out[n : n + part.size] = part
                n += part.size
            self._played += n

    async def write(self, pcm: np.ndarray) -> None:
        with self._lock:
            self._queue.append(np.asarray(pcm, np.int16))

    def played_samples(self) -> int:
        return self._played

    def queued_samples(self) -> int:
        return self._queue.samples

    def clear(self) -> None:
        with self._lock:
            self._queue.clear()

    async def drain(self) -> None:
        while self._queue.samples > 0:
            await asyncio.sleep(0.05)
