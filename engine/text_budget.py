"""How many tokens of text each use of text may hold in the model's context (`service_api.TextBudget`).

The numbers are the prompt layouts' own arithmetic, so the gateway can refuse text that cannot fit
before the engine is asked (issue 39: 4096 emoji are 16384 byte-level tokens, four times a 4096-position
context), and the engine's own checks (oneshot.tts_request, dialogue.fit_context) agree with them:

- system text: the conversation keeps at least three quarters of the context for itself, so the system
  text (instructions and system messages) gets a quarter (`SYSTEM_SHARE`);
- a typed user turn: what is left beside the longest speaker prompt, the longest system text, an
  answer's text (`max_text_tokens`) and the shortest answer worth giving (`dialogue.MIN_ANSWER_FRAMES`);
- speech (TTS): the task prompt holds the text and, with a voice, the speaker prompt (padded to the
  layout's length); at least one frame of audio must fit after it (`oneshot.tts_request`).
"""

from __future__ import annotations

import numpy as np

from engine import tasks, vocab
from engine.delay import FLUSH_STEPS
from engine.dialogue import MIN_ANSWER_FRAMES, OPENER_ROWS, SEGMENT_ROWS, answer_rows, head_rows
from engine.layout import PromptLayout
from engine.service_api import TextBudget

SYSTEM_SHARE = 4  # the system text gets at most 1/SYSTEM_SHARE of the context
END_MARGIN = 4  # positions a one-shot request keeps free below the context's end (as dialogue.ANSWER_MARGIN_ROWS)


def system_tokens(max_model_len: int) -> int:
    return max_model_len // SYSTEM_SHARE


def _tts_rows_beside_text(layout: PromptLayout, voice: bool) -> int:
    """The rows a TTS prompt holds besides its text tokens (one row each)."""
    speaker = None
    if voice:
        frame = np.array([vocab.stream_range(k)[0] for k in range(vocab.NUM_STREAMS)], np.int64)
        speaker = np.tile(frame, (layout.speaker_prompt_length, 1))
    return len(tasks.tts_prompt([vocab.TEXT_OFFSET], speaker, layout).rows) - 1


def text_budget(max_model_len: int, layout: PromptLayout, max_text_tokens: int) -> TextBudget:
    """The budget of a model of `max_model_len` positions whose prompts are laid out as `layout`;
    `max_text_tokens`: the longest text an answer writes before its audio (ConversationOptions)."""
    system = system_tokens(max_model_len)
    user = (max_model_len - head_rows(layout.speaker_prompt_length, system, layout) - OPENER_ROWS - SEGMENT_ROWS
            - answer_rows(MIN_ANSWER_FRAMES, max_text_tokens))
    speech_room = max_model_len - FLUSH_STEPS - END_MARGIN - 1  # one frame of audio at least
    return TextBudget(context=max_model_len, system_tokens=system, user_text_tokens=max(0, user),
                      speech_tokens=max(0, speech_room - _tts_rows_beside_text(layout, False)),
                      speech_tokens_with_voice=max(0, speech_room - _tts_rows_beside_text(layout, True)))
