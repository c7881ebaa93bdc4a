"""`session.update`, field by field: what applies, and an error for each field refused.

OpenAI's server applies the valid fields of an update even when others are refused; so does this one.
`parse_session_update` reads the client's `session` object against the current settings and returns
the changes to apply and a `ClientError` per refused field (each naming it in `param`). The
Realtime event machine applies the changes, sends the errors, then `session.updated` with the
resulting config: what was applied, never a refused value.

The rule (docs/protocol.md, "Every session field"): a field is refused only where honouring it is
impossible and ignoring it would give the client something other than what it asked for. Otherwise
it is honoured, or accepted as the hint it is: `session.updated` echoes the effective value, and a
client that opted in to our additions gets a `duplex.notice` naming the field and what it does here
(`SessionUpdate.notices`). So tools under "auto" (OpusLM never calls one, which "auto" allows) and
transcription hints are accepted; a forced tool call, stored prompts or log probabilities are not.
Input transcription and text-only answers are honoured when the model has a text tokenizer (`text`),
and refused by name when it has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from realtime.audio import parse_wire_format
from realtime.noise_suppression import NOISE_REDUCTION_TYPES
from realtime.tools import NO_CALLS, parse_tool_choice, parse_tools
from realtime.tracing_config import parse_tracing
from realtime.vad import VadParams
from realtime.wire_fields import ClientError, Notice, get_field, unsupported

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
    notices: list[Notice] = field(default_factory=list)  # fields accepted as hints: told to clients that opted in

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
    attempt(_noise_reduction, upd, cfg, inp, settings.noise_reduction)
    if "turn_detection" in inp or "turn_detection" in cfg:
        td = inp["turn_detection"] if "turn_detection" in inp else cfg["turn_detection"]
        attempt(_turn_detection, upd, td, turn_detection)
    attempt(_voice, upd, cfg, out, settings, audio_started)
    for key, types, conv in (("instructions", str, str), ("model", str, str), ("temperature", (int, float), float)):
        attempt(_simple, upd, cfg, key, types, conv)
    attempt(_refusals, upd, cfg, inp, out)
    attempt(_tools, upd, cfg)
    attempt(_max_output_tokens, upd, cfg)
    attempt(_hints, upd, cfg)
    if "tracing" in cfg:  # honoured with OpenTelemetry spans (realtime/tracing_config.py)
        attempt(_tracing, upd, cfg["tracing"], settings.tracing)
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
              "truncation": "session.truncation", "noise_reduction": "session.audio.input.noise_reduction"}


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
SPECULATION_KEYS: tuple[tuple[str, type], ...] = (("speculative", bool), ("speculate_after_ms", int))


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
    keys: tuple[tuple[str, type | tuple[type, ...]], ...]  # the fields this type takes, with their JSON types
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
    for name, why in params.problems():
        raise ClientError("invalid_value", f"turn_detection.{name} {why}", p + name)
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


def _tracing(upd: SessionUpdate, value, current) -> None:
    upd.changes["tracing"] = parse_tracing(value, current)


def _input_field(cfg: dict, inp: dict, name: str) -> tuple[str, Any] | None:
    """An input audio field in its GA place (`audio.input.<name>`) or its beta one (`input_audio_<name>`),
    the GA one first: (its parameter path for errors, its value); None when neither is sent."""
    if name in inp:
        return f"session.audio.input.{name}", inp[name]
    if f"input_audio_{name}" in cfg:
        return f"session.input_audio_{name}", cfg[f"input_audio_{name}"]
    return None


def _noise_reduction(upd: SessionUpdate, cfg: dict, inp: dict, current: str | None) -> None:
    """audio.input.noise_reduction (GA) or input_audio_noise_reduction (beta): {"type": "near_field" |
    "far_field"} suppresses noise in the user's audio before the VAD and the model
    (realtime/noise_suppression.py); null turns it off. No type: the current one, else near_field.
    `strength` is each type's own: 1 (the API's default) or omitted."""
    if (found := _input_field(cfg, inp, "noise_reduction")) is None:
        return
    param, value = found
    if value is None:
        upd.changes["noise_reduction"] = None
        return
    if not isinstance(value, dict):
        raise ClientError("invalid_type", f"'{param}' must be an object or null", param)
    for key in value:
        if key not in ("type", "strength"):
            raise ClientError("unknown_parameter", f"unknown parameter '{param}.{key}'", f"{param}.{key}")
    kind = get_field(value, "type", str, prefix=param + ".") or current or "near_field"
    if kind not in NOISE_REDUCTION_TYPES:
        raise ClientError("invalid_value", f"'{param}.type' must be one of {', '.join(NOISE_REDUCTION_TYPES)} (or the "
                                           f"whole field null), got {kind!r}", param + ".type")
    if get_field(value, "strength", (int, float), prefix=param + ".") not in (None, 1):
        raise unsupported(param + ".strength", "each type has its own suppression strength: use 1 or omit it")
    upd.changes["noise_reduction"] = kind


def _refusals(upd: SessionUpdate, cfg: dict, inp: dict, out: dict) -> None:
    """GA fields asking for what OpusLM cannot do: accepted only when they ask for nothing."""
    checks = (
        ("session.type", cfg.get("type"), lambda v: v in (None, "realtime"), "only 'realtime' sessions (no transcription-only sessions)"),
        ("session.audio.output.speed", out.get("speed"), lambda v: v in (None, 1, 1.0), "the speech rate is the model's own; use 1.0"),
        ("session.speed", cfg.get("speed"), lambda v: v in (None, 1, 1.0), "the speech rate is the model's own; use 1.0"),
        # asked-for output the engine cannot give (no log probabilities), and stored prompts (their
        # instructions live on OpenAI's platform): ignoring either would give the client something else
        ("session.include", cfg.get("include"), _nothing,
         "the model reports no log probabilities, so transcripts cannot include them (use null)"),
        ("session.prompt", cfg.get("prompt"), _nothing, "no stored prompt templates here: send their text as instructions"),
    )
    for param, value, ok, why in checks:
        if not ok(value):
            upd.refused.append(unsupported(param, why))


def _nothing(v) -> bool:
    return v is None or v == [] or v == {}


def _tools(upd: SessionUpdate, cfg: dict) -> None:
    """`tools` under "auto"/"none": accepted and echoed (realtime/tools.py); a forced call: refused."""
    if "tools" in cfg:
        upd.changes["tools"] = parse_tools(cfg["tools"], "session.tools")
        if upd.changes["tools"]:
            upd.notices.append(Notice("session.tools", NO_CALLS + " (tool_choice \"auto\" allows that): the tools are "
                                                      "listed, never offered to the model"))
    if (choice := parse_tool_choice(cfg.get("tool_choice"), "session.tool_choice")) is not None:  # after: a refused choice leaves the tools
        upd.changes["tool_choice"] = choice


# One output token is one step of the model's answer: a 20 ms audio frame (OpusLM's codec runs at
# 50 Hz), or one text token of a text answer (and of the text an audio answer writes first).
TOKEN_MS = 20.0
MAX_OUTPUT_TOKENS = 4096  # OpenAI's bound on an integer max_output_tokens


def parse_max_output_tokens(value, param: str) -> int | str | None:
    """max_output_tokens: an integer in [1, 4096] or "inf" (None when not sent)."""
    if value is None or value == "inf":
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ClientError("invalid_type", f"'{param}' must be an integer or \"inf\"", param)
    if not 1 <= value <= MAX_OUTPUT_TOKENS:
        raise ClientError("invalid_value", f"'{param}' must be within [1, {MAX_OUTPUT_TOKENS}] or \"inf\", got {value}", param)
    return value


def _max_output_tokens(upd: SessionUpdate, cfg: dict) -> None:
    """GA `max_output_tokens` (beta `max_response_output_tokens`): N bounds each answer to N steps
    (N × 20 ms of audio, N text tokens); "inf": the server's `max_response_ms` alone."""
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in cfg and (v := parse_max_output_tokens(cfg[key], f"session.{key}")) is not None:
            upd.changes["max_output_tokens"] = v


REASONING_EFFORTS = ("minimal", "low", "medium", "high", "xhigh")


def _hints(upd: SessionUpdate, cfg: dict) -> None:
    """Fields that ask for nothing the client relies on here: accepted (typed), echoed as effective."""
    if "parallel_tool_calls" in cfg:  # the model makes no tool call, in parallel or not
        get_field(cfg, "parallel_tool_calls", bool, prefix="session.")
    if (reasoning := get_field(cfg, "reasoning", dict, prefix="session.")) is not None:
        effort = reasoning.get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            raise ClientError("invalid_value", f"'session.reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}",
                              "session.reasoning.effort")
        if effort is not None:  # not echoed (null): the model answers at once, whatever the effort
            upd.notices.append(Notice("session.reasoning", "OpusLM does not reason before it answers: the effort is a hint "
                                                           "with no effect"))


NO_TEXT = "the model has no text tokenizer: it hears and speaks audio only"

# AudioTranscription's hints. The model writes the user's words as it heard them (ESPnet's dialogue
# target), beside the answer: a language, prompt or keywords cannot steer it, and there is no delay to
# choose. They are hints in OpenAI's API too (the transcript is the user's words either way), so they
# are accepted, echoed as given, and told to clients that opted in as having no effect here.
_TRANSCRIPTION_HINTS = {"language": (str, "the model writes the language it hears"),
                        "prompt": (str, "the model writes what it heard, with no prompt"),
                        "delay": (str, "the transcript is written beside the answer, with no delay to choose"),
                        "keywords": (list, "the model writes what it heard, with no keywords"),
                        "languages": (list, "the model writes the language it hears")}


def _transcription(upd: SessionUpdate, cfg: dict, inp: dict, text: bool) -> None:
    """audio.input.transcription (GA) or input_audio_transcription (beta): the dialogue model itself
    writes each answered user turn's transcript; any model name is taken (and echoed), as no other
    model runs; the hints are echoed as given. null turns it off."""
    if (found := _input_field(cfg, inp, "transcription")) is None:
        return
    param, value = found
    if value is None:
        upd.changes["transcription"] = None
        return
    if not isinstance(value, dict):
        raise ClientError("invalid_type", f"'{param}' must be an object or null", param)
    if not text:
        raise unsupported(param, NO_TEXT + "; use null")
    for key in value:
        if key != "model" and key not in _TRANSCRIPTION_HINTS:
            raise ClientError("unknown_parameter", f"unknown parameter '{param}.{key}'", f"{param}.{key}")
    echo = {"model": get_field(value, "model", str, prefix=param + ".")}
    for key, (types, why) in _TRANSCRIPTION_HINTS.items():
        hint = get_field(value, key, types, prefix=param + ".")
        if isinstance(hint, list) and not all(isinstance(h, str) for h in hint):
            raise ClientError("invalid_type", f"'{param}.{key}' must be a list of strings", f"{param}.{key}")
        if key == "delay" and hint is not None and hint not in REASONING_EFFORTS:  # OpenAI's levels, as the effort's
            raise ClientError("invalid_value", f"'{param}.delay' must be one of {', '.join(REASONING_EFFORTS)}", f"{param}.delay")
        if hint not in (None, "", []):
            echo[key] = hint
            upd.notices.append(Notice(f"{param}.{key}", f"a hint with no effect here: {why}"))
    upd.changes["transcription"] = echo


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
