"""Realtime API conformance (issue 28), sans-I/O: what a strict client (the openai SDK's event models, the
Agents SDK, Pipecat, LiveKit) sees, field-by-field session.update, semantic_vad, conversation items,
response.create's fields, multipart WebRTC signalling."""

from __future__ import annotations

import base64
import json
import types
import typing

import httpx
import numpy as np
import pydantic
import pytest
from openai import BaseModel as OpenAIModel
from openai.types.realtime import RealtimeServerEvent, RealtimeSessionCreateRequest
from rt_helpers import silence
from test_protocol import Client, _vad_turn

from realtime.session import EndTurn, PushAudio, StartResponse
from realtime.session_update import EAGERNESS

SERVER_EVENT = pydantic.TypeAdapter(RealtimeServerEvent)


def _extras(model, path: str = "") -> list[str]:
    """Fields the openai SDK's models do not know, anywhere in a parsed event."""
    out = [f"{path}{k}" for k in (model.model_extra or {})] if isinstance(model, OpenAIModel) else []
    for name in getattr(type(model), "model_fields", {}):
        v = getattr(model, name)
        for sub in (v if isinstance(v, list) else [v]):
            if isinstance(sub, OpenAIModel):
                out += _extras(sub, f"{path}{name}.")
    return out


# sent by OpenAI's own server although the SDK's GA models leave them out
OPENAI_EXTRAS = {"session.id", "session.object"}


def _strict_check(events: list[dict]) -> None:
    for ev in events:
        parsed = SERVER_EVENT.validate_python(ev)  # an unknown event type fails the union
        extras = [x for x in _extras(parsed) if x not in OPENAI_EXTRAS]
        assert extras == [], (ev["type"], extras)


def test_a_standard_client_sees_only_realtime_api_events_and_fields(speech):
    c = Client(extensions=False)
    created = c.sent[0]
    assert "resume_token" not in created and "duplex" not in created["session"]
    rid = _vad_turn(c, speech)
    c.engine_chunk(rid, 400, is_last=True, text="hi")
    for _ in range(30):
        c.tick(0.04)
    kinds = c.types()
    assert "response.done" in kinds and "duplex.latency" not in kinds
    assert all("epoch" not in e for e in c.sent) and "duplex" not in c.sent[-1]["response"]
    _strict_check(c.sent)


def test_opting_in_with_duplex_in_session_update_brings_our_additions_and_the_resume_token(speech):
    c = Client(extensions=False)
    from realtime.protocol import ResumeOffer
    c.proto.resume = ResumeOffer("resume_x", 30.0)
    assert not c.proto.resumable
    c.send({"type": "session.update", "session": {"duplex": {}}})
    upd = c.sent[-1]
    assert upd["type"] == "session.updated" and upd["resume_token"] == "resume_x" and "duplex" in upd["session"]
    assert c.proto.resumable
    rid = _vad_turn(c, speech)
    c.engine_chunk(rid, 200, is_last=True)
    for _ in range(30):
        c.tick(0.04)
    assert "duplex.latency" in c.types() and c.sent[-1]["response"]["duplex"]["epoch"] == 0


def test_session_update_applies_the_valid_fields_and_names_the_refused_ones():
    c = Client(extensions=False)
    c.take()
    c.send({"type": "session.update", "event_id": "u1", "session": {
        "instructions": "be brief", "temperature": 5, "tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
        "audio": {"input": {"transcription": {"model": "whisper-1"}}, "output": {"voice": "alloy"}}}})
    errs, upd = c.errors(), c.sent[-1]
    assert len(errs) == 1 and errs[0]["event_id"] == "u1"
    for param in ("session.temperature", "session.tool_choice", "session.audio.input.transcription"):
        assert param in errs[0]["message"]
    assert upd["type"] == "session.updated"
    s = upd["session"]
    assert s["instructions"] == "be brief" and s["audio"]["output"]["voice"] == "alloy"
    assert s["tool_choice"] == "auto" and s["audio"]["input"]["transcription"] is None  # what was applied, not what was asked
    assert [t["name"] for t in s["tools"]] == ["f"]  # listed under "auto" (the refused choice leaves them)
    _strict_check(c.sent)


# Every field of the GA session object the openai SDK can send: honoured, accepted as a hint, or refused with an
# error naming it (docs/protocol.md, "Every session field": the rule and the table these rows follow).
SWEEP = [
    ({"type": "realtime"}, None),
    ({"type": "transcription"}, "session.type"),
    ({"model": "gpt-realtime"}, None),
    ({"instructions": "hi"}, None),
    ({"output_modalities": ["audio"]}, None),
    ({"output_modalities": ["text"]}, "session.output_modalities"),
    ({"audio": {"input": {"format": {"type": "audio/pcmu"}}}}, None),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format"),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, None),
    ({"audio": {"input": {"noise_reduction": {"type": "far_field"}}}}, None),
    ({"audio": {"input": {"noise_reduction": None}}}, None),
    ({"audio": {"input": {"noise_reduction": {"type": "studio"}}}}, "session.audio.input.noise_reduction.type"),
    ({"audio": {"input": {"noise_reduction": "near_field"}}}, "session.audio.input.noise_reduction"),
    ({"audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}}, "session.audio.input.transcription"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.6}}}}, None),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}}},
     "session.audio.input.turn_detection.idle_timeout_ms"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}}}}, None),
    ({"audio": {"input": {"turn_detection": None}}}, None),
    ({"audio": {"output": {"format": {"type": "audio/pcma"}}}}, None),
    ({"audio": {"output": {"voice": "marin"}}}, None),
    ({"audio": {"output": {"speed": 1.0}}}, None),
    ({"audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
    ({"include": ["item.input_audio_transcription.logprobs"]}, "session.include"),
    ({"max_output_tokens": "inf"}, None),
    ({"max_output_tokens": 200}, None),
    ({"max_output_tokens": 0}, "session.max_output_tokens"),
    ({"max_output_tokens": 5000}, "session.max_output_tokens"),
    ({"max_output_tokens": "lots"}, "session.max_output_tokens"),
    ({"prompt": {"id": "pmpt_1"}}, "session.prompt"),
    ({"tool_choice": "auto"}, None),
    ({"tool_choice": "required"}, "session.tool_choice"),
    ({"tools": []}, None),
    ({"tools": [{"type": "function", "name": "f", "description": "d", "parameters": {}}]}, None),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}, None),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "session.tools[0].type"),
    ({"tools": [{"type": "function"}]}, "session.tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "strict": True}]}, "session.tools[0].strict"),
    ({"tracing": None}, None),
    ({"tracing": "auto"}, None),
    ({"tracing": {"workflow_name": "w", "group_id": "g", "metadata": {"k": "v"}}}, None),
    ({"tracing": {"workflow_name": 5}}, "session.tracing.workflow_name"),
    ({"truncation": "auto"}, None),
    ({"truncation": "disabled"}, None),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 0.5}}, None),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 1.5}}, "session.truncation.retention_ratio"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 100}}},
     "session.truncation.token_limits"),
    ({"truncation": "sometimes"}, "session.truncation"),
    ({"parallel_tool_calls": False}, None),
    ({"parallel_tool_calls": "yes"}, "session.parallel_tool_calls"),
    ({"reasoning": {"effort": "low"}}, None),
    ({"reasoning": {"effort": "huge"}}, "session.reasoning.effort"),
    ({"temperature": 0.7}, None),
    ({"no_such_field": 1}, "session.no_such_field"),
    # the rest of the GA schema's leaves (test_the_sweep_covers_the_sdks_whole_session_schema)
    ({"audio": {"input": {"noise_reduction": {"type": "near_field", "strength": 1.0}}}}, None),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field", "strength": 0.5}}}}, "session.audio.input.noise_reduction.strength"),
    ({"audio": {"input": {"transcription": {"model": "whisper-1", "language": "en", "prompt": "names"}}}},
     "session.audio.input.transcription"),
    ({"audio": {"input": {"transcription": {"model": "gpt-realtime-whisper", "delay": 1, "keywords": ["a"], "languages": ["en"]}}}},
     "session.audio.input.transcription"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "create_response": False, "interrupt_response": False,
                                             "prefix_padding_ms": 200, "silence_duration_ms": 600}}}}, None),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "silence_duration_ms": -5}}}},
     "session.audio.input.turn_detection.silence_duration_ms"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}}}}, None),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.output.format"),
    ({"audio": {"output": {"voice": {"id": "voice_custom"}}}}, "session.audio.output.voice"),
    ({"tool_choice": {"type": "function", "name": "f"}}, "session.tool_choice"),
    ({"tool_choice": {"type": "mcp", "server_label": "x"}}, "session.tool_choice"),
]
# subtrees whose leaves need no row each: a list of tools (checked in tools.py), refused whole (prompt) or a list of names (include)
SWEEP_WHOLE = ("tools", "prompt", "include")


def _model_types(annotation) -> list[type]:
    """The pydantic models an annotation allows (through Optional, Union, Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _model_types(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _model_types(a)]
    return [annotation] if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel) else []


def _schema_paths(model, prefix: str = "") -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        paths.add(prefix + name)
        if name not in SWEEP_WHOLE:
            for sub in _model_types(field.annotation):
                paths |= _schema_paths(sub, f"{prefix}{name}.")
    return paths


def _sent_paths(fields: dict, prefix: str = "") -> set[str]:
    return {p for k, v in fields.items() for p in {prefix + k} | (_sent_paths(v, f"{prefix}{k}.") if isinstance(v, dict) else set())}


def test_the_sweep_covers_the_sdks_whole_session_schema():
    """Every field the official SDK's GA session model can send (every variant of every union) is in
    the sweep below, so a field added to the schema is not silently echoed without a decision."""
    swept = set().union(*(_sent_paths(fields) for fields, _ in SWEEP))
    assert _schema_paths(RealtimeSessionCreateRequest) - swept == set()


@pytest.mark.parametrize("fields,refused", SWEEP, ids=[json.dumps(f)[:60] for f, _ in SWEEP])
def test_every_ga_session_field_is_honoured_or_refused_by_name(fields, refused):
    c = Client(extensions=False)
    c.take()
    c.send({"type": "session.update", "session": {"type": "realtime", **fields} if "type" not in fields else fields})
    errs = c.errors()
    assert c.sent[-1]["type"] == "session.updated"
    if refused is None:
        assert errs == []
    else:
        # the param names the field exactly; the message at least by its name
        assert len(errs) == 1 and errs[0]["param"] == refused and refused.rsplit(".", 1)[-1] in errs[0]["message"]
    _strict_check(c.sent)


def test_max_output_tokens_is_echoed_as_the_bound_in_force():
    c = Client(extensions=False)
    default_ms = c.proto.settings.max_response_ms
    c.send({"type": "session.update", "session": {"max_response_output_tokens": 25}})  # beta's spelling
    assert c.sent[-1]["session"]["max_output_tokens"] == 25
    assert (c.proto.engine_options().max_response_ms, c.proto.engine_options().max_text_tokens) == (500.0, 25)
    c.send({"type": "session.update", "session": {"max_output_tokens": 4096}})  # beyond the server's max_response_ms
    assert c.sent[-1]["session"]["max_output_tokens"] == int(default_ms // 20)
    assert c.proto.engine_options().max_response_ms == default_ms
    c.send({"type": "session.update", "session": {"max_output_tokens": "inf"}})
    assert c.sent[-1]["session"]["max_output_tokens"] == "inf" and c.proto.engine_options().max_response_ms == default_ms
    assert c.errors() == []
    _strict_check(c.sent)


@pytest.mark.parametrize("eagerness", ["low", "medium", "high", "auto"])
def test_semantic_vad_is_served_by_the_server_vad_and_echoed_as_asked(eagerness):
    c = Client(extensions=False)
    c.send({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
        "type": "semantic_vad", "eagerness": eagerness, "interrupt_response": True}}}}})
    td = c.sent[-1]["session"]["audio"]["input"]["turn_detection"]
    assert td == {"type": "semantic_vad", "eagerness": eagerness, "create_response": True, "interrupt_response": True}
    silence_ms, threshold = EAGERNESS[eagerness]
    assert (c.session.vad_params.silence_duration_ms, c.session.vad_params.threshold) == (silence_ms, threshold)
    assert EAGERNESS["low"][0] > EAGERNESS["medium"][0] > EAGERNESS["high"][0]


def _pcm24_b64(ms: int) -> str:
    pcm = (3000 * np.sin(np.arange(24 * ms) / 7)).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


def test_conversation_items_text_system_and_user_audio():
    c = Client(vad=None, extensions=False)
    c.take()
    c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "system",
                                                         "content": [{"type": "input_text", "text": "You are terse."}]}})
    assert c.types() == ["conversation.item.added", "conversation.item.done"]
    assert c.proto.take_engine_options().system_prompt == "You are terse."  # system messages become instructions
    c.send({"type": "conversation.item.create", "item": {"id": "t1", "type": "message", "role": "user",
                                                         "content": [{"type": "input_text", "text": "hello"}]}})
    # a typed turn, and this model reads no text: refused by name, not kept as if the model had read it
    assert c.errors()[-1]["param"] == "item.content[0].type" and "text tokenizer" in c.errors()[-1]["message"]
    assert not c.commands
    c.send({"type": "conversation.item.create", "item": {"id": "t1", "type": "message", "role": "assistant",
                                                         "content": [{"type": "output_text", "text": "hello"}]}})
    assert c.sent[-1]["item"]["content"] == [{"type": "output_text", "text": "hello"}] and not c.commands
    c.send({"type": "conversation.item.create", "item": {"id": "a1", "type": "message", "role": "user",
                                                         "content": [{"type": "input_audio", "audio": _pcm24_b64(400)}]}})
    pushed = [x for x in c.commands if isinstance(x, PushAudio)]
    assert len(pushed) == 1 and pushed[0].pcm.size == pytest.approx(16 * 400, abs=32)
    assert [type(x) for x in c.commands] == [PushAudio, EndTurn] and not any(isinstance(x, StartResponse) for x in c.commands)
    assert c.sent[-1]["type"] == "conversation.item.done" and c.sent[-1]["item"]["id"] == "a1"
    c.send({"type": "conversation.item.retrieve", "item_id": "t1"})
    assert c.sent[-1]["type"] == "conversation.item.retrieved" and c.sent[-1]["item"]["id"] == "t1"
    c.send({"type": "conversation.item.delete", "item_id": "t1"})
    assert c.sent[-1] == {**c.sent[-1], "type": "conversation.item.deleted", "item_id": "t1"}
    c.send({"type": "conversation.item.delete", "item_id": "a1"})
    assert c.errors()[-1]["code"] == "item_not_deletable"
    c.send({"type": "conversation.item.retrieve", "item_id": "nope"})
    assert c.errors()[-1]["code"] == "item_retrieve_invalid_item_id"  # OpenAI's codes, which Pipecat matches on
    c.send({"type": "conversation.item.delete", "item_id": "nope"})
    assert c.errors()[-1]["code"] == "item_delete_invalid_item_id"
    c.send({"type": "conversation.item.create", "item": {"id": "a1", "type": "message", "role": "system",
                                                         "content": [{"type": "input_text", "text": "x"}]}})
    assert c.errors()[-1]["code"] == "item_create_duplicate_item_id"  # LiveKit takes this one as "already there"
    assert "unknown_event_type" not in [e["code"] for e in c.errors()]
    _strict_check(c.sent)


def test_function_call_items_are_kept_and_echoed_as_openai_does_never_given_to_the_model():
    c = Client(vad=None, extensions=False)
    c.take()
    n_errors = len(c.errors())
    c.send({"type": "conversation.item.create", "item": {"id": "fc1", "type": "function_call", "call_id": "call_1",
                                                         "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}})
    c.send({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "call_1",
                                                         "output": "{\"temp_c\": 21}"}})
    assert len(c.errors()) == n_errors
    added = [e["item"] for e in c.sent if e["type"] == "conversation.item.added"]
    assert added[0] == {"id": "fc1", "object": "realtime.item", "type": "function_call", "status": "completed",
                        "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}
    out = added[1]
    assert (out["type"], out["call_id"], out["output"], out["object"]) == ("function_call_output", "call_1", "{\"temp_c\": 21}", "realtime.item")
    assert c.commands == []  # the engine hears nothing of them
    assert c.proto.take_engine_options() is None  # nor do they change its system text
    c.send({"type": "conversation.item.retrieve", "item_id": out["id"]})
    assert c.sent[-1]["type"] == "conversation.item.retrieved" and c.sent[-1]["item"] == out
    c.send({"type": "conversation.item.delete", "item_id": "fc1"})
    assert c.sent[-1]["type"] == "conversation.item.deleted" and c.sent[-1]["item_id"] == "fc1"
    for bad, param in (({"type": "function_call_output", "output": "x"}, "item.call_id"),
                       ({"type": "function_call", "name": "f"}, "item.arguments"),
                       ({"type": "function_call_output", "call_id": "c", "output": 5}, "item.output"),
                       ({"type": "mcp_call"}, "item.type")):
        c.send({"type": "conversation.item.create", "item": bad})
        assert c.errors()[-1]["param"] == param
    _strict_check(c.sent)


def test_response_create_echoes_metadata_and_refuses_what_it_cannot_honour():
    c = Client(vad=None, extensions=False)
    c.append_pcm24(silence(200, 24_000) + 1000)
    c.send({"type": "input_audio_buffer.commit"})
    c.take()
    for response, param in ((({"conversation": "none"}), "response.conversation"), ({"tool_choice": "required"}, "response.tool_choice"),
                            ({"tool_choice": {"type": "function", "name": "f"}}, "response.tool_choice"),
                            ({"max_output_tokens": 0}, "response.max_output_tokens"), ({"prompt": {"id": "p"}}, "response.prompt"),
                            ({"output_modalities": ["text"]}, "response.output_modalities")):
        c.send({"type": "response.create", "response": response})
        assert c.errors()[-1]["param"] == param
    assert "response.created" not in c.types()
    c.send({"type": "response.create", "response": {"metadata": {"client_event_id": "r1"}, "output_modalities": ["audio"]}})
    created = next(e for e in c.sent if e["type"] == "response.created")
    assert created["response"]["metadata"] == {"client_event_id": "r1"}
    c.engine_chunk(created["response"]["id"], 200, is_last=True)
    for _ in range(30):
        c.tick(0.04)
    assert c.sent[-1]["type"] == "response.done" and c.sent[-1]["response"]["metadata"] == {"client_event_id": "r1"}
    _strict_check(c.sent)


def test_multipart_offer_as_the_openai_sdk_sends_it():
    """The SDK posts files=[("sdp", (None, sdp, "application/sdp")), ("session", (None, json, "application/json"))]:
    the gateway's form reader (aiohttp's parser, realtime/http_body.py) hands the route exactly those fields."""
    import asyncio

    from fake_engine import FakeEngine
    from rt_helpers import fake_gateway

    from realtime.http import HttpReply, HttpRoute, Scope

    seen: list[dict[str, bytes]] = []

    async def echo(req):
        seen.append(await req.form())
        return HttpReply(200, "{}", "application/json")

    async def main():
        async with fake_gateway(FakeEngine()) as gw:
            gw.routes.http["/test/form"] = HttpRoute(echo, scope=Scope.PUBLIC)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as http:
                r = await http.post("/test/form", files={"sdp": (None, b"v=0\r\nm=audio 9", "application/sdp"),
                                                         "session": (None, b'{"type":"realtime"}', "application/json")})
                assert r.status_code == 200, r.text

    asyncio.run(main())
    assert seen == [{"sdp": b"v=0\r\nm=audio 9", "session": b'{"type":"realtime"}'}]


# With a model that reads and writes text: these fields are honoured (and their refusals still named).
TEXT_SWEEP = [
    ({"audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}}}, None),
    # hints: accepted, echoed (the model writes what it heard either way)
    ({"audio": {"input": {"transcription": {"model": "whisper-1", "language": "en", "prompt": "names"}}}}, None),
    ({"audio": {"input": {"transcription": {"model": "gpt-realtime-whisper", "delay": "low"}}}}, None),
    ({"audio": {"input": {"transcription": {"model": "gpt-transcribe", "keywords": ["a"]}}}}, None),
    ({"audio": {"input": {"transcription": {"model": "gpt-transcribe", "languages": ["en"]}}}}, None),
    ({"audio": {"input": {"transcription": {"model": "gpt-realtime-whisper", "delay": "soon"}}}},
     "session.audio.input.transcription.delay"),
    ({"audio": {"input": {"transcription": {"model": "gpt-transcribe", "keywords": [1]}}}},
     "session.audio.input.transcription.keywords"),
    ({"audio": {"input": {"transcription": {"model": "gpt-transcribe", "language": 5}}}},
     "session.audio.input.transcription.language"),
    ({"output_modalities": ["text"]}, None),
    ({"output_modalities": ["audio", "text"]}, "session.output_modalities"),
    ({"output_modalities": []}, "session.output_modalities"),
]


@pytest.mark.parametrize("fields,refused", TEXT_SWEEP, ids=[json.dumps(f)[:60] for f, _ in TEXT_SWEEP])
def test_text_fields_with_a_text_model_are_honoured_or_refused_by_name(fields, refused):
    c = Client(extensions=False, text_model=True)
    c.take()
    c.send({"type": "session.update", "session": {"type": "realtime", **fields}})
    errs = c.errors()
    assert c.sent[-1]["type"] == "session.updated"
    assert (errs == []) if refused is None else (len(errs) == 1 and errs[0]["param"] == refused)
    _strict_check(c.sent)


def test_transcription_and_text_answers_are_the_sdks_event_shapes():
    c = Client(vad=None, extensions=False, text_model=True)
    c.send({"type": "session.update", "session": {"type": "realtime", "output_modalities": ["text"],
                                                  "audio": {"input": {"transcription": {"model": "whisper-1"}}}}})
    assert c.proto.take_engine_options().transcribe_user
    c.append_pcm24(silence(200, 24_000) + 1000)
    c.send({"type": "input_audio_buffer.commit"})
    c.send({"type": "response.create"})
    rid = next(e for e in c.sent if e["type"] == "response.created")["response"]["id"]
    item = next(e for e in c.sent if e["type"] == "input_audio_buffer.committed")["item_id"]
    c.session.receive_user_transcript(rid, "hello")
    c.session.receive_engine_chunk(rid, np.zeros(0, np.int16), "Hi there.", False, None, c.now)
    c.session.receive_user_transcript_end(rid)
    c.session.receive_engine_chunk(rid, np.zeros(0, np.int16), "", True, None, c.now)
    for _ in range(5):
        c.tick(0.04)
    c.send({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                         "content": [{"type": "input_text", "text": "And you?"}]}})
    c.append_pcm24(silence(200, 24_000) + 1000)
    c.send({"type": "input_audio_buffer.commit"})  # the turn: typed text, then audio (whose item gets its transcript)
    c.send({"type": "response.create", "response": {"output_modalities": ["audio"]}})
    rid2 = [e for e in c.sent if e["type"] == "response.created"][-1]["response"]["id"]
    c.engine_chunk(rid2, 200, is_last=True)
    for _ in range(10):
        c.tick(0.04)
    kinds = c.types()
    for kind in ("conversation.item.input_audio_transcription.delta", "conversation.item.input_audio_transcription.completed",
                 "response.output_text.delta", "response.output_text.done"):
        assert kind in kinds
    done = [e for e in c.sent if e["type"] == "conversation.item.input_audio_transcription.completed"][0]
    assert (done["item_id"], done["transcript"]) == (item, "hello")
    assert [e["response"]["output_modalities"] for e in c.sent if e["type"] == "response.done"] == [["text"], ["audio"]]
    assert c.errors() == []
    _strict_check(c.sent)
    # a failed one too
    c.session.receive_user_transcript_end(rid2, "engine_error", "the transcript failed")
    c.tick(0)
    failed = c.sent[-1]
    item2 = [e for e in c.sent if e["type"] == "input_audio_buffer.committed"][-1]["item_id"]
    assert failed["type"] == "conversation.item.input_audio_transcription.failed" and failed["item_id"] == item2
    assert c.errors() == []
    _strict_check(c.sent)
