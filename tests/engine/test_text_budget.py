"""The text budget (engine/text_budget.py) agrees with the engine's own checks, and system text is tokenized
once per piece (issue 39: each system message re-tokenized all the system text). No vLLM: the tokenizer
and the prompt arithmetic only."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from engine import oneshot, vocab
from engine.capacity import CapacityModel
from engine.conversation import Conversation
from engine.dialogue import MIN_ANSWER_FRAMES, fit_context
from engine.layout import DEFAULT_LAYOUT
from engine.pipeline import Pipeline
from engine.service_api import DEFAULT_OPTIONS, ConversationOptions, SpeechOptions, TextTooLong
from engine.service_config import EngineServiceConfig
from engine.text import TextTokenizer
from engine.text_budget import text_budget

CONTEXT = 4096


def _frame() -> np.ndarray:
    return np.array([vocab.stream_range(k)[0] for k in range(vocab.NUM_STREAMS)], np.int64)


@pytest.mark.parametrize("voice_frames", [0, 20, 700])
def test_speech_text_of_the_budget_fits_and_one_token_more_is_refused(voice_frames):
    budget = text_budget(CONTEXT, DEFAULT_LAYOUT, DEFAULT_OPTIONS.max_text_tokens)
    limit = budget.speech_tokens_with_voice if voice_frames else budget.speech_tokens
    speaker = np.tile(_frame(), (voice_frames, 1)) if voice_frames else None
    ids = [vocab.TEXT_OFFSET + 1] * limit
    request = oneshot.tts_request(ids, speaker, SpeechOptions(), CONTEXT)
    assert request.max_frames == 1  # one frame of audio: the most text the context holds
    with pytest.raises(TextTooLong, match="too long for the model's context"):
        oneshot.tts_request(ids + ids[:1], speaker, SpeechOptions(), CONTEXT)
    assert 3000 < budget.speech_tokens_with_voice < budget.speech_tokens < CONTEXT


def test_a_typed_turn_of_the_budget_leaves_the_shortest_answer_beside_the_longest_voice_and_system_text():
    budget = text_budget(CONTEXT, DEFAULT_LAYOUT, DEFAULT_OPTIONS.max_text_tokens)
    assert budget.system_tokens == CONTEXT // 4

    def fit(user_tokens: int):
        return fit_context([], user_tokens, CONTEXT, max_frames=500, retention_ratio=0.75,
                           speaker_frames=DEFAULT_LAYOUT.speaker_prompt_length, max_text_tokens=DEFAULT_OPTIONS.max_text_tokens,
                           system_tokens=budget.system_tokens)

    assert fit(budget.user_text_tokens).fits and fit(budget.user_text_tokens).max_frames == MIN_ANSWER_FRAMES
    assert not fit(budget.user_text_tokens + 1).fits


class CountingTokenizer:
    """The tiny model's tokenizer, recording every text it is asked to encode."""

    def __init__(self, inner: TextTokenizer) -> None:
        self.inner, self.texts = inner, []

    def encode(self, text: str) -> np.ndarray:
        self.texts.append(text)
        return self.inner.encode(text)


def test_each_system_message_is_tokenized_once_with_the_ids_of_the_whole_text(tiny_model):
    tokenizer = TextTokenizer.from_dir(tiny_model)
    pipeline = Pipeline(EngineServiceConfig(), CapacityModel(max_conversations=1))
    pipeline._llm = SimpleNamespace(max_model_len=CONTEXT)  # no vLLM: only its context length is read
    pipeline.text_tokenizer = counting = CountingTokenizer(tokenizer)
    instructions = "Be brief and kind. \U0001F600"
    conv = Conversation(pipeline, None, "s", ConversationOptions(system_prompt=instructions))
    text = instructions
    for k in range(4):  # the gateway appends each system message's text after a line break
        text += "\n" + f"Rule {k}: answer in {'French' if k % 2 else 'English'}, politely." * (k + 1)
        conv.update_options(dataclasses.replace(conv._requested, system_prompt=text))
        assert conv._system_ids == tuple(int(i) for i in tokenizer.encode(text))  # as if tokenized whole
    assert [len(t) for t in counting.texts] == [len(instructions)] + [len(text.split("\n")[k + 1]) + 1 for k in range(4)]
    # another text (a message deleted) is tokenized whole; the same text again, not at all
    conv.update_options(dataclasses.replace(conv._requested, system_prompt=instructions))
    conv.update_options(dataclasses.replace(conv._requested, system_prompt=instructions))
    assert counting.texts[-1] == instructions and len(counting.texts) == 6
    assert conv._system_ids == tuple(int(i) for i in tokenizer.encode(instructions))
    pipeline._tok_pool.shutdown()
