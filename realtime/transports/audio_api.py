"""OpenAI's one-shot audio API (issue 21): speech to text and text to speech on the conversations' engine.

    POST /v1/audio/transcriptions   multipart/form-data: file, model, response_format, stream, temperature
                                    -> {"text"} | text | verbose_json | SSE transcript.text.delta/done
    POST /v1/audio/speech           JSON: model, input, voice, response_format, speed, instructions, stream_format
                                    -> the audio, streamed as the engine makes it (chunked)

A request runs in steps, each a possible OpenAI-shaped refusal (`ApiError`, realtime.http.json_error):
the content type (415); the server's state (503 draining) and `audio_api.max_concurrent` one-shot
requests at once (429, Retry-After), so uploads cannot starve the live sessions; the fields (400
naming the field: what the engine cannot honour is refused, never dropped; speech's `input` also in the
model's tokens, counted off the loop: 400 `context_length_exceeded`); the upload's audio
(realtime/audio_upload.py, off the event loop); the engine's first delta or chunk, so a refusal
there is still a status code: `AtCapacity` 503 with Retry-After (as `POST /v1/realtime/calls`),
`NoTextModel` 400 `model_has_no_text`, `EngineError` 500. After the first byte a failure can only
end the reply: a transcript stream gets an `error` event, audio is closed without its last chunk
(realtime/http.py `HttpStream`). docs/protocol.md, "OpenAI audio endpoints", lists every field.

A streamed body is an async generator that is started here (it yields b"" once) before it is
handed to the server, so its `finally` always runs: the engine's iterator is closed there (the
engine cancels), the concurrency slot released and the outcome counted, however the reply ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import TypeVar

import numpy as np

from engine.service_api import (
    SAMPLE_RATE_HZ, AtCapacity, AudioChunk, EngineError, NoTextModel, SpeechOptions, TextTooLong, TranscriptionOptions,
)
from realtime import client_json
from realtime.audio_upload import DecodedAudio, UploadError, UploadLimits, decode_off_loop
from realtime.config import AudioApiSection
from realtime.http import HttpError, HttpReply, HttpRequest, HttpRoute, HttpStream, error_body, json_error
from realtime.speech_formats import FORMATS as SPEECH_FORMATS
from realtime.speech_formats import SpeechEncoder
from realtime.time_stretch import MAX_SPEED, MIN_SPEED
from realtime.transports.context import TransportContext

log = logging.getLogger("duplex.audio_api")

T = TypeVar("T")

NAME = "audio_api"
TRANSCRIPTIONS_PATH = "/v1/audio/transcriptions"
SPEECH_PATH = "/v1/audio/speech"

TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json")
# OpenAI's other formats need what the engine does not give: timestamps (srt, vtt), speakers (diarized_json)
UNSUPPORTED_TRANSCRIPTION_FORMATS = {"srt": "timestamps", "vtt": "timestamps", "diarized_json": "speaker labels"}
TRANSCRIPTION_FIELDS = ("file", "model", "response_format", "stream", "temperature")
# hints, in OpenAI's API too: the model writes what it heard, in the language it heard, with no prompt;
# the transcript is the speech's words either way, so they are accepted (docs/protocol.md, the rule)
HINT_FIELDS = ("prompt", "language")
SPEECH_FIELDS = ("model", "input", "voice", "response_format", "speed", "instructions", "stream_format")
MAX_FORM_FIELDS = 32


class ApiError(Exception):
    """A refusal: status, OpenAI error code, message, the field at fault."""

    def __init__(self, status: HTTPStatus, code: str, message: str, param: str | None = None, headers: dict | None = None,
                 outcome: str = "bad_request") -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.headers, self.outcome = status, code, message, param, headers, outcome

    def reply(self) -> HttpReply:
        return json_error(self.status, self.code, self.message, self.headers, self.param)


def register(ctx: TransportContext) -> AudioApi | None:
    cfg = ctx.config.audio_api
    if not cfg.enabled:
        return None
    api = AudioApi(ctx)
    ctx.routes.http[TRANSCRIPTIONS_PATH] = HttpRoute(
        api.transcriptions, max_body_bytes=cfg.max_upload_bytes, body_timeout_s=cfg.upload_timeout_s, bounded=False, cors=True,
        on_refused=lambda status: api.count("transcriptions", _REFUSAL_OUTCOMES.get(status, "bad_request")))
    ctx.routes.http[SPEECH_PATH] = HttpRoute(
        api.speech, bounded=False, cors=True, on_refused=lambda status: api.count("speech", _REFUSAL_OUTCOMES.get(status, "bad_request")))
    ctx.metrics.audio_running.set_function(lambda: api.running)
    return api


_REFUSAL_OUTCOMES: dict[int, str] = {HTTPStatus.UNAUTHORIZED: "unauthorized", HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "too_large",
                                     HTTPStatus.TOO_MANY_REQUESTS: "busy", HTTPStatus.REQUEST_TIMEOUT: "too_slow"}


class _Slot:
    """One of `audio_api.max_concurrent`; released once, with the request's outcome."""

    def __init__(self, api: AudioApi, endpoint: str) -> None:
        self.api, self.endpoint, self.released = api, endpoint, False
        api.running += 1

    def release(self, outcome: str) -> None:
        if not self.released:
            self.released = True
            self.api.running -= 1
            self.api.count(self.endpoint, outcome)


class AudioApi:
    """The two endpoints' handlers; `running` is the one-shot requests in progress."""

    def __init__(self, ctx: TransportContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.config.audio_api
        self.engine = ctx.admission.engine
        self.metrics = ctx.metrics
        self.running = 0

    def count(self, endpoint: str, outcome: str) -> None:
        self.metrics.audio_requests.labels(endpoint, outcome).inc()

    # ---- POST /v1/audio/transcriptions ----
    async def transcriptions(self, req: HttpRequest) -> HttpReply | HttpStream:
        try:
            _content_type(req, "multipart/form-data", "a multipart/form-data form (file, model, ...)")
            slot = self._slot("transcriptions")
        except ApiError as e:
            self.count("transcriptions", e.outcome)
            return e.reply()
        try:
            form = await _read(req.form(MAX_FORM_FIELDS))
            options, fmt, stream = _transcription_fields(form)
            audio = await _decode(form["file"], _upload_limits(self.cfg))
            deltas, first = await _start(lambda: self.engine.transcribe(audio.pcm, options), self.ctx.config.limits.retry_after_s)
        except ApiError as e:
            slot.release(e.outcome)
            return e.reply()
        except BaseException as e:
            slot.release("client_gone" if isinstance(e, asyncio.CancelledError) else "error")
            raise
        if stream:
            body = self._transcript_events(slot, deltas, first, audio)
            await body.asend(None)  # started: its finally now runs however the reply ends
            return HttpStream(HTTPStatus.OK, body, "text/event-stream", {"X-Accel-Buffering": "no"}, self.cfg.send_timeout_s)
        return await self._transcript(slot, deltas, first, audio, fmt)

    async def _transcript(self, slot: _Slot, deltas: AsyncIterator[str], first: str | None, audio: DecodedAudio, fmt: str) -> HttpReply:
        outcome = "client_gone"
        try:
            parts = [] if first is None else [first]
            try:
                parts += [d async for d in deltas]
            except EngineError as e:
                outcome = "engine_error"
                log.warning("transcription failed in the engine: %s", e)
                return json_error(HTTPStatus.INTERNAL_SERVER_ERROR, e.code, f"the engine failed the transcription: {e}")
            outcome = "ok"
            self.metrics.audio_seconds.labels("transcriptions").inc(audio.duration_s)
            return _transcript_reply("".join(parts), audio, fmt)
        finally:
            await _aclose(deltas)
            slot.release(outcome)

    async def _transcript_events(self, slot: _Slot, deltas: AsyncIterator[str], first: str | None,
                                 audio: DecodedAudio) -> AsyncGenerator[bytes, None]:
        """SSE as OpenAI's transcription stream: transcript.text.delta events, then transcript.text.done;
        an engine failure midway is an `error` event, then the end."""
        outcome = "client_gone"
        try:
            yield b""
            parts: list[str] = []
            try:
                delta = first
                while delta is not None:
                    if delta:
                        parts.append(delta)
                        yield _sse({"type": "transcript.text.delta", "delta": delta})
                    delta = await anext(deltas, None)
            except EngineError as e:
                outcome = "engine_error"
                log.warning("transcription failed in the engine midway: %s", e)
                yield _sse({"type": "error", **error_body(500, e.code, f"the engine failed the transcription: {e}")})
                return
            yield _sse({"type": "transcript.text.done", "text": "".join(parts)})
            outcome = "ok"
            self.metrics.audio_seconds.labels("transcriptions").inc(audio.duration_s)
        finally:
            await _aclose(deltas)
            slot.release(outcome)

    # ---- POST /v1/audio/speech ----
    async def speech(self, req: HttpRequest) -> HttpReply | HttpStream:
        try:
            _content_type(req, "application/json", "a JSON object (model, input, voice, ...)")
            slot = self._slot("speech")
        except ApiError as e:
            self.count("speech", e.outcome)
            return e.reply()
        encoder = None
        try:
            text, voice_pcm, fmt, speed = _speech_fields(await _read(req.read()), self.ctx.voices, self.cfg.max_input_chars)
            await self._check_speech_tokens(text, voice_pcm is not None)
            encoder = SpeechEncoder(fmt, speed)
            options = SpeechOptions(speaker_prompt_pcm=voice_pcm, max_ms=1000.0 * self.cfg.max_speech_s)
            chunks, first = await _start(lambda: self.engine.synthesize(text, options), self.ctx.config.limits.retry_after_s)
        except BaseException as e:
            if encoder is not None:
                encoder.close()
            slot.release(e.outcome if isinstance(e, ApiError) else "client_gone" if isinstance(e, asyncio.CancelledError) else "error")
            if isinstance(e, ApiError):
                return e.reply()
            raise
        body = self._speech_body(slot, chunks, first, encoder)
        await body.asend(None)  # started: its finally now runs however the reply ends
        return HttpStream(HTTPStatus.OK, body, encoder.content_type, stall_timeout_s=self.cfg.send_timeout_s)

    async def _speech_body(self, slot: _Slot, chunks: AsyncIterator[AudioChunk], first: AudioChunk | None,
                           encoder: SpeechEncoder) -> AsyncGenerator[bytes, None]:
        """The encoded audio as the engine decodes it; an engine failure midway raises (the reply is
        closed without its last chunk: audio has no way to say why)."""
        outcome, samples = "client_gone", 0
        try:
            yield b""
            chunk = first
            try:
                while chunk is not None:
                    samples += chunk.pcm.size
                    if data := await _in_thread(encoder.encode, chunk.pcm):
                        yield data
                    if chunk.is_last:
                        break
                    chunk = await anext(chunks, None)
            except EngineError as e:
                outcome = "engine_error"
                log.warning("speech failed in the engine midway (%.2f s sent): %s", samples / SAMPLE_RATE_HZ, e)
                raise
            if tail := await _in_thread(encoder.finish):
                yield tail
            outcome = "ok"
        finally:
            encoder.close()
            await _aclose(chunks)
            self.metrics.audio_seconds.labels("speech").inc(samples / SAMPLE_RATE_HZ)
            slot.release(outcome)

    async def _check_speech_tokens(self, text: str, voice: bool) -> None:
        """Text that fits `max_input_chars` may still not fit the model's context (4096 emoji are 16384
        byte-level tokens): refused naming the limit in tokens, before the engine is asked. Counted off the
        event loop. (A model without text: the engine refuses the request itself, with NoTextModel.)"""
        if not self.engine.supports_text:
            return
        budget = self.engine.text_budget()
        limit = budget.speech_tokens_with_voice if voice else budget.speech_tokens
        if (n := await _in_thread(self.engine.count_text_tokens, text)) > limit:
            raise ApiError(HTTPStatus.BAD_REQUEST, TextTooLong.code,
                           f"input is {n} tokens of this model; at most {limit} fit its context of {budget.context} positions"
                           f"{' beside the voice' if voice else ''}", "input")

    # ---- shared ----
    def _slot(self, endpoint: str) -> _Slot:
        admission, retry_s = self.ctx.admission, self.ctx.config.limits.retry_after_s
        retry = {"Retry-After": str(max(1, round(retry_s)))}
        if admission.closing or admission.draining:
            state = "shutting down" if admission.closing else "draining (another replica takes new requests)"
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "server_unavailable", f"the server is {state}", headers=retry,
                           outcome="at_capacity")
        if self.running >= self.cfg.max_concurrent:
            raise ApiError(HTTPStatus.TOO_MANY_REQUESTS, "rate_limit_exceeded",
                           f"{self.running} audio requests are running, the most this server takes at once "
                           f"(audio_api.max_concurrent); try again in {retry_s:g} s", headers=retry, outcome="busy")
        return _Slot(self, endpoint)


# ---- request fields ----

def _content_type(req: HttpRequest, expected: str, what: str) -> None:
    ctype = req.headers.get("Content-Type", "")
    if ctype.split(";")[0].strip().lower() != expected:
        raise ApiError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type",
                       f"the body must be {what}, sent as {expected}; got {ctype.encode(errors='surrogateescape').decode(errors='replace') or 'no Content-Type'}")


async def _read(reading: Awaitable[T]) -> T:
    """The request's body or form, read only once the request holds a slot (within the route's limits);
    a refusal while reading (413, 408, a malformed form) counted with its outcome like the others."""
    try:
        return await reading
    except HttpError as e:
        raise ApiError(e.status, e.code, e.message, e.param, outcome=_REFUSAL_OUTCOMES.get(e.status, "bad_request")) from None


def _transcription_fields(form: dict[str, bytes]) -> tuple[TranscriptionOptions, str, bool]:
    """(engine options, response_format, stream) from the form; ApiError naming the first field refused."""
    for name in form:
        if name not in TRANSCRIPTION_FIELDS and name not in HINT_FIELDS:
            raise ApiError(HTTPStatus.BAD_REQUEST, "unsupported_parameter",
                           f"'{name}' is not supported by this server (supported: {', '.join(TRANSCRIPTION_FIELDS)})", name)
    if "file" not in form:
        raise ApiError(HTTPStatus.BAD_REQUEST, "missing_required_parameter", "the form needs a 'file' field (the audio)", "file")
    fmt = _text(form, "response_format") or "json"
    if fmt in UNSUPPORTED_TRANSCRIPTION_FORMATS:
        raise ApiError(HTTPStatus.BAD_REQUEST, "unsupported_value", f"response_format {fmt!r} needs "
                       f"{UNSUPPORTED_TRANSCRIPTION_FORMATS[fmt]}, which this model does not give (use json, text or verbose_json)",
                       "response_format")
    if fmt not in TRANSCRIPTION_FORMATS:
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"response_format must be one of {', '.join(TRANSCRIPTION_FORMATS)}; "
                       f"got {fmt!r}", "response_format")
    stream_text = (_text(form, "stream") or "false").lower()
    if stream_text not in ("true", "false"):
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"stream must be true or false; got {stream_text!r}", "stream")
    stream = stream_text == "true"
    if stream and fmt == "verbose_json":
        raise ApiError(HTTPStatus.BAD_REQUEST, "unsupported_value", "verbose_json cannot be streamed (the stream's events carry "
                       "text only): use json or text with stream=true", "stream")
    temperature = TranscriptionOptions().temperature
    if (t := _text(form, "temperature")) is not None:
        try:
            temperature = float(t)
        except ValueError:
            temperature = float("nan")
        if not 0.0 <= temperature <= 1.0:
            raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"temperature must be a number within [0, 1]; got {t!r}",
                           "temperature")
    return TranscriptionOptions(temperature=temperature), fmt, stream


def _text(form: dict[str, bytes], name: str) -> str | None:
    if name not in form:
        return None
    try:
        return form[name].decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"'{name}' is not UTF-8 text", name) from None


def _upload_limits(cfg: AudioApiSection) -> UploadLimits:
    max_decode_bytes = None if cfg.max_decode_mb is None else int(cfg.max_decode_mb * 2**20)
    return UploadLimits(cfg.max_upload_bytes, cfg.max_duration_s, max_decode_bytes, cfg.decode_timeout_s)


async def _decode(data: bytes, limits: UploadLimits) -> DecodedAudio:
    """The upload decoded in a worker under its limits (realtime/audio_upload.py): the loop only awaits."""
    try:
        return await decode_off_loop(data, limits)
    except UploadError as e:
        raise ApiError(e.status, e.code, e.message, "file", outcome="too_large" if e.status == 413 else "bad_request") from None


def _speech_fields(body: bytes, voices: dict, max_chars: int) -> tuple[str, np.ndarray | None, str, float]:
    """(input, the voice's speaker prompt or None for the model's own, response_format, speed); ApiError naming the field."""
    try:
        req = client_json.loads(body)
    except client_json.BadJson as e:
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_json", f"the body is not a JSON object: {e}") from None
    if not isinstance(req, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_json", "the body must be a JSON object")
    for name in req:
        if name not in SPEECH_FIELDS:
            raise ApiError(HTTPStatus.BAD_REQUEST, "unsupported_parameter",
                           f"'{name}' is not supported by this server (supported: {', '.join(SPEECH_FIELDS)})", name)
    if "model" in req and not isinstance(req["model"], str):
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_type", "model must be a string", "model")
    text = req.get("input")
    if not isinstance(text, str) or not text.strip():
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value" if "input" in req else "missing_required_parameter",
                       "input must be a non-empty string: the text to speak", "input")
    if len(text) > max_chars:
        raise ApiError(HTTPStatus.BAD_REQUEST, "string_above_max_length",
                       f"input is {len(text)} characters; at most {max_chars} (audio_api.max_input_chars)", "input")
    voice_pcm = _voice(req, voices)
    fmt = req.get("response_format", "mp3")
    if fmt not in SPEECH_FORMATS:
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"response_format must be one of {', '.join(SPEECH_FORMATS)}; "
                       f"got {fmt!r}", "response_format")
    speed = 1.0 if req.get("speed") is None else req["speed"]  # honoured: the audio is time-stretched (pitch kept)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"speed must be a number within [{MIN_SPEED}, {MAX_SPEED}]; "
                       f"got {speed!r}", "speed")
    # How to speak (tone, accent...): a hint in OpenAI's API too, that this model cannot read (it takes
    # no text about its delivery); the words asked for are spoken either way, so it is accepted
    if req.get("instructions") is not None and not isinstance(req["instructions"], str):
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_type", "instructions must be a string", "instructions")
    stream_format = req.get("stream_format", "audio")
    if stream_format == "sse":
        raise ApiError(HTTPStatus.BAD_REQUEST, "unsupported_value", "stream_format 'sse' is not supported: the audio itself is "
                       "streamed as it is generated (stream_format 'audio')", "stream_format")
    if stream_format not in (None, "audio"):
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"stream_format must be 'audio'; got {stream_format!r}", "stream_format")
    return text, voice_pcm, fmt, float(speed)


def _voice(req: dict, voices: dict) -> np.ndarray | None:
    """A configured voice's speaker prompt; any other name (OpenAI's alloy...) is the model's own voice,
    as in sessions (realtime/voices.py). A custom voice object must name a configured voice."""
    if "voice" not in req:
        raise ApiError(HTTPStatus.BAD_REQUEST, "missing_required_parameter",
                       "voice is required: a voice configured on the server, or any other name for the model's own", "voice")
    voice = req["voice"]
    if isinstance(voice, str) and voice:
        return voices.get(voice)
    if isinstance(voice, dict) and set(voice) == {"id"} and isinstance(voice["id"], str):
        if voice["id"] in voices:
            return voices[voice["id"]]
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", f"no custom voice {voice['id']!r} on this server "
                       f"(configured: {', '.join(sorted(voices)) or 'none'})", "voice")
    raise ApiError(HTTPStatus.BAD_REQUEST, "invalid_type", "voice must be a name (string) or {\"id\": name}", "voice")


# ---- the engine ----

async def _start(call: Callable[[], AsyncIterator[T]], retry_after_s: float) -> tuple[AsyncIterator[T], T | None]:
    """The engine's iterator (`call()`) and its first item (None when it has none). The engine may
    refuse at the call or at the first item: its refusals become ApiErrors, and the iterator is
    closed on any failure (the engine cancels)."""
    it: AsyncIterator[T] | None = None
    try:
        it = call()
        try:
            return it, await anext(it)
        except StopAsyncIteration:
            return it, None
    except BaseException as e:
        if it is not None:
            await _aclose(it)
        refusal = _refusal(e, retry_after_s)
        if refusal is None:
            raise
        raise refusal from None


def _refusal(e: BaseException, retry_after_s: float) -> ApiError | None:
    if isinstance(e, AtCapacity):
        return ApiError(HTTPStatus.SERVICE_UNAVAILABLE, AtCapacity.code, f"{e}; try again in {retry_after_s:g} s",
                        headers={"Retry-After": str(max(1, round(retry_after_s)))}, outcome="at_capacity")
    if isinstance(e, NoTextModel):
        return ApiError(HTTPStatus.BAD_REQUEST, NoTextModel.code, f"this server's model cannot do this: {e}", outcome="no_text_model")
    if isinstance(e, TextTooLong):  # (the gateway counts first: only if its count and the engine's ever disagree)
        return ApiError(HTTPStatus.BAD_REQUEST, e.code, f"the input does not fit the model's context: {e}", "input")
    if isinstance(e, EngineError):
        return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, e.code, f"the engine failed the request: {e}", outcome="engine_error")
    if isinstance(e, ValueError):  # the contract's refusal of empty text or audio (refused before it gets there)
        return ApiError(HTTPStatus.BAD_REQUEST, "invalid_value", str(e))
    return None


async def _aclose(it: AsyncIterator) -> None:
    close = getattr(it, "aclose", None)
    if close is not None:
        await close()


async def _in_thread(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` in a worker thread; when cancelled, wait for the thread before going on, so the
    caller's cleanup never races it (the encoder is not thread-safe)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait({work})
        raise


# ---- replies ----

def _transcript_reply(text: str, audio: DecodedAudio, fmt: str) -> HttpReply:
    usage = {"type": "duration", "seconds": round(audio.duration_s, 3)}
    if fmt == "text":
        return HttpReply(HTTPStatus.OK, text + "\n", "text/plain; charset=utf-8")
    if fmt == "verbose_json":
        # no timestamps from the engine: no segments; no language detection: language null
        body: dict[str, object] = {"task": "transcribe", "language": None, "duration": round(audio.duration_s, 3), "text": text,
                "segments": [], "usage": usage}
    else:
        body = {"text": text, "usage": usage}
    return HttpReply(HTTPStatus.OK, json.dumps(body), "application/json")


def _sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"
