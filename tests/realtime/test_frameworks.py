"""The voice-agent frameworks people build on, unchanged, against a real Gateway on 127.0.0.1 (issue 28).

Each test drives a framework's own OpenAI Realtime client (pinned in the `test` extra, see
pyproject.toml) the way its documentation does, configured as README's "Use it from your agent
framework" shows, and holds two turns with a barge-in: a question answered in full, a second question
whose answer the user interrupts by speaking again, and the answer to that interruption. Each runs
twice: in front of the fake engine (tests/realtime/fake_engine.py: answers of a known length, so the
history is checked frame for frame) and in front of the real engine (the tiny model on vLLM, what
`duplex serve` runs by default). The gateway, its VAD and the wire protocol are real; speech is
espeak-ng's. Every error the framework reports (its error events, and its loggers at ERROR) fails
the test.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import time
from collections.abc import Iterator

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
    """The server events a framework's client received, as (type, response status), with a wait:
    `await heard.until("response.done", 2)` returns once the second one came. Also the engine
    conversation behind the session, and per answer when its first audio arrived and how much came."""

    def __init__(self, served: Served) -> None:
        self.served = served
        self.events: list[tuple[str, str | None]] = []
        self.audio_at: list[float] = []
        self.audio_ms: list[float] = []
        self.conv = None  # taken at session.created: the gateway forgets it when the session ends
        self._changed = asyncio.Event()

    def add(self, data: dict) -> None:
        kind = data["type"]
        if kind == "session.created":
            self.conv = self.served.gw.conversation(data["session"]["id"])
        elif kind == "response.output_audio.delta":
            if len(self.audio_at) < self.count("response.created"):
                self.audio_at.append(time.monotonic())
                self.audio_ms.append(0.0)
            self.audio_ms[-1] += len(base64.b64decode(data["delta"])) / (2 * RATE / 1000)
        self.events.append((kind, data.get("response", {}).get("status")))
        self._changed.set()

    def count(self, kind: str) -> int:
        return sum(k == kind for k, _ in self.events)

    async def until(self, kind: str, n: int) -> None:
        while self.count(kind) < n:
            self._changed.clear()
            await self._changed.wait()

    async def heard_to_the_end(self, answer: int) -> None:
        """A listener speaks again only once an answer has played: its audio's length from its first
        audio (the server sends audio a little ahead of real time, so response.done comes earlier)."""
        await asyncio.sleep(max(0.0, self.audio_at[answer] + self.audio_ms[answer] / 1000 + 0.1 - time.monotonic()))

    def held_two_turns_and_a_barge_in(self, preamble: int = 0) -> None:
        """What the framework received and what the engine kept: answer 1 whole, answer 2 cut where the
        user spoke, answer 3 whole, after `preamble` answers asked for without speech (a greeting)."""
        kinds = [k for k, _ in self.events]
        assert [status for kind, status in self.events if kind == "response.done"] == ["completed"] * preamble + [
            "completed", "cancelled", "completed"], kinds
        assert kinds.count("input_audio_buffer.speech_started") == 3 and "error" not in kinds
        # the barge-in: speech_started before the interrupted answer's response.done (OpenAI's order)
        answer1_done, answer2_done = [i for i, k in enumerate(kinds) if k == "response.done"][preamble:preamble + 2]
        assert answer1_done < kinds.index("input_audio_buffer.speech_started", answer1_done + 1) < answer2_done
        turns = [(t.role.name.lower(), t.audio_frames) for t in self.conv.history][2 * preamble:]
        assert [role for role, _ in turns] == ["user", "assistant"] * 3, turns
        a1, a2, a3 = (frames for _, frames in turns[1::2])
        # a whole answer is kept whole: the fake engine's length, or all the audio the client received
        whole = [self.served.full_frames] * 2 if self.served.full_frames else [
            round(self.audio_ms[preamble + k] / 20) for k in (0, 2)]
        assert [a1, a3] == whole and 0 < a2 < self.served.max_frames, (turns, whole)


# ---------------------------------------------------------------- OpenAI Agents SDK


def test_openai_agents_sdk_realtime_runner_two_turns_and_a_barge_in(served, speech):
    """`agents.realtime`: RealtimeAgent + RealtimeRunner with its default session (semantic_vad,
    interrupt_response), transcription and OpenAI tracing switched off as README says."""
    from agents.realtime import RealtimeAgent, RealtimeRunner

    q1, q2, q3 = utterances(speech)

    async def main():
        runner = RealtimeRunner(RealtimeAgent(name="assistant", instructions="Be brief."), config={
            "tracing_disabled": True, "model_settings": {"input_audio_transcription": None}})
        session = await runner.run(model_config={"api_key": TOKEN, "url": f"ws://127.0.0.1:{served.port}/v1/realtime"})
        errors, heard = [], Heard(served)  # the SDK's error events; the server events it received
        with ErrorLogs("openai.agents") as logs:
            async with session:
                events = aiter(session)

                async def until(kind: str):
                    async for ev in events:
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
        assert errors == [] and logs.records == []
        heard.held_two_turns_and_a_barge_in()

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))


# ---------------------------------------------------------------- Pipecat


def test_pipecat_openai_realtime_service_with_a_context_two_turns_and_a_barge_in(served, speech, monkeypatch):
    """Pipecat's `OpenAIRealtimeLLMService` in a pipeline with the usual LLM context (a system message
    and a user message, sent as conversation items) and its context aggregators, audio pushed in as
    `InputAudioRawFrame`s (no transport: the test is the microphone). The context's own answer comes
    first (LLMRunFrame), then the two spoken turns and the barge-in. The server events are observed
    where the service parses them (unchanged)."""
    from loguru import logger
    from pipecat.frames.frames import ErrorFrame, InputAudioRawFrame, LLMRunFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.aggregators.llm_context import LLMContext
    from pipecat.processors.aggregators.llm_response_universal import LLMContextAggregatorPair
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime import events as pipecat_events
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

    async def main():
        llm = OpenAIRealtimeLLMService(api_key=TOKEN, base_url=f"ws://127.0.0.1:{served.port}/v1/realtime")
        context = LLMContext([{"role": "system", "content": "You are a terse assistant."},
                              {"role": "user", "content": "Say hello."}])
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
        assert end.errors == [] and pipeline_errors == [] and errors_logged == []
        heard.held_two_turns_and_a_barge_in(preamble=1)

    try:
        asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    finally:
        logger.remove(sink)


# ---------------------------------------------------------------- LiveKit Agents


def test_livekit_openai_realtime_model_session_without_a_room_two_turns_and_a_barge_in(served, speech):
    """LiveKit's OpenAI plugin: `RealtimeModel(...).session()` driven directly, without a LiveKit room
    (its API allows it: the session opens its own aiohttp connection when no job context exists). Its
    default session (semantic_vad) with transcription off; instructions and a chat context (a system
    and a user message) set as an agent would, `generate_reply()` for a greeting, then the two spoken
    turns (`push_audio`) and the barge-in, truncated at what was heard as LiveKit's AgentSession does."""
    from livekit import rtc
    from livekit.agents import llm
    from livekit.plugins import openai

    q1, q2, q3 = utterances(speech)
    heard = Heard(served)

    async def main():
        model = openai.realtime.RealtimeModel(api_key=TOKEN, base_url=f"http://127.0.0.1:{served.port}/v1",
                                              input_audio_transcription=None)
        session = model.session()
        errors: list = []
        playing: dict = {}  # the answer being heard: its item id, when its audio began, how much came
        session.on("error", errors.append)
        session.on("openai_server_event_received", heard.add)

        async def listen(gen: llm.GenerationCreatedEvent) -> None:
            async for msg in gen.message_stream:
                async for frame in msg.audio_stream:
                    if playing.get("id") != msg.message_id:
                        playing.update(id=msg.message_id, at=time.monotonic(), ms=0.0)
                    playing["ms"] += 1000 * frame.samples_per_channel / frame.sample_rate

        def barge_in(_ev) -> None:
            """The user spoke over an answer: cut it at what was heard (the server already stopped it)."""
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
                await session.update_instructions("You are a terse assistant.")
                ctx = llm.ChatContext()
                ctx.add_message(role="system", content="Answer in one sentence.")
                ctx.add_message(role="user", content="Say hello.")
                await session.update_chat_ctx(ctx)
                greeting = await session.generate_reply()  # response.metadata echoed: no 10 s timeout
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
        heard.held_two_turns_and_a_barge_in(preamble=1)

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
