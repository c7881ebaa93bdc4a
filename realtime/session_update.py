"""`session.update`, field by field: what applies, and an error for each field refused.

OpenAI's server applies the valid fields of an update even when others are refused; so does this one.
`parse_session_update` reads the client's `session` object against the current settings and returns
the changes to apply and a `ClientError` per refused field (each naming it in `param`). The
Realtime event machine applies the changes, sends the errors, then `session.updated` with the
resulting config: what was applied, never a refused value.

Fields of the GA session schema this server cannot honour (tools, noise reduction, ...) are refused
by name unless their value asks for nothing (null, [], "auto"), so a client never believes a feature
is on when it is not. Input transcription and text-only answers are honoured when the model has a
text tokenizer (`text`), and refused by name when it has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from realtime.audio import parse_wire_format
from realtime.vad import VadParams
from realtime.wire_fields import ClientError, get_field, unsupported

# semantic_vad's eagerness served by our server VAD: how long a pause ends a turn, and how sure the VAD
# must be that it hears speech (a higher threshold also makes barge-ins harder). "auto" is "medium".
EAGERNESS: dict[str, tuple[int, float]] = {  # eagerness -> (silence_duration_ms, threshold)
    "low": (1000, 0.6),
    "medium": (600, 0.5),
    "auto": (600, 0.5),
    "high": (300, 0.45),
}

_UNSET: Any = object()

# Keys of the GA session object (and the beta flat spellings) this parser knows; anything else is
# refused as unknown, as OpenAI does.
_KNOWN = {
    "type", "object", "id", "model", "instructions", "audio", "output_modalities", "modalities", "temperature", "tools",
    "tool_choice", "parallel_tool_calls", "max_output_tokens", "max_response_output_tokens", "include", "prompt", "reasoning",
    "tracing", "truncation", "expires_at", "input_audio_format", "output_audio_format", "turn_detection", "voice",
    "input_audio_transcription", "input_audio_noise_reduction", "speed", "duplex",
}


@dataclass
class SessionUpdate:
    changes: dict = field(default_factory=dict)  # SessionSettings field -> new value
    turn_detection: Any = _UNSET  # VadParams | None when changed
    turn_detection_wire: dict | None = None  # the turn_detection object to echo (semantic_vad: as the client asked)
    opted_in: bool = False  # the client sent `duplex`: it wants our additions (docs/protocol.md)
    refused: list[ClientError] = field(default_factory=list)

    @property
    def turn_detection_changed(self) -> bool:
        return self.turn_detection is not _UNSET


def parse_session_update(cfg: dict, settings, turn_detection: VadParams | None, audio_started: bool,
                         text: bool = False) -> SessionUpdate:
    """`settings`: the session's SessionSettings; `audio_started`: output audio went out (the voice is fixed);
    `text`: the model reads and writes text (transcription, text-only answers)."""
    upd = SessionUpdate()
    audio = _part(upd, cfg, "audio", "session.")
    inp = _part(upd, audio, "input", "session.audio.")
    out = _part(upd, audio, "output", "session.audio.")

    def attempt(fn, *args) -> None:
        try:
            fn(*args)
        except ClientError as e:
            upd.refused.append(e)

    for key in cfg:
        if key not in _KNOWN:
            upd.refused.append(ClientError("unknown_parameter", f"unknown parameter 'session.{key}'", f"session.{key}"))
    attempt(_formats, upd, cfg, inp, out)
    if "turn_detection" in inp or "turn_detection" in cfg:
        td = inp["turn_detection"] if "turn_detection" in inp else cfg["turn_detection"]
        attempt(_turn_detection, upd, td, turn_detection)
    attempt(_voice, upd, cfg, out, settings, audio_started)
    for key, types, conv in (("instructions", str, str), ("model", str, str), ("temperature", (int, float), float)):
        attempt(_simple, upd, cfg, key, types, conv)
    attempt(_refusals, upd, cfg, inp, out)
    attempt(_transcription, upd, cfg, inp, text)
    attempt(_modalities, upd, cfg, text)
    if cfg.get("truncation") is not None:
        attempt(_truncation, upd, cfg["truncation"])
    if "duplex" in cfg:
        upd.opted_in = True
        attempt(_ours, upd, cfg)
    # Range checks: each out-of-range value is refused alone; the rest still applies.
    for name, why in replace(settings, **upd.changes).problems():
        param = _GA_PARAMS.get(name, f"session.duplex.{name}")
        upd.changes.pop(name, None)
        upd.refused.append(ClientError("invalid_value", f"'{param}' {why}", param))
    return upd


_GA_PARAMS = {"temperature": "session.temperature", "retention_ratio": "session.truncation.retention_ratio",
              "truncation": "session.truncation"}


def _truncation(upd: SessionUpdate, value) -> None:
    """OpenAI's `truncation`: "auto", "disabled", or {"type": "retention_ratio", "retention_ratio": r}
    (docs/protocol.md, Limits: what the server drops when the context is full)."""
    p = "session.truncation"
    if value in ("auto", "disabled"):
        upd.changes["truncation"] = value
        return
    if not isinstance(value, dict):
        raise ClientError("invalid_value", f"'{p}' must be \"auto\", \"disabled\" or a retention_ratio object", p)
    if get_field(value, "type", str, required=True, prefix=p + ".") != "retention_ratio":
        raise ClientError("invalid_value", f"'{p}.type' must be \"retention_ratio\"", p + ".type")
    limits = value.get("token_limits")
    if limits not in (None, {}) and not (isinstance(limits, dict) and limits.get("post_instructions") is None):
        raise unsupported(p + ".token_limits", "the context is the model's positions; set retention_ratio only")
    ratio = get_field(value, "retention_ratio", (int, float), required=True, prefix=p + ".")
    if not 0.0 < ratio <= 1.0:  # checked here, not by problems(): a refused ratio leaves the mode as it was
        raise ClientError("invalid_value", f"'{p}.retention_ratio' must be within (0, 1]", p + ".retention_ratio")
    upd.changes["truncation"], upd.changes["retention_ratio"] = "retention_ratio", float(ratio)


def _part(upd: SessionUpdate, obj: dict, key: str, prefix: str) -> dict:
    try:
        return get_field(obj, key, dict, prefix=prefix) or {}
    except ClientError as e:
        upd.refused.append(e)
        return {}


def _formats(upd: SessionUpdate, cfg: dict, inp: dict, out: dict) -> None:
    for side, obj, flat, key in (("input", inp, "input_audio_format", "input_format"), ("output", out, "output_audio_format", "output_format")):
        if "format" in obj or flat in cfg:
            try:
                upd.changes[key] = parse_wire_format(obj.get("format", cfg.get(flat)))
            except ValueError as e:
                param = f"session.audio.{side}.format"
                upd.refused.append(ClientError("invalid_value", f"'{param}': {e}", param))


# ours, in either VAD type: the answer started at a pause in the user's speech (docs/protocol.md)
SPECULATION_KEYS = (("speculative", bool), ("speculate_after_ms", int))


def _turn_detection(upd: SessionUpdate, td, current: VadParams | None) -> None:
    p = "session.audio.input.turn_detection."
    if td is None:
        upd.turn_detection, upd.turn_detection_wire = None, None
        return
    if not isinstance(td, dict):
        raise ClientError("invalid_type", "'turn_detection' must be an object or null", p[:-1])
    kind = get_field(td, "type", str, prefix=p) or "server_vad"
    base = current or VadParams()
    kw: dict = {}
    if kind == "semantic_vad":
        eagerness = get_field(td, "eagerness", str, prefix=p) or "auto"
        if eagerness not in EAGERNESS:
            raise ClientError("invalid_value", f"eagerness must be one of {', '.join(EAGERNESS)}", p + "eagerness")
        kw["silence_duration_ms"], kw["threshold"] = EAGERNESS[eagerness]
        keys = (("create_response", bool), ("interrupt_response", bool), *SPECULATION_KEYS)
    elif kind == "server_vad":
        if td.get("idle_timeout_ms") is not None:
            raise unsupported(p + "idle_timeout_ms", "no idle-timeout prompts (use null)")
        keys = (("threshold", (int, float)), ("prefix_padding_ms", int), ("silence_duration_ms", int),
                ("create_response", bool), ("interrupt_response", bool), ("min_speech_ms", int), *SPECULATION_KEYS)
    else:
        raise ClientError("invalid_value", f"turn_detection type {kind!r} is not supported (server_vad, semantic_vad or null)", p + "type")
    for key, types in keys:
        if (v := get_field(td, key, types, prefix=p)) is not None:
            kw[key] = v
    params = replace(base, **kw)
    try:
        params.validate()
    except ValueError as e:
        raise ClientError("invalid_value", str(e), p + str(e).split()[0].split(".")[-1]) from None
    upd.turn_detection = params
    if kind == "semantic_vad":
        upd.turn_detection_wire = {"type": "semantic_vad", "eagerness": td.get("eagerness") or "auto",
                                   "create_response": params.create_response, "interrupt_response": params.interrupt_response}


def _voice(upd: SessionUpdate, cfg: dict, out: dict, settings, audio_started: bool) -> None:
    voice = out.get("voice", cfg.get("voice"))
    if voice is None:
        return
    param = "session.audio.output.voice"
    if not isinstance(voice, str):
        raise ClientError("invalid_type", f"'{param}' must be a string", param)
    if audio_started and voice != settings.voice:
        raise ClientError("invalid_value", "the voice cannot change once audio has been output", param)
    upd.changes["voice"] = voice


def _simple(upd: SessionUpdate, cfg: dict, key: str, types, conv) -> None:
    if (v := get_field(cfg, key, types, prefix="session.")) is not None:
        upd.changes[key] = conv(v)


def _ours(upd: SessionUpdate, cfg: dict) -> None:
    ours = get_field(cfg, "duplex", dict, prefix="session.") or {}
    for key, types in (("top_k", int), ("top_p", (int, float)), ("seed", int), ("cfg_scale", (int, float)), ("max_response_ms", (int, float))):
        try:
            if (v := get_field(ours, key, types, prefix="session.duplex.")) is not None:
                upd.changes[key] = v
        except ClientError as e:
            upd.refused.append(e)


def _refusals(upd: SessionUpdate, cfg: dict, inp: dict, out: dict) -> None:
    """GA fields asking for what OpusLM cannot do: accepted only when they ask for nothing."""
    checks = (
        ("session.type", cfg.get("type"), lambda v: v in (None, "realtime"), "only 'realtime' sessions (no transcription-only sessions)"),
        ("session.audio.input.noise_reduction", inp.get("noise_reduction"), _nothing, "no noise reduction; use null"),
        ("session.input_audio_noise_reduction", cfg.get("input_audio_noise_reduction"), _nothing, "no noise reduction; use null"),
        ("session.audio.output.speed", out.get("speed"), lambda v: v in (None, 1, 1.0), "the speech rate is the model's own; use 1.0"),
        ("session.speed", cfg.get("speed"), lambda v: v in (None, 1, 1.0), "the speech rate is the model's own; use 1.0"),
        ("session.tools", cfg.get("tools"), _nothing, "OpusLM has no function calling"),
        ("session.tool_choice", cfg.get("tool_choice"), lambda v: v in (None, "auto", "none"), "OpusLM has no function calling"),
        ("session.max_output_tokens", cfg.get("max_output_tokens"), lambda v: v in (None, "inf"),
         "answers are bounded in time, not tokens: set session.duplex.max_response_ms"),
        ("session.max_response_output_tokens", cfg.get("max_response_output_tokens"), lambda v: v in (None, "inf"),
         "answers are bounded in time, not tokens: set session.duplex.max_response_ms"),
        ("session.include", cfg.get("include"), _nothing, "no transcription log probabilities"),
        ("session.prompt", cfg.get("prompt"), _nothing, "no stored prompts; send instructions"),
        ("session.reasoning", cfg.get("reasoning"), _nothing, "OpusLM does not reason in text"),
        ("session.tracing", cfg.get("tracing"), _nothing, "no OpenAI traces on this server"),
    )
    for param, value, ok, why in checks:
        if not ok(value):
            upd.refused.append(unsupported(param, why))


def _nothing(v) -> bool:
    return v is None or v == [] or v == {}


NO_TEXT = "the model has no text tokenizer: it hears and speaks audio only"

# AudioTranscription's fields that ask for what the model cannot do unless empty: it writes the
# user's words as it heard them (ESPnet's dialogue target), with no language hint, prompt or keywords,
# and beside the answer, so with no delay to choose
_TRANSCRIPTION_EMPTY = {"language": "no language hint: the model writes the language it hears",
                        "prompt": "no transcription prompt: the model writes what it heard",
                        "delay": "the transcript is written beside the answer: no delay to choose",
                        "keywords": "no keywords: the model writes what it heard",
                        "languages": "no language hint: the model writes the language it hears"}


def _transcription(upd: SessionUpdate, cfg: dict, inp: dict, text: bool) -> None:
    """audio.input.transcription (GA) or input_audio_transcription (beta): the dialogue model itself
    writes each answered user turn's transcript; any model name is taken (and echoed), as no other
    model runs. null turns it off."""
    if "transcription" in inp:
        param, value = "session.audio.input.transcription", inp["transcription"]
    elif "input_audio_transcription" in cfg:
        param, value = "session.input_audio_transcription", cfg["input_audio_transcription"]
    else:
        return
    if value is None:
        upd.changes["transcription"] = None
        return
    if not isinstance(value, dict):
        raise ClientError("invalid_type", f"'{param}' must be an object or null", param)
    if not text:
        raise unsupported(param, NO_TEXT + "; use null")
    for key in value:
        if key != "model" and key not in _TRANSCRIPTION_EMPTY:
            raise ClientError("unknown_parameter", f"unknown parameter '{param}.{key}'", f"{param}.{key}")
    for key, why in _TRANSCRIPTION_EMPTY.items():
        if value.get(key) not in (None, "", []):
            raise unsupported(f"{param}.{key}", why)
    model = get_field(value, "model", str, prefix=param + ".")
    upd.changes["transcription"] = {"model": model}


def _modalities(upd: SessionUpdate, cfg: dict, text: bool) -> None:
    for key in ("output_modalities", "modalities"):
        if cfg.get(key) is not None:
            upd.changes["output_modalities"] = parse_modalities(cfg[key], f"session.{key}", beta=key == "modalities", text=text)


def parse_modalities(value, param: str, beta: bool, text: bool) -> tuple[str, ...]:
    """["audio"] (audio answers, with their transcript) or ["text"] (text-only answers: a model with
    text). GA clients cannot ask for both; beta's ["audio", "text"] meant audio with its transcript."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ClientError("invalid_type", f"'{param}' must be a list of strings", param)
    kinds = set(value)
    if beta and kinds == {"audio", "text"}:
        return ("audio",)
    if kinds == {"audio"}:
        return ("audio",)
    if kinds == {"text"}:
        if not text:
            raise unsupported(param, NO_TEXT + ": use ['audio']")
        return ("text",)
    raise unsupported(param, "answers are either audio (with its transcript) or text only: use ['audio'] or ['text']")


def echo_turn_detection(vad: VadParams | None, wire: dict | None, extensions: bool) -> dict | None:
    """The turn_detection object of session.created/updated: semantic_vad as the client asked it;
    server_vad with its parameters (`min_speech_ms` and the speculation's are ours: only for clients that opted in)."""
    if vad is None:
        return None
    if wire is not None:
        return dict(wire)
    td = {"type": "server_vad", "threshold": vad.threshold, "prefix_padding_ms": vad.prefix_padding_ms,
          "silence_duration_ms": vad.silence_duration_ms, "idle_timeout_ms": None, "create_response": vad.create_response,
          "interrupt_response": vad.interrupt_response}
    if extensions:
        td.update(min_speech_ms=vad.min_speech_ms, speculative=vad.speculative, speculate_after_ms=vad.speculate_after_ms)
    return td
