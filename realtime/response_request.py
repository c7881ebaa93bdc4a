"""`response.create`'s `response` object: what this server can honour per response.

The engine answers within the conversation with the session's settings; so a request for anything
else (out-of-band answers, a forced tool call, a per-response voice) is refused whole with an `error`
naming the field, rather than answered as if it had been honoured. `output_modalities` is honoured
per response (["text"]: a text-only answer, with a model that has text), and so are `instructions`
(the system text the model reads for that answer alone: docs/protocol.md, "Per-response
instructions"), and `max_output_tokens` (that answer's bound, as the session's). Function tools under
"auto"/"none" are accepted (OpusLM calls none, realtime/tools.py). `metadata` is the client's tag of the
response, echoed in response.created / response.done.
"""

from __future__ import annotations

from dataclasses import dataclass

from realtime.session_update import REASONING_EFFORTS, parse_max_output_tokens, parse_modalities
from realtime.tools import NO_CALLS, parse_tool_choice, parse_tools
from realtime.wire_fields import ClientError, Notice, get_field, unsupported

MAX_METADATA_KEYS = 16  # OpenAI's limits on response metadata
MAX_METADATA_VALUE = 512

_KNOWN = {"conversation", "metadata", "instructions", "output_modalities", "modalities", "tools", "tool_choice", "input",
          "audio", "voice", "output_audio_format", "max_output_tokens", "max_response_output_tokens", "temperature", "prompt",
          "parallel_tool_calls", "reasoning"}


@dataclass(frozen=True)
class ResponseRequest:
    metadata: dict | None = None
    output_modalities: tuple[str, ...] | None = None  # as asked; None: the session's
    instructions: str | None = None  # this answer's own (docs/protocol.md, "Per-response instructions"); None: the session's
    max_output_tokens: int | str | None = None  # this answer's bound in steps (N × 20 ms, N text tokens); None: the session's
    tools: tuple[dict, ...] = ()  # offered for this answer: accepted under "auto"/"none" (realtime/tools.py), never called
    notices: tuple[Notice, ...] = ()  # fields taken as hints: duplex.notice for clients that opted in


def parse_response_request(resp: dict | None, instructions: str, voice: str, temperature: float, text: bool = False) -> ResponseRequest:
    """`instructions`, `voice`, `temperature`: the session's (a per-response value equal to them is accepted;
    other instructions are this answer's own: `ResponseRequest.instructions`);
    `text`: the model reads and writes text (a text-only answer can be asked for)."""
    if resp is None:
        return ResponseRequest()
    p = "response."
    for key in resp:
        if key not in _KNOWN:
            raise ClientError("unknown_parameter", f"unknown parameter 'response.{key}'", p + key)
    if resp.get("conversation") not in (None, "auto", "default"):
        raise unsupported(p + "conversation", "out-of-band responses: the model answers within the conversation ('auto')")
    modalities = None
    for key in ("output_modalities", "modalities"):
        if resp.get(key) is not None:
            modalities = parse_modalities(resp[key], p + key, beta=key == "modalities", text=text)
    tools = parse_tools(resp.get("tools"), p + "tools")
    parse_tool_choice(resp.get("tool_choice"), p + "tool_choice")
    get_field(resp, "parallel_tool_calls", bool, prefix=p)  # no tool calls, in parallel or not
    notices = [Notice(p + "tools", NO_CALLS + ": the tools are listed, never offered to the model")] if tools else []
    if (effort := (get_field(resp, "reasoning", dict, prefix=p) or {}).get("effort")) is not None:
        if effort not in REASONING_EFFORTS:
            raise ClientError("invalid_value", f"'response.reasoning.effort' must be one of {', '.join(REASONING_EFFORTS)}",
                              p + "reasoning.effort")
        notices.append(Notice(p + "reasoning", "OpusLM does not reason before it answers: the effort is a hint with no effect"))
    if resp.get("input") is not None:
        raise unsupported(p + "input", "the model answers from the whole conversation, not a chosen context")
    if resp.get("prompt") is not None:
        raise unsupported(p + "prompt", "no stored prompt templates here: send their text as instructions")
    max_tokens = None
    for key in ("max_output_tokens", "max_response_output_tokens"):
        if key in resp and (v := parse_max_output_tokens(resp[key], p + key)) is not None:
            max_tokens = v
    if (instr := get_field(resp, "instructions", str, prefix=p)) == instructions:
        instr = None  # the session's own: the answer reads them as any other (and its prompt is in the cache)
    audio_out = (get_field(resp, "audio", dict, prefix=p) or {}).get("output") or {}
    asked_voice = audio_out.get("voice", resp.get("voice"))
    if asked_voice is not None and asked_voice != voice:
        raise unsupported(p + "audio.output.voice", "the voice is per session here: send it with session.update")
    if audio_out.get("format") is not None or resp.get("output_audio_format") is not None:
        raise unsupported(p + "audio.output.format", "the output format is per session here: send it with session.update")
    if (t := get_field(resp, "temperature", (int, float), prefix=p)) is not None and t != temperature:
        raise unsupported(p + "temperature", "sampling settings are per session here: send them with session.update")
    return ResponseRequest(_metadata(get_field(resp, "metadata", dict, prefix=p)), modalities, instr, max_tokens, tools,
                           tuple(notices))


def _metadata(md: dict | None) -> dict | None:
    if md is None:
        return None
    if len(md) > MAX_METADATA_KEYS or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE
                                               for k, v in md.items()):
        raise ClientError("invalid_value", f"'response.metadata': at most {MAX_METADATA_KEYS} string keys (64 chars) "
                                           f"with string values ({MAX_METADATA_VALUE} chars)", "response.metadata")
    return dict(md)
