"""Stock voice-agent clients, unchanged and on their own defaults, against a real Gateway on 127.0.0.1
(issues 28 and 36).

Each test drives a stock OpenAI Realtime client the way its documentation, quickstart or example does,
with no setting changed to suit this server (the Python ones are pinned in the `test` extra, see
pyproject.toml; the JavaScript one in tests/js, installed by scripts/install.sh), and holds two turns
with a barge-in: a question answered in full, a second question whose answer the user interrupts by
speaking again, and the answer to that interruption. The clients send what they send by default
(tracing "auto", input transcription, semantic_vad, noise reduction, function tools with
tool_choice "auto", per-response instructions...), and the server must answer none of it with an error.

Counted as errors: every `error` event the server sent (read where the client parses the wire), the
client's own error events, and its loggers at ERROR; a JavaScript client has no error listener, so an
error crashes it. All run in front of the fake engine (tests/realtime/fake_engine.py: answers of a known
length, so the history is checked frame for frame); the two Agents SDKs (JavaScript, Python) and LiveKit
(its greeting's per-response instructions reach the model) also in front of the real engine (the tiny
model on vLLM, what `duplex serve` runs by default), started once for the module. The gateway, its VAD
and the wire protocol are real; speech is espeak-ng's.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine
from rt_helpers import running_gateway

from realtime.config import config_from_dict
from realtime.server import Gateway

TOKEN = "framework-token"
RATE = 24000  # the Realtime API's pcm16
CHUNK_MS = 100
FAKE_ANSWER_MS = 1200
ENGINE_MAX_ANSWER_MS = 3000  # long enough to speak over on this CPU, short enough to keep the test quick
QUESTIONS = ("Hello, how are you today?", "What is the weather like?", "Wait, stop, tell me something else.")
TIMEOUT_S = 120
JS_DIR = Path(__file__).resolve().parents[1] / "js"  # tests/js: package.json, package-lock.json, the scripts
# OpenAI answers a response.cancel that finds nothing running with this error; LiveKit's AgentSession
# cancels on every barge-in, races the server's own cancel, and ignores exactly this message.
CANCEL_RACE = ("response_cancel_not_active", "Cancellation failed: no active response found")

# the fake engine only: these clients add nothing on the real engine that the others do not cover
# (their differences are on the wire), and the real engine's turns cost the suite ~12 s each
fake_engine_only = pytest.mark.parametrize("served", ["fake_engine"], indirect=True)


@dataclasses.dataclass
class Served:
    """A gateway on the shared loop thread; the length of a whole answer in frames when it is known
    (the fake engine's: the tiny model ends an answer at EOS or at its cap), and the cap."""

    gw: Gateway
    full_frames: int | None
    max_frames: int

    @property
    def port(self) -> int:
        return self.gw.port


@pytest.fixture(scope="module", params=["fake_engine", pytest.param("engine", marks=pytest.mark.vllm)])
def served(request, loop_thread) -> Iterator[Served]:
    if request.param == "fake_engine":
        gw = Gateway(FakeEngine(capacity=2, answer_ms=FAKE_ANSWER_MS), config_from_dict({"server": {"port": 0}}), token=TOKEN)
        loop_thread.run(gw.start())
        try:
            yield Served(gw, FAKE_ANSWER_MS // 20, FAKE_ANSWER_MS // 20)
        finally:
            loop_thread.run(gw.stop())
        return
    with running_gateway(loop_thread, request.getfixturevalue("tiny_model"), 2, {
        "server": {"token": TOKEN},
        "session": {"max_response_ms": ENGINE_MAX_ANSWER_MS, "temperature": 0.0},
    }) as gw:
        yield Served(gw, None, ENGINE_MAX_ANSWER_MS // 20)


def utterances(speech) -> list[bytes]:
    """Each question, then 0.8 s of silence (the server VAD's pause), as 24 kHz pcm16."""
    pause = np.zeros(int(RATE * 0.8), np.int16)
    return [np.concatenate([speech(q, RATE), pause]).astype("<i2").tobytes() for q in QUESTIONS]


async def stream(send, pcm: bytes) -> None:
    """A microphone at twice real time (within the gateway's input budget): `send(chunk)` per 100 ms."""
    step = RATE * 2 * CHUNK_MS // 1000
    for i in range(0, len(pcm), step):
        await send(pcm[i:i + step])
        await asyncio.sleep(CHUNK_MS / 2000)


class ErrorLogs(logging.Handler):
    """Records at ERROR or above from the named loggers (the framework's own)."""

    def __init__(self, *names: str) -> None:
        super().__init__(logging.ERROR)
        self.names, self.records = names, []

    def __enter__(self) -> ErrorLogs:
        for n in self.names:
            logging.getLogger(n).addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for n in self.names:
            logging.getLogger(n).removeHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(f"{record.name}: {record.getMessage()}")


class Heard:
    """The server events a client received, as (type, response status), with a wait:
    `await heard.until("response.done", 2)` returns once the second one came (and fails on the first
    error event not `allowed`). Also the `error` events' payloads, the last session.updated's session,
    the engine conversation behind the session, and per answer when its first audio arrived and how
    much came."""

    def __init__(self, served: Served, allowed: tuple[tuple[str, str], ...] = ()) -> None:
        self.served = served
        self.allowed = allowed  # (code, message) of error events that are part of the client's normal life
        self.events: list[tuple[str, str | None]] = []
        self.errors: list[dict] = []
        self.session: dict = {}
        self.audio_at: list[float] = []
        self.audio_ms: list[float] = []
        self.conv = None  # taken at session.created: the gateway forgets it when the session ends
        self._changed = asyncio.Event()

    def add(self, data: dict) -> None:
        kind = data["type"]
        if kind == "session.created":
            self.conv = self.served.gw.conversation(data["session"]["id"])
        elif kind == "session.updated":
            self.session = data["session"]
        elif kind == "error":
            self.errors.append(data["error"])
        elif kind == "response.output_audio.delta":
            if len(self.audio_at) < self.count("response.created"):
                self.audio_at.append(time.monotonic())
                self.audio_ms.append(0.0)
            self.audio_ms[-1] += len(base64.b64decode(data["delta"])) / (2 * RATE / 1000)
        self.events.append((kind, data.get("response", {}).get("status")))
        self._changed.set()

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.events)

    def unexpected_errors(self) -> list[dict]:
        return [e for e in self.errors if (e.get("code"), e.get("message")) not in self.allowed]

    async def until(self, kind: str, n: int) -> None:
        """Fails at once on an error event: a client that stops on one would leave the wait hanging."""
        while self.count(kind) < n:
            assert self.unexpected_errors() == [], f"error events from the server while waiting for {kind}"
            self._changed.clear()
            await self._changed.wait()

    async def heard_to_the_end(self, answer: int) -> None:
        """A listener speaks again only once an answer has played: its audio's length from its first
        audio (the server sends audio a little ahead of real time, so response.done comes earlier)."""
        await asyncio.sleep(max(0.0, self.audio_at[answer] + self.audio_ms[answer] / 1000 + 0.1 - time.monotonic()))

    def tools_offered(self) -> list[str]:
        """The function tools the session holds, as the server echoed them in session.updated."""
        return [t.get("name") for t in self.session.get("tools") or []]

    def held_two_turns_and_a_barge_in(self, preamble: int = 0) -> None:
        """What the client received and what the engine kept: answer 1 whole, answer 2 cut where the
        user spoke, answer 3 whole, after `preamble` answers asked for without speech (a greeting)."""
        kinds = [k for k, _ in self.events]
        assert [status for kind, status in self.events if kind == "response.done"] == ["completed"] * preamble + [
            "completed", "cancelled", "completed"], kinds
        assert kinds.count("input_audio_buffer.speech_started") == 3
        # the barge-in: speech_started before the interrupted answer's response.done (OpenAI's order)
        answer1_done, answer2_done = [i for i, k in enumerate(kinds) if k == "response.done"][preamble:preamble + 2]
        assert answer1_done < kinds.index("input_audio_buffer.speech_started", answer1_done + 1) < answer2_done
        turns = [(t.role.name.lower(), t.audio_frames) for t in self.conv.history]
        # before the spoken turns: the preamble's answers (each after a user turn, or none: a greeting)
        assert [role for role, _ in turns].count("assistant") == preamble + 3, turns
        assert [role for role, _ in turns[-6:]] == ["user", "assistant"] * 3, turns
        a1, a2, a3 = (frames for _, frames in turns[-6:][1::2])
        # a whole answer is kept whole: the fake engine's length, or all the audio the client received
        whole = [self.served.full_frames] * 2 if self.served.full_frames else [
            round(self.audio_ms[preamble + k] / 20) for k in (0, 2)]
        assert [a1, a3] == whole and 0 < a2 < self.served.max_frames, (turns, whole)


# ---------------------------------------------------------------- OpenAI Agents SDK for JavaScript


def test_openai_agents_sdk_for_javascript_on_its_defaults_two_turns_and_a_barge_in(served, speech, tmp_path):
    """`@openai/agents-realtime` 0.20.0 in Node (tests/js/agents_realtime_two_turns.mjs): a
    `RealtimeSession` with no options (in Node: the WebSocket transport; semantic_vad, transcription,
    tracing "auto") and an agent with one function tool, and no 'error' listener: an error event from
    the server would crash it (Node throws an unhandled 'error'). The script prints each server event
    as it arrives (read here while the session lives) and a summary, and exits 0 only when the
    conversation went as planned with no server error and nothing logged at error."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed (Node 20+; scripts/install.sh --system); needed for the JavaScript client")
    assert (JS_DIR / "node_modules" / "@openai" / "agents-realtime").is_dir(), \
        "tests/js is not installed: run scripts/install.sh (it runs `npm ci` in tests/js)"
    paths = []
    for i, pcm in enumerate(utterances(speech)):
        paths.append(tmp_path / f"q{i + 1}.pcm")
        paths[-1].write_bytes(pcm)
    heard = Heard(served)

    async def main() -> tuple[int, dict, str]:
        proc = await asyncio.create_subprocess_exec(
            node, str(JS_DIR / "agents_realtime_two_turns.mjs"), f"ws://127.0.0.1:{served.port}/v1/realtime", TOKEN,
            *map(str, paths), cwd=JS_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, limit=1 << 24,
            env={"PATH": str(Path(node).parent), "DUPLEX_JS_TIMEOUT_MS": str(1000 * (TIMEOUT_S - 10))})
        stderr = asyncio.create_task(proc.stderr.read())
        summary: dict = {}
        try:
            async for line in proc.stdout:
                msg = json.loads(line)
                if "event" in msg:
                    heard.add(msg["event"])
                else:
                    summary = msg["summary"]
            return await proc.wait(), summary, (await stderr).decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    rc, summary, stderr = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert rc == 0 and summary, (rc, summary, stderr[-4000:])
    assert summary["transport"] == "OpenAIRealtimeWebSocket"
    assert summary["server_errors"] == [] and summary["error_logs"] == [] and heard.errors == []
    assert summary["response_done"] == ["completed", "cancelled", "completed"] and summary["audio_interrupted"] >= 1
    assert heard.tools_offered() == ["get_weather"] and heard.session["tracing"] == "auto"  # the SDK's defaults, echoed
    heard.held_two_turns_and_a_barge_in()


# ---------------------------------------------------------------- OpenAI Agents SDK for Python


def test_openai_agents_sdk_realtime_runner_on_its_defaults_two_turns_and_a_barge_in(served, speech):
    """`agents.realtime`: RealtimeAgent with one function tool + RealtimeRunner with no config: its
    default session (semantic_vad, interrupt_response, transcription, tracing "auto")."""
    from agents import function_tool
    from agents.realtime import RealtimeAgent, RealtimeRunner

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is sunny in {city}."

    q1, q2, q3 = utterances(speech)

    async def main():
        runner = RealtimeRunner(RealtimeAgent(name="assistant", instructions="Be brief.", tools=[get_weather]))
        session = await runner.run(model_config={"api_key": TOKEN, "url": f"ws://127.0.0.1:{served.port}/v1/realtime"})
        errors, heard = [], Heard(served)  # the SDK's error events; the server events it received
        with ErrorLogs("openai.agents") as logs:
            async with session:
                events = aiter(session)

                async def until(kind: str):
                    async for ev in events:
                        assert heard.errors == [], f"error events from the server while waiting for {kind}"
                        if ev.type == "error":
                            errors.append(ev.error)
                        elif ev.type == "raw_model_event" and ev.data.type == "raw_server_event":
                            heard.add(ev.data.data)
                        elif ev.type == "raw_model_event" and ev.data.type in ("error", "exception"):
                            errors.append(ev.data)
                        if ev.type == kind:
                            return ev
                    raise AssertionError(f"the session ended before {kind}")

                async def send(chunk: bytes) -> None:
                    await session.send_audio(chunk)

                await stream(send, q1)
                await until("audio_end")  # answer 1, complete
                await until("agent_end")
                await heard.heard_to_the_end(0)
                await stream(send, q2)
                await until("audio")  # answer 2 is playing: speak over it
                barge = asyncio.create_task(stream(send, q3))
                await until("audio_interrupted")
                await barge
                await until("audio_end")  # the answer to the interruption, complete
                await until("agent_end")
        assert heard.errors == [] and errors == [] and logs.records == []
        assert heard.tools_offered() == ["get_weather"] and heard.session["tracing"] == "auto"  # the SDK's defaults, echoed
        heard.held_two_turns_and_a_barge_in()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


# ---------------------------------------------------------------- the openai SDK


@fake_engine_only
def test_the_openai_sdk_with_a_typical_apps_session_two_turns_and_a_barge_in(served, speech):
    """The official openai SDK's realtime client with the `session.update` a typical voice app sends
    (instructions, transcription with gpt-4o-transcribe, one function tool, tool_choice "auto"; server
    VAD by default), audio streamed in, and at a barge-in what such an app does: stop playing and
    truncate the answer at what was heard."""
    from openai import AsyncOpenAI

    q1, q2, q3 = utterances(speech)
    heard = Heard(served)

    async def main():
        client = AsyncOpenAI(api_key=TOKEN, websocket_base_url=f"ws://127.0.0.1:{served.port}/v1")
        async with client.realtime.connect(model="gpt-realtime") as conn:
            playing: dict = {}  # the answer being heard: its item id, when its audio began, how much came

            async def read() -> None:
                async for ev in conn:
                    heard.add(ev.to_dict())
                    if ev.type == "response.output_audio.delta":
                        if playing.get("id") != ev.item_id:
                            playing.update(id=ev.item_id, at=time.monotonic(), ms=0.0)
                        playing["ms"] += len(base64.b64decode(ev.delta)) / (2 * RATE / 1000)
                    elif ev.type == "input_audio_buffer.speech_started" and playing:
                        heard_ms = min(1000 * (time.monotonic() - playing["at"]), playing["ms"])
                        if heard_ms < playing["ms"] - 1:  # not all of it heard: cut it there
                            await conn.conversation.item.truncate(item_id=playing["id"], content_index=0,
                                                                  audio_end_ms=int(heard_ms))
                        playing.clear()

            reader = asyncio.create_task(read())
            await conn.session.update(session={
                "type": "realtime", "instructions": "You are a helpful, concise voice assistant.",
                "audio": {"input": {"transcription": {"model": "gpt-4o-transcribe"}}},
                "tools": [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}],
                "tool_choice": "auto"})
            await heard.until("session.updated", 1)

            async def send(chunk: bytes) -> None:
                await conn.input_audio_buffer.append(audio=base64.b64encode(chunk).decode())

            try:
                await stream(send, q1)
                await heard.until("response.done", 1)  # answer 1
                await heard.heard_to_the_end(0)
                await stream(send, q2)
                await heard.until("response.output_audio.delta", heard.count("response.output_audio.delta") + 1)
                await stream(send, q3)  # over answer 2
                await heard.until("response.done", 3)  # answer 2 cut, the answer to the interruption
            finally:
                reader.cancel()
        assert heard.errors == []
        assert heard.tools_offered() == ["get_weather"] and heard.session["tool_choice"] == "auto"
        assert heard.session["audio"]["input"]["transcription"]["model"] == "gpt-4o-transcribe"
        heard.held_two_turns_and_a_barge_in()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


# ---------------------------------------------------------------- Pipecat


@fake_engine_only
def test_pipecat_openai_realtime_service_as_its_example_two_turns_and_a_barge_in(served, speech, monkeypatch):
    """Pipecat's `OpenAIRealtimeLLMService` set up as its own example (foundational/19-openai-realtime):
    session properties with input transcription, semantic_vad and noise reduction `near_field`, and
    instructions; an LLM context with a user message and two function tools (registered handlers), and
    its context aggregators; audio pushed in as `InputAudioRawFrame`s (no transport: the test is the
    microphone). The context's own answer comes first (LLMRunFrame), then the two spoken turns and the
    barge-in. The server events are observed where the service parses them (unchanged)."""
    from loguru import logger
    from pipecat.adapters.llm.schemas.function_schema import FunctionSchema
    from pipecat.adapters.llm.schemas.tools_schema import ToolsSchema
    from pipecat.frames.frames import ErrorFrame, InputAudioRawFrame, LLMRunFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime import events as pipecat_events
    from pipecat.services.openai.realtime.events import (
        AudioConfiguration, AudioInput, InputAudioNoiseReduction, InputAudioTranscription,
        SemanticTurnDetection, SessionProperties,
    )
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService
    from pipecat.workers.runner import WorkerRunner

    q1, q2, q3 = utterances(speech)
    heard = Heard(served)
    parse = pipecat_events.parse_server_event

    def observed(message):
        heard.add(json.loads(message))
        return parse(message)

    monkeypatch.setattr(pipecat_events, "parse_server_event", observed)

    class ErrorFrames(FrameProcessor):
        """The end of the pipeline: records every error frame that reaches it."""

        def __init__(self) -> None:
            super().__init__()
            self.errors: list = []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, ErrorFrame):
                self.errors.append(frame)
            await self.push_frame(frame, direction)

    errors_logged: list[str] = []
    sink = logger.add(errors_logged.append, level="ERROR")
    weather = FunctionSchema(name="get_current_weather", description="Get the current weather", properties={
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "format": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, required=["location", "format"])
    restaurant = FunctionSchema(name="get_restaurant_recommendation", description="Get a restaurant recommendation",
                                properties={"location": {"type": "string"}}, required=["location"])

    async def main():
        session_properties = SessionProperties(
            audio=AudioConfiguration(input=AudioInput(
                transcription=InputAudioTranscription(), turn_detection=SemanticTurnDetection(),
                noise_reduction=InputAudioNoiseReduction(type="near_field"))),
            instructions="You are a helpful and friendly AI. Keep your responses short.")
        llm = OpenAIRealtimeLLMService(api_key=TOKEN, base_url=f"ws://127.0.0.1:{served.port}/v1/realtime",
                                       settings=OpenAIRealtimeLLMService.Settings(session_properties=session_properties))

        async def no_call(params):  # OpusLM calls no tool; the example registers its handlers all the same
            raise AssertionError("no function call was expected")

        llm.register_function("get_current_weather", no_call)
        llm.register_function("get_restaurant_recommendation", no_call)
        context = LLMContext([{"role": "user", "content": "Say hello!"}], ToolsSchema(standard_tools=[weather, restaurant]))
        aggregators = LLMContextAggregatorPair(context)
        end = ErrorFrames()
        task = PipelineWorker(Pipeline([aggregators.user(), llm, end, aggregators.assistant()]),
                              params=PipelineParams(audio_in_sample_rate=RATE), idle_timeout_secs=None)
        pipeline_errors: list = []

        @task.event_handler("on_pipeline_error")
        async def on_pipeline_error(_task, frame):
            pipeline_errors.append(frame)

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(task)
        run = asyncio.create_task(runner.run())
        try:
            async def send(chunk: bytes) -> None:
                await task.queue_frame(InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))

            await task.queue_frames([LLMRunFrame()])  # the context's answer
            await heard.until("response.done", 1)
            await heard.heard_to_the_end(0)
            await stream(send, q1)
            await heard.until("response.done", 2)  # answer 1
            await heard.heard_to_the_end(1)
            await stream(send, q2)
            await heard.until("response.output_audio.delta", heard.count("response.output_audio.delta") + 1)
            await stream(send, q3)  # over answer 2
            await heard.until("response.done", 4)  # answer 2 cut, the answer to the interruption
        finally:
            await task.cancel()
            await asyncio.wait_for(run, 10)
        assert heard.errors == [] and end.errors == [] and pipeline_errors == [] and errors_logged == []
        assert sorted(heard.tools_offered()) == ["get_current_weather", "get_restaurant_recommendation"]
        assert heard.session["audio"]["input"]["noise_reduction"] == {"type": "near_field"}  # the example's, echoed
        heard.held_two_turns_and_a_barge_in(preamble=1)

    try:
        asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        logger.remove(sink)


# ---------------------------------------------------------------- LiveKit Agents


def test_livekit_openai_realtime_model_quickstart_greeting_two_turns_and_barge_ins(served, speech):
    """LiveKit's OpenAI plugin: `RealtimeModel(...)` on its defaults (semantic_vad, transcription),
    its session driven directly without a LiveKit room (its API allows it: the session opens its own
    aiohttp connection when no job context exists) as LiveKit's AgentSession drives it: the agent's
    instructions, the quickstart's greeting `generate_reply(instructions="Greet the user...")` on an
    empty conversation, then the two spoken turns (`push_audio`) and the barge-in: at the user's speech
    it cancels the answer (`interrupt()`) and truncates it at what was heard. LiveKit logs nothing at
    ERROR; the one error event allowed on the wire is OpenAI's answer to a cancel that came after the
    server's own ("Cancellation failed: no active response found"), which LiveKit expects and ignores."""
    from livekit import rtc
    from livekit.agents import llm
    from livekit.plugins import openai

    q1, q2, q3 = utterances(speech)
    heard = Heard(served, allowed=(CANCEL_RACE,))

    async def main():
        model = openai.realtime.RealtimeModel(api_key=TOKEN, base_url=f"http://127.0.0.1:{served.port}/v1")
        session = model.session()
        errors: list = []
        playing: dict = {}  # the answer being heard: its item id, when its audio began, how much came
        session.on("error", errors.append)
        session.on("openai_server_event_received", heard.add)
        sent: list[dict] = []  # what LiveKit sent: its greeting's instructions, its cancels at the barge-in
        session.on("openai_client_event_queued", sent.append)

        async def listen(gen: llm.GenerationCreatedEvent) -> None:
            async for msg in gen.message_stream:
                async for frame in msg.audio_stream:
                    if playing.get("id") != msg.message_id:
                        playing.update(id=msg.message_id, at=time.monotonic(), ms=0.0)
                    playing["ms"] += 1000 * frame.samples_per_channel / frame.sample_rate

        def barge_in(_ev) -> None:
            """The user spoke over an answer: cancel it, cut it at what was heard (AgentSession's way)."""
            session.interrupt()
            if playing and playing["ms"] > 0:
                heard_ms = min(1000 * (time.monotonic() - playing["at"]), playing["ms"])
                if heard_ms < playing["ms"] - 1:  # not all of it heard
                    session.truncate(message_id=playing["id"], modalities=["audio"], audio_end_ms=int(heard_ms))

        listeners = set()
        session.on("generation_created", lambda gen: listeners.add(asyncio.create_task(listen(gen))))
        session.on("input_speech_started", barge_in)

        async def send(chunk: bytes) -> None:
            samples = len(chunk) // 2
            session.push_audio(rtc.AudioFrame(chunk, RATE, 1, samples))

        with ErrorLogs("livekit.agents", "livekit.plugins.openai") as logs:
            try:
                await session.update_instructions("You are a helpful voice AI assistant.")
                greeting = await session.generate_reply(instructions="Greet the user and offer your assistance.")
                assert greeting.user_initiated
                await heard.until("response.done", 1)
                await heard.heard_to_the_end(0)
                await stream(send, q1)
                await heard.until("response.done", 2)  # answer 1
                await heard.heard_to_the_end(1)
                await stream(send, q2)
                await heard.until("response.output_audio.delta", heard.count("response.output_audio.delta") + 1)
                await stream(send, q3)  # over answer 2
                await heard.until("response.done", 4)  # answer 2 cut, the answer to the interruption
            finally:
                await session.aclose()
                await model.aclose()
                for t in listeners:
                    t.cancel()
        assert errors == [] and logs.records == []
        assert heard.unexpected_errors() == []
        greeting_asked = [e for e in sent if e["type"] == "response.create"][0]
        # LiveKit sends the agent's instructions with the greeting's after them, for that response
        assert greeting_asked["response"]["instructions"].endswith("Greet the user and offer your assistance.")
        assert any(e["type"] == "response.cancel" for e in sent)  # the barge-in's cancel was exercised
        heard.held_two_turns_and_a_barge_in(preamble=1)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
