"""`DuplexClient`: one conversation over `WS /v1/realtime`, with reconnect and resume (see the
package docstring, realtime/client/__init__.py)."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import logging
import random
import struct
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection

from realtime.audio import OPUS_FRAME_MS, OutputEncoder, StreamResampler, WireFormat
from realtime.client.events import (
    ERRORS_BY_CODE,
    AudioChunk,
    ConnectError,
    DuplexError,
    ErrorEvent,
    Event,
    FirstAudio,
    InputCommitted,
    OutputCleared,
    ProtocolError,
    Reconnecting,
    ResponseCreated,
    ResponseDone,
    Resumed,
    SessionCreated,
    SessionEnded,
    SessionLost,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    TranscriptDelta,
    UserTranscript,
    UserTranscriptDelta,
    UserTranscriptFailed,
    Unauthorized,
)
from realtime.client.playback import WIRE_RATE_HZ, AudioSink, Player

if TYPE_CHECKING:
    import opuslib

log = logging.getLogger("duplex.client")


_OPUS_ENCODE_RATE_HZ = 16_000
_OPUS_RATES_HZ = (8_000, 12_000, 16_000, 24_000, 48_000)
_BINARY_OPUS = 0x01
_EPOCH = struct.Struct("<I")
_FRAME_MS = 20  # client audio frame


# --- configuration and state -----------------------------------------------------------------------


@dataclass(frozen=True)
class Reconnect:
    """Reconnection policy: attempt k waits min(max_s, initial_s * 2**(k-1)), +- `jitter` of it at
    random; gives up after `max_attempts`, or once the server's resume grace since the drop has passed."""

    enabled: bool = True
    initial_s: float = 0.2
    max_s: float = 5.0
    jitter: float = 0.5
    max_attempts: int = 20

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        base = min(self.max_s, self.initial_s * 2 ** (attempt - 1))
        return base * (1.0 + self.jitter * (2.0 * rng.random() - 1.0))


class ConnState(IntEnum):
    CONNECTING = 0
    OPEN = 1
    RECONNECTING = 2
    CLOSED = 3


@dataclass
class ClientStats:
    messages_received: int = 0  # the session's numbered server messages (the resume position)
    reconnects: int = 0
    replayed: int = 0  # messages the server resent after resumes
    missed: int = 0  # messages the server could not resend
    audio_sent_ms: float = 0.0
    audio_dropped_ms: float = 0.0  # input audio dropped while disconnected (beyond max_buffered_audio_ms)


@dataclass
class _Response:
    id: str
    epoch: int
    received_samples: int = 0  # at the client's output rate
    cleared: bool = False
    done: ResponseDone | None = None
    waiters: list = field(default_factory=list)  # futures of interrupt()


@dataclass
class _Outgoing:
    payload: str | bytes
    audio_ms: float = 0.0  # > 0: input audio (may be dropped while disconnected)


_END = object()


def realtime_url(url: str) -> str:
    """ws(s)://HOST[:PORT][/v1/realtime][?query]; http(s) URLs are accepted; a bare host gets /v1/realtime.
    `duplex=1` is added: this SDK opts in to the server's additions (resume tokens, epochs, latency marks)."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ConnectError("invalid_url", f"not a ws://, wss://, http:// or https:// URL with a host: {url!r}")
    path = parts.path if parts.path not in ("", "/") else "/v1/realtime"
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "duplex"] + [("duplex", "1")]
    return urlunsplit((scheme, parts.netloc, path, urlencode(query), ""))


def _as_int16(pcm: np.ndarray) -> np.ndarray:
    a = np.asarray(pcm)
    if a.ndim == 2:
        a = a.mean(axis=1) if a.dtype.kind == "f" else a.astype(np.int32).mean(axis=1).astype(np.int16)
    if a.ndim != 1:
        raise ValueError(f"audio must be mono 1-D samples (or [samples, channels]), got shape {a.shape}")
    if a.dtype.kind == "f":
        return (np.clip(a, -1.0, 1.0) * 32767.0).astype(np.int16)
    return a.astype(np.int16, copy=False)


# --- the client ------------------------------------------------------------------------------------


class DuplexClient:
    """One conversation with the gateway. Use as `async with DuplexClient(url, token) as c:`.

    `events()` (or `play(sink)`) has one consumer. `send_audio`, `update_session`, `interrupt`,
    `played` may be called from other tasks on the same loop.
    """

    def __init__(self, url: str, token: str | None = None, *, input_format: str = "pcm16", output_format: str = "pcm16",
                 output_rate_hz: int = WIRE_RATE_HZ, reconnect: Reconnect = Reconnect(), open_timeout_s: float = 10.0,
                 max_buffered_audio_ms: float = 2000.0, max_message_bytes: int = 1 << 22, seed: int | None = None) -> None:
        if input_format not in ("pcm16", "opus") or output_format not in ("pcm16", "opus"):
            raise ValueError("input_format and output_format are 'pcm16' or 'opus'")
        self.url = realtime_url(url)
        self.token = token
        self.input_format, self.output_format, self.output_rate_hz = input_format, output_format, output_rate_hz
        self.reconnect, self.open_timeout_s = reconnect, open_timeout_s
        self.max_buffered_audio_ms, self.max_message_bytes = max_buffered_audio_ms, max_message_bytes
        self.state = ConnState.CLOSED
        self.session_id: str | None = None
        self.session: dict = {}
        self.resume_token: str | None = None
        self.resume_grace_s = 0.0
        self.stats = ClientStats()
        self._rng = random.Random(seed)
        self._ws: ClientConnection | None = None
        self._events: asyncio.Queue = asyncio.Queue()
        self._ended: BaseException | object | None = None  # what events() ends with, once the session is over
        self._outbox: deque[_Outgoing] = deque()
        self._ack: dict | None = None  # the latest playback acknowledgement not yet sent
        self._wake = asyncio.Event()  # outbox, ack or connection state changed
        self._progress = asyncio.Event()  # something was sent or the state changed
        self._connected = asyncio.Event()
        self._closing = False
        self._tasks: list[asyncio.Task] = []
        self._ids = itertools.count(1)
        self._updates: deque[tuple[str, asyncio.Future]] = deque()  # session.update event ids awaiting session.updated
        self._response: _Response | None = None
        self._last_error: ErrorEvent | None = None
        self._in_rate: int | None = None
        self._in_resampler: StreamResampler | None = None
        self._in_pending = np.zeros(0, np.int16)
        self._opus_encoder = OutputEncoder(WireFormat.OPUS) if input_format == "opus" else None
        self._out_resampler: StreamResampler | None = None
        self._opus_decoder: opuslib.Decoder | None = None  # made on the first Opus packet
        self._opus_rate = output_rate_hz if output_rate_hz in _OPUS_RATES_HZ else 48_000

    # ---- lifecycle ----
    async def __aenter__(self) -> DuplexClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the session; raises Unauthorized, ServerAtCapacity, ConnectError."""
        self.state = ConnState.CONNECTING
        try:
            ws, created = await self._open(resume=False)
        except BaseException:
            self.state = ConnState.CLOSED
            raise
        self._ws = ws
        self.stats.messages_received = 1
        self.session_id = created["session"]["id"]
        self.session = created["session"]
        self.resume_token = created.get("resume_token")
        self.resume_grace_s = float(created.get("resume_grace_s") or 0.0)
        self._emit(SessionCreated(self.session_id, self.session))
        self._set_state(ConnState.OPEN)
        self._tasks = [asyncio.create_task(self._connection(ws)), asyncio.create_task(self._sender())]
        if self.output_format == "opus":
            try:
                await self.update_session(session={"audio": {"output": {"format": {"type": "audio/opus"}}}})
            except BaseException:
                await self.close()
                raise

    async def close(self) -> None:
        """End the session (a normal close: the server does not keep it for a resume)."""
        if self._closing:
            return
        self._closing = True
        if self.state is ConnState.OPEN and self._outbox:
            try:
                await asyncio.wait_for(self._drain(0.0), 2.0)
            except asyncio.TimeoutError:
                pass
        for t in self._tasks[1:]:
            t.cancel()
        if self._ws is not None:
            await self._ws.close()
        if self._tasks:
            await asyncio.wait(self._tasks[:1], timeout=1.0)  # the receiver ends on the close (not while reconnecting)
            self._tasks[0].cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._end(_END)

    # ---- requests ----
    async def update_session(self, *, instructions: str | None = None, voice: str | None = None,
                             turn_detection: dict | None | str = "keep", temperature: float | None = None,
                             transcribe: bool | None = None, output_modalities: list[str] | None = None,
                             duplex: dict | None = None, session: dict | None = None) -> dict:
        """session.update with the given fields; returns the session object of `session.updated`.
        `turn_detection`: None (client commits turns), or a server_vad object. `transcribe`: the user's
        answered turns transcribed (UserTranscript events); `output_modalities`: ["audio"] or ["text"]
        (text-only answers). Raises ProtocolError (e.g. a model without text refuses both by name)."""
        body = json.loads(json.dumps(session or {}))
        for key, value in (("instructions", instructions), ("temperature", temperature), ("duplex", duplex),
                           ("output_modalities", output_modalities)):
            if value is not None:
                body[key] = value
        audio = body.setdefault("audio", {})
        if voice is not None:
            audio.setdefault("output", {})["voice"] = voice
        if turn_detection != "keep":
            audio.setdefault("input", {})["turn_detection"] = turn_detection
        if transcribe is not None:  # the server's model writes the transcript whatever the name
            audio.setdefault("input", {})["transcription"] = {"model": "duplex"} if transcribe else None
        if not audio:
            del body["audio"]
        event_id = f"client_{next(self._ids)}"
        fut = asyncio.get_running_loop().create_future()
        self._updates.append((event_id, fut))
        await self._send_event({"type": "session.update", "event_id": event_id, "session": body})
        updated = await fut
        return updated["session"]

    async def send_audio(self, pcm: np.ndarray, rate_hz: int) -> None:
        """Queue user audio (mono int16, or float in [-1, 1]) at `rate_hz`; resampled and sent in 20 ms
        frames. Waits while more than `max_buffered_audio_ms` is queued on an open connection."""
        self._check_open()
        pcm = _as_int16(pcm)
        if self._in_rate != rate_hz or self._in_resampler is None:  # (both None before the first audio)
            wire_rate = _OPUS_ENCODE_RATE_HZ if self._opus_encoder else WIRE_RATE_HZ
            self._in_rate = rate_hz
            self._in_resampler = StreamResampler(rate_hz, wire_rate)
        pcm = self._in_resampler.process(pcm)
        if self._opus_encoder is not None:
            for packet in self._opus_encoder.encode(pcm):
                self._queue(_Outgoing(bytes([_BINARY_OPUS]) + packet, OPUS_FRAME_MS))
        else:
            pcm = np.concatenate([self._in_pending, pcm]) if self._in_pending.size else pcm
            n = WIRE_RATE_HZ * _FRAME_MS // 1000
            whole = pcm.size // n * n
            for i in range(0, whole, n):
                b64 = base64.b64encode(pcm[i : i + n].astype("<i2").tobytes()).decode("ascii")
                self._queue(_Outgoing(json.dumps({"type": "input_audio_buffer.append", "audio": b64}), _FRAME_MS))
            self._in_pending = pcm[whole:].copy()
        if self.state is not ConnState.OPEN:
            self._drop_old_audio()
        else:
            await self._drain(self.max_buffered_audio_ms)

    async def stream_audio(self, pcm: np.ndarray, rate_hz: int, frame_ms: int = _FRAME_MS) -> None:
        """send_audio at real-time pace on an absolute schedule (a file played as if from a microphone)."""
        n = max(1, rate_hz * frame_ms // 1000)
        t0 = time.monotonic()
        for k, i in enumerate(range(0, len(pcm), n)):
            await self.send_audio(pcm[i : i + n], rate_hz)
            await asyncio.sleep(max(0.0, t0 + (k + 1) * frame_ms / 1000.0 - time.monotonic()))

    async def commit(self) -> None:
        """End the user turn (turn_detection None)."""
        await self._send_event({"type": "input_audio_buffer.commit"})

    async def create_response(self, output_modalities: list[str] | None = None) -> None:
        """Ask for an answer; `output_modalities` (["text"] or ["audio"]): this answer's, else the session's."""
        event: dict = {"type": "response.create"}
        if output_modalities is not None:
            event["response"] = {"output_modalities": output_modalities}
        await self._send_event(event)

    async def send_text(self, text: str, respond: bool = False) -> None:
        """A typed user turn (conversation.item.create with input_text); `respond`: then ask for an answer."""
        await self._send_event({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}})
        if respond:
            await self.create_response()

    def played(self, played_ms: float, response_id: str | None = None) -> None:
        """Playback acknowledgement: `played_ms` of the response (default: the latest) has been played.
        Coalesced (only the newest is sent) and kept across a reconnect."""
        rid = response_id or (self._response.id if self._response else None)
        self._ack = {"type": "output_audio_buffer.played", "played_ms": round(float(played_ms), 1), "response_id": rid}
        self._wake.set()

    async def interrupt(self, played_ms: float | None = None) -> ResponseDone | None:
        """Stop the answer in progress (the history keeps what was played: `played_ms` if given, sent
        just before the cancel, else the last acknowledgement). Returns its `ResponseDone`, or None when
        no answer was in progress."""
        r = self._response
        if r is None:
            return None
        if r.done is not None:
            return r.done
        fut = asyncio.get_running_loop().create_future()
        r.waiters.append(fut)
        if played_ms is not None:
            self._queue(_Outgoing(json.dumps({"type": "output_audio_buffer.played", "played_ms": round(float(played_ms), 1),
                                              "response_id": r.id})))
        await self._send_event({"type": "output_audio_buffer.clear"})
        return await fut

    # ---- events ----
    async def events(self) -> AsyncIterator[Event]:
        """The session's events, in order; ends when the session is closed, raises SessionEnded /
        SessionLost when the server ended it or the connection could not be resumed."""
        while True:
            item = await self._events.get()
            if item is _END:
                self._events.put_nowait(_END)
                return
            if isinstance(item, BaseException):
                self._events.put_nowait(item)
                raise item
            yield item

    async def play(self, sink: AudioSink, ack_interval_ms: float = 100.0) -> AsyncIterator[Event]:
        """events(), with each answer's audio written to `sink` as it arrives, the sink cleared on
        `OutputCleared`, and playback acknowledged (`played`) every `ack_interval_ms` as it goes."""
        player = Player(self, sink)
        ticker = asyncio.create_task(player.ack_every(ack_interval_ms / 1000.0))
        try:
            async for ev in self.events():
                await player.on_event(ev)
                yield ev
        finally:
            ticker.cancel()

    # ---- connection ----
    async def _open(self, resume: bool) -> tuple[ClientConnection, dict]:
        url = self.url
        if resume:
            parts = urlsplit(url)
            query = [*parse_qsl(parts.query), ("resume", self.resume_token), ("last_seq", str(self.stats.messages_received))]
            url = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(query), ""))
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            ws = await websockets.connect(url, additional_headers=headers, open_timeout=self.open_timeout_s,
                                          max_size=self.max_message_bytes, compression=None)
        except websockets.InvalidStatus as e:
            status = e.response.status_code
            body = e.response.body.decode(errors="replace").strip() if e.response.body else ""
            if status == 401:
                raise Unauthorized("unauthorized", f"the server refused the token (HTTP 401{': ' + body if body else ''})") from None
            raise ConnectError(f"http_{status}", f"the server answered HTTP {status}{': ' + body if body else ''}") from None
        except websockets.InvalidURI as e:
            raise ConnectError("invalid_url", str(e)) from None
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake, websockets.ConnectionClosed) as e:
            raise ConnectError("connect_failed", f"cannot connect to {self.url}: {e or type(e).__name__}") from None
        try:
            first = json.loads(await asyncio.wait_for(ws.recv(), self.open_timeout_s))
        except (asyncio.TimeoutError, websockets.ConnectionClosed, json.JSONDecodeError, TypeError) as e:
            await ws.close()
            raise ConnectError("connect_failed", f"no session from {self.url}: {e or type(e).__name__}") from None
        if first.get("type") == "error":
            await ws.close()
            err = first.get("error") or {}
            code = err.get("code") or "server_error"
            raise ERRORS_BY_CODE.get(code, ConnectError)(code, err.get("message") or "", err.get("param"))
        want = "session.resumed" if resume else "session.created"
        if first.get("type") != want:
            await ws.close()
            raise ConnectError("connect_failed", f"expected {want}, got {first.get('type')!r}")
        return ws, first

    async def _connection(self, ws: ClientConnection) -> None:
        """Receive on `ws` until the session ends; on a lost connection, reconnect and resume."""
        end: BaseException | object = _END
        try:
            while True:
                lost = await self._receive(ws)
                if lost is None:
                    break
                ws = self._ws = await self._resume(lost)
        except DuplexError as e:
            end = e
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug must not hang events()
            log.exception("client connection task failed")
            end = SessionLost("client_error", f"the client failed: {e!r}")
        finally:
            self._set_state(ConnState.CLOSED)
            self._end(end)

    async def _receive(self, ws: ClientConnection) -> str | None:
        """Dispatch messages until the connection ends: the reason it was lost, or None when it was closed."""
        try:
            async for message in ws:
                self.stats.messages_received += 1
                self._dispatch(message)
        except websockets.ConnectionClosed:
            pass
        if self._closing:
            return None
        rcvd = ws.protocol.close_rcvd
        if rcvd is None:
            return "connection lost"
        err = self._last_error
        if err is not None and err.event_id is None:
            raise SessionEnded(err.code, err.message)
        raise SessionEnded(f"closed_{rcvd.code}", f"the server closed the session ({rcvd.code} {rcvd.reason})".strip())

    async def _resume(self, reason: str) -> ClientConnection:
        self._set_state(ConnState.RECONNECTING)
        if not self.reconnect.enabled or not self.resume_token:
            raise SessionLost("connection_lost", f"{reason}; this session cannot be resumed")
        lost_at = time.monotonic()
        for attempt in range(1, self.reconnect.max_attempts + 1):
            delay = self.reconnect.delay_s(attempt, self._rng)
            if self._closing:
                break
            if time.monotonic() + delay > lost_at + self.resume_grace_s:
                break
            self._emit(Reconnecting(attempt, delay, reason))
            await asyncio.sleep(delay)
            try:
                ws, resumed = await self._open(resume=True)
            except (Unauthorized, SessionLost):
                raise
            except DuplexError as e:
                reason = e.message
                continue
            self.stats.reconnects += 1
            self.stats.replayed += resumed.get("replayed", 0)
            self.stats.missed += resumed.get("missed", 0)
            self.session = resumed.get("session") or self.session
            self._emit(Resumed(self.session_id or "", resumed.get("replayed", 0), resumed.get("missed", 0)))
            self._ws = ws
            self._set_state(ConnState.OPEN)
            return ws
        raise SessionLost("reconnect_gave_up", f"{reason}; no resume within {self.resume_grace_s:.0f} s")

    def _set_state(self, state: ConnState) -> None:
        self.state = state
        if state is ConnState.OPEN:
            self._connected.set()
        else:
            self._connected.clear()
        self._wake.set()
        self._progress.set()

    def _end(self, end: BaseException | object) -> None:
        if self._ended is not None:
            return
        self._ended = end
        exc = end if isinstance(end, BaseException) else SessionEnded("session_closed", "the session is closed")
        for _, fut in self._updates:
            if not fut.done():
                fut.set_exception(exc)
        if self._response is not None:
            for fut in self._response.waiters:
                if not fut.done():
                    fut.set_exception(exc)
        self._events.put_nowait(end)

    # ---- sending ----
    def _queue(self, item: _Outgoing) -> None:
        self._outbox.append(item)
        self._wake.set()

    def _check_open(self) -> None:
        if self._ended is not None:
            raise self._ended if isinstance(self._ended, BaseException) else SessionEnded("session_closed", "the session is closed")
        if self.state is ConnState.CLOSED:
            raise SessionEnded("not_connected", "connect() first")

    async def _send_event(self, event: dict) -> None:
        self._check_open()
        self._queue(_Outgoing(json.dumps(event)))
        await self._drain(self.max_buffered_audio_ms)

    async def _drain(self, max_audio_ms: float) -> None:
        """Wait until at most `max_audio_ms` of audio (and no other event) is queued, or the connection is down."""
        while self.state is ConnState.OPEN and (any(o.audio_ms == 0 for o in self._outbox)
                                                or sum(o.audio_ms for o in self._outbox) > max_audio_ms):
            self._progress.clear()
            await self._progress.wait()

    def _drop_old_audio(self) -> None:
        queued = sum(o.audio_ms for o in self._outbox)
        kept: deque[_Outgoing] = deque()
        for o in self._outbox:
            if o.audio_ms and queued > self.max_buffered_audio_ms:
                queued -= o.audio_ms
                self.stats.audio_dropped_ms += o.audio_ms
                continue
            kept.append(o)
        self._outbox = kept

    async def _sender(self) -> None:
        """Sends the outbox in order (and the newest playback ack); a message that fails is sent again after the resume."""
        while True:
            await self._connected.wait()
            ws = self._ws
            assert ws is not None  # _connected is set only once connect() has opened one
            payload: str | bytes
            item: _Outgoing | None
            if self._ack is not None:
                payload, item = json.dumps(self._ack), None
            elif self._outbox:
                item = self._outbox[0]
                payload = item.payload
            else:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await ws.send(payload)
            except websockets.ConnectionClosed:
                await asyncio.sleep(0.01)  # the receiver notices and reconnects
                continue
            if item is None:
                if self._ack is not None and json.dumps(self._ack) == payload:
                    self._ack = None
            elif self._outbox and self._outbox[0] is item:
                self._outbox.popleft()
                self.stats.audio_sent_ms += item.audio_ms
            self._progress.set()

    # ---- receiving ----
    def _emit(self, ev: Event) -> None:
        self._events.put_nowait(ev)

    def _dispatch(self, message: str | bytes) -> None:
        self._last_error = None  # an error counts as the reason for a close only when it came last
        if isinstance(message, bytes):
            self._on_binary(message)
            return
        try:
            ev = json.loads(message)
        except json.JSONDecodeError:
            log.warning("not JSON from the server: %.80r", message)
            return
        handler = self._HANDLERS.get(ev.get("type"))
        if handler is not None:
            handler(self, ev)

    def _on_session_updated(self, ev: dict) -> None:
        self.session = ev["session"]
        if self._updates:
            _, fut = self._updates.popleft()
            if not fut.done():
                fut.set_result(ev)
        self._emit(SessionUpdated(ev["session"]))

    def _on_error(self, ev: dict) -> None:
        err = ev.get("error") or {}
        e = ErrorEvent(err.get("code") or "server_error", err.get("message") or "", err.get("param"), err.get("event_id"))
        self._last_error = e
        for event_id, fut in self._updates:
            if e.event_id is not None and e.event_id == event_id:
                # the entry stays: the server applies the update's valid fields and answers it with a
                # session.updated all the same, which must not be taken for the next update's answer
                if not fut.done():
                    fut.set_exception(ProtocolError(e.code, e.message, e.param))
                return
        self._emit(e)

    def _on_response_created(self, ev: dict) -> None:
        self._response = _Response(ev["response"]["id"], int(ev.get("epoch", 0)))
        self._out_resampler = None
        self._emit(ResponseCreated(self._response.id, self._response.epoch))

    def _on_audio_delta(self, ev: dict) -> None:
        r = self._response
        if r is None or r.id != ev.get("response_id") or r.cleared or r.done is not None:
            return  # audio of a cleared or older response: never played
        pcm = np.frombuffer(base64.b64decode(ev["delta"]), dtype="<i2").astype(np.int16)
        if self.output_rate_hz != WIRE_RATE_HZ:
            if self._out_resampler is None:
                self._out_resampler = StreamResampler(WIRE_RATE_HZ, self.output_rate_hz)
            pcm = self._out_resampler.process(pcm)
        self._audio(r, pcm)

    def _on_binary(self, data: bytes) -> None:
        r = self._response
        if len(data) < 5 or data[0] != _BINARY_OPUS or r is None or r.cleared or r.done is not None:
            return
        if _EPOCH.unpack_from(data, 1)[0] != r.epoch & 0xFFFFFFFF:
            return  # a stale epoch: audio of an interrupted response
        import opuslib

        if self._opus_decoder is None:
            self._opus_decoder = opuslib.Decoder(self._opus_rate, 1)
        pcm = np.frombuffer(self._opus_decoder.decode(bytes(data[5:]), self._opus_rate * 120 // 1000), dtype="<i2").astype(np.int16)
        if self._opus_rate != self.output_rate_hz:
            if self._out_resampler is None:
                self._out_resampler = StreamResampler(self._opus_rate, self.output_rate_hz)
            pcm = self._out_resampler.process(pcm)
        self._audio(r, pcm)

    def _audio(self, r: _Response, pcm: np.ndarray) -> None:
        if pcm.size:
            self._emit(AudioChunk(r.id, r.epoch, pcm, self.output_rate_hz, 1000.0 * r.received_samples / self.output_rate_hz))
            r.received_samples += pcm.size

    def _on_output_cleared(self, ev: dict) -> None:
        if self._response is not None and self._response.id == ev.get("response_id"):
            self._response.cleared = True
        self._emit(OutputCleared(ev.get("response_id", "")))

    def _on_response_done(self, ev: dict) -> None:
        resp = ev["response"]
        ours = resp.get("duplex") or {}
        content = [c for item in resp.get("output") or [] for c in item.get("content") or []]
        transcript = "".join(c.get("transcript") or c.get("text") or "" for c in content)
        done = ResponseDone(resp["id"], resp.get("status", ""), (resp.get("status_details") or {}).get("reason"),
                            float(ours.get("audio_ms") or 0.0), float(ours.get("played_ms") or 0.0), ours.get("ttfa_ms"), transcript,
                            resp.get("output_modalities") == ["text"])
        r = self._response
        if r is not None and r.id == done.response_id:
            r.done = done
            for fut in r.waiters:
                if not fut.done():
                    fut.set_result(done)
        self._emit(done)

    _HANDLERS = {
        "session.updated": _on_session_updated,
        "error": _on_error,
        "input_audio_buffer.speech_started": lambda self, ev: self._emit(SpeechStarted(ev["item_id"], float(ev["audio_start_ms"]))),
        "input_audio_buffer.speech_stopped": lambda self, ev: self._emit(SpeechStopped(ev["item_id"], float(ev["audio_end_ms"]))),
        "input_audio_buffer.committed": lambda self, ev: self._emit(InputCommitted(ev["item_id"])),
        "response.created": _on_response_created,
        "duplex.latency": lambda self, ev: self._emit(FirstAudio(ev["response_id"], int(ev.get("epoch", 0)), ev.get("ttfa_ms"),
                                                                       ev.get("after_confirm_ms"))),
        "response.output_audio.delta": _on_audio_delta,
        "response.output_audio_transcript.delta": lambda self, ev: self._emit(TranscriptDelta(ev["response_id"], ev["delta"])),
        "response.output_text.delta": lambda self, ev: self._emit(TextDelta(ev["response_id"], ev["delta"])),
        "conversation.item.input_audio_transcription.delta":
            lambda self, ev: self._emit(UserTranscriptDelta(ev["item_id"], ev.get("delta") or "")),
        "conversation.item.input_audio_transcription.completed":
            lambda self, ev: self._emit(UserTranscript(ev["item_id"], ev["transcript"])),
        "conversation.item.input_audio_transcription.failed": lambda self, ev: self._emit(UserTranscriptFailed(
            ev["item_id"], (ev.get("error") or {}).get("code") or "transcription_failed", (ev.get("error") or {}).get("message") or "")),
        "output_audio_buffer.cleared": _on_output_cleared,
        "response.done": _on_response_done,
    }
