"""One-shot requests beside the conversations: ASR (audio -> text deltas) and TTS (text -> audio chunks)
on the same engine, tokenizer and codec stage (`Engine.transcribe`, `Engine.synthesize`).

    transcribe: pcm ─▶ tokenizer thread (whole clip) ─▶ tasks.asr_prompt ─▶ vLLM, text-first request
                    ─▶ text ids ─▶ TextDeltas ─▶ str deltas
    synthesize: text ─▶ TextTokenizer ─▶ tasks.tts_prompt ─▶ vLLM, audio request ─▶ frames
                    ─▶ codec stage ─▶ AudioChunk

They are offline requests (`realtime=False`): the scheduler serves every realtime answer that is not
comfortably ahead of playback before them, and preempts them first (vllm_plugin/scheduler.py). They
hold no conversation slot: how many may run at once is the gateway's bound (`audio_api.max_concurrent`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import numpy as np

from engine import tasks
from engine.delay import FLUSH_STEPS
from engine.layout import DEFAULT_LAYOUT, PromptLayout
from engine.request import AudioRequest
from engine.sampling import SamplingConfig
from engine.service_api import FRAME_MS, AtCapacity, AudioChunk, EngineError, SpeechOptions, TextTooLong, TranscriptionOptions
from engine.text import TextTokenizer
from engine.text_budget import END_MARGIN


class OneShotHost(Protocol):
    """What these requests use of the engine's model path (engine.pipeline.Pipeline)."""

    prompt_layout: PromptLayout  # the checkpoint's (engine/layout.py)

    @property
    def ready(self) -> bool: ...

    @property
    def max_model_len(self) -> int: ...

    async def tokenize_clip(self, pcm: np.ndarray) -> np.ndarray: ...

    def require_text(self) -> TextTokenizer: ...

    def text_deltas(self, request: AudioRequest, request_id: str, rank: int = 0) -> AsyncIterator[str]: ...

    def stream_audio(self, request: AudioRequest, response_id: str, rank: int) -> AsyncIterator[AudioChunk]: ...


PickRank = Callable[[], int]  # the engine rank with the most headroom now (data parallelism)


_ids = itertools.count()


def _check_ready(engine: OneShotHost) -> None:
    if not engine.ready:
        raise AtCapacity("engine is not ready")


def _sampling(options: TranscriptionOptions | SpeechOptions) -> SamplingConfig:
    return SamplingConfig(temperature=options.temperature, top_k=options.top_k, top_p=options.top_p, seed=options.seed)


def asr_request(frames: np.ndarray, options: TranscriptionOptions, max_model_len: int) -> AudioRequest:
    """The ASR request for a clip's frames: text only, at least one token, capped by the context."""
    prompt = tasks.asr_prompt(frames)
    room = max_model_len - len(prompt.rows) - END_MARGIN
    if room < 2:
        raise EngineError(f"the audio is too long for the model's context ({len(prompt.rows)} positions of {max_model_len})")
    return AudioRequest(prompt=prompt.rows, max_frames=0, start_modality=prompt.start_modality,
                        max_text_tokens=(n := min(options.max_tokens, room - 1)), min_text_tokens=min(options.min_tokens, n),
                        sampling=_sampling(options))


def tts_request(text_ids: list[int], speaker_frames: np.ndarray | None, options: SpeechOptions,
                max_model_len: int, layout: PromptLayout = DEFAULT_LAYOUT) -> AudioRequest:
    """The TTS request for text (global ids) and an optional voice's frames, laid out as `layout` says."""
    prompt = tasks.tts_prompt(text_ids, speaker_frames, layout)
    room = max_model_len - len(prompt.rows) - FLUSH_STEPS - END_MARGIN
    if room < 1:
        raise TextTooLong(f"the text is too long for the model's context ({len(prompt.rows)} positions of {max_model_len})")
    return AudioRequest(prompt=prompt.rows, max_frames=min(max(1, int(options.max_ms / FRAME_MS)), room), min_frames=1,
                        sampling=_sampling(options))


async def transcribe(engine: OneShotHost, pick_rank: PickRank, pcm_16k: np.ndarray,
                     options: TranscriptionOptions) -> AsyncIterator[str]:
    _check_ready(engine)
    engine.require_text()
    pcm = np.asarray(pcm_16k)
    if pcm.ndim != 1 or pcm.size == 0:
        raise ValueError("transcribe needs mono audio with at least one sample")
    request = asr_request(await engine.tokenize_clip(pcm), options, engine.max_model_len)
    async for delta in engine.text_deltas(request, f"asr-{next(_ids)}", pick_rank()):
        yield delta


async def synthesize(engine: OneShotHost, pick_rank: PickRank, text: str, options: SpeechOptions) -> AsyncIterator[AudioChunk]:
    _check_ready(engine)
    tokenizer = engine.require_text()
    if not text or not text.strip():
        raise ValueError("synthesize needs non-empty text")
    speaker = None
    if options.speaker_prompt_pcm is not None and len(options.speaker_prompt_pcm):
        speaker = await engine.tokenize_clip(np.asarray(options.speaker_prompt_pcm))
    ids = await asyncio.to_thread(tokenizer.encode, text)  # (it releases the GIL: engine/text.py)
    request = tts_request([int(i) for i in ids], speaker, options, engine.max_model_len, engine.prompt_layout)
    async for chunk in engine.stream_audio(request, f"tts-{next(_ids)}", pick_rank()):
        yield chunk
