"""engine.dialogue's context management: `fit_context` drops whole exchanges, oldest first, down to
the retention ratio, keeps the head, and says when an answer cannot fit (pure functions, no vLLM)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import vocab
from engine.dialogue import (
    MIN_ANSWER_FRAMES,
    DialogueTurn,
    answer_rows,
    fit_context,
    head_rows,
    response_prompt,
    turn_rows,
)
from engine.layout import DEFAULT_LAYOUT, PromptLayout
from engine.prompt import random_frames

RNG = np.random.default_rng(0)


def turn(role: int, frames: int, text: int = 0) -> DialogueTurn:
    return DialogueTurn(role, random_frames(RNG, frames), list(range(vocab.TEXT_OFFSET, vocab.TEXT_OFFSET + text)))


def exchanges(*lengths: tuple[int, int]) -> list[DialogueTurn]:
    """(user frames, assistant frames) per exchange."""
    return [t for u, a in lengths for t in (turn(vocab.USER, u), turn(vocab.ASSISTANT, a))]


def prompt_len(turns: list[DialogueTurn], user_frames: int, speaker_frames: int = 0,
               layout: PromptLayout = DEFAULT_LAYOUT) -> int:
    speaker = random_frames(RNG, speaker_frames) if speaker_frames else None
    return len(response_prompt([*turns, turn(vocab.USER, user_frames)], speaker, layout=layout))


# the tiny model's layout, and ESPnet's default and an unpadded one (a converted checkpoint's config)
LAYOUTS = st.sampled_from([DEFAULT_LAYOUT, PromptLayout(150), PromptLayout(150, pad_speaker_prompt=False)])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 3)), max_size=6), st.integers(0, 600), st.integers(0, 40),
       LAYOUTS)
def test_row_counts_equal_the_built_prompt(shape, speaker_frames, user_frames, layout) -> None:
    turns = [turn(vocab.USER if i % 2 == 0 else vocab.ASSISTANT, n, text) for i, (n, text) in enumerate(shape)]
    fit = fit_context(turns, user_frames, max_model_len=1 << 20, max_frames=10, retention_ratio=0.5,
                      speaker_frames=speaker_frames, layout=layout)
    assert fit.drop == 0 and fit.fits
    assert fit.prompt_rows == prompt_len(turns, user_frames, speaker_frames, layout)
    assert sum(map(turn_rows, turns)) + head_rows(speaker_frames, layout=layout) + 2 + 10 + user_frames == fit.prompt_rows


def test_nothing_is_dropped_while_the_answer_fits() -> None:
    turns = exchanges((50, 100), (40, 100))
    need = prompt_len(turns, 30) + answer_rows(100)
    assert fit_context(turns, 30, need, 100, 0.5).drop == 0
    assert fit_context(turns, 30, need - 1, 100, 0.5).drop > 0


def test_whole_exchanges_are_dropped_down_to_the_retention_ratio() -> None:
    turns = exchanges(*[(40, 60)] * 10)  # 10 exchanges of 120 rows
    user = 40
    limit = prompt_len(turns, user) + answer_rows(60) - 1  # one row short
    room = limit - head_rows(0) - 2 - answer_rows(60)
    for ratio, at_most in ((1.0, room), (0.75, 0.75 * room), (0.5, 0.5 * room)):
        fit = fit_context(turns, user, limit, 60, ratio)
        assert fit.fits and fit.drop % 2 == 0 and turns[fit.drop].role == vocab.USER
        kept = turns[fit.drop :]
        assert fit.prompt_rows == prompt_len(kept, user)
        conversation = sum(map(turn_rows, kept)) + 10 + user
        assert conversation <= at_most < conversation + 120  # the fewest exchanges that get there
    assert fit_context(turns, user, limit, 60, 1.0).drop == 2  # just enough: one exchange
    assert fit_context(turns, user, limit, 60, 0.5).drop == 12  # 4 of 10 exchanges fit half the room


def test_drops_are_rare_with_a_retention_ratio() -> None:
    """A conversation growing by one exchange at a time truncates once every several exchanges."""
    turns: list[DialogueTurn] = []
    drops = 0
    for _ in range(60):  # 1424 = 1024 + the 400 rows a 100-frame speaker prompt gains when padded to 500
        fit = fit_context(turns, 30, 1424, 50, 0.5, speaker_frames=100)
        assert fit.fits and fit.prompt_rows + answer_rows(50) <= 1424
        if fit.drop:
            drops += 1
            turns = turns[fit.drop :]
        turns += [turn(vocab.USER, 30), turn(vocab.ASSISTANT, 50)]
    assert 3 <= drops <= 60 // 5


def test_the_speaker_prompt_is_kept_and_counted() -> None:
    turns = exchanges(*[(40, 60)] * 4)
    with_speaker = fit_context(turns, 40, 700, 60, 1.0, speaker_frames=200)
    without = fit_context(turns, 40, 700, 60, 1.0)
    assert with_speaker.drop > without.drop  # the speaker prompt's 510 rows leave less room
    assert with_speaker.prompt_rows == prompt_len(turns[with_speaker.drop :], 40, speaker_frames=200)
    assert head_rows(900) == head_rows(500) == head_rows(1)  # the speaker prompt is cut or padded to 10 s
    assert head_rows(0) == 2


def test_the_checkpoints_speaker_prompt_length_sizes_the_head_and_the_room() -> None:
    espnet = PromptLayout(150)  # ESPnet's default speaker_prompt_length
    assert head_rows(900, layout=espnet) == head_rows(1, layout=espnet) == 2 + 10 + 150
    unpadded = PromptLayout(150, pad_speaker_prompt=False)
    assert head_rows(40, layout=unpadded) == 2 + 10 + 40 and head_rows(900, layout=unpadded) == 2 + 10 + 150
    assert head_rows(0, layout=espnet) == head_rows(0, layout=unpadded) == 2
    # 350 fewer rows than the default layout's: an answer that needs drops at 500 frames fits at 150
    turns = exchanges(*[(40, 60)] * 4)
    limit = prompt_len(turns, 40, 200, espnet) + answer_rows(60)
    at_150 = fit_context(turns, 40, limit, 60, 1.0, speaker_frames=200, layout=espnet)
    at_500 = fit_context(turns, 40, limit, 60, 1.0, speaker_frames=200)
    assert at_150.drop == 0 and at_150.fits and at_500.drop > 0
    assert at_150.prompt_rows == prompt_len(turns, 40, 200, espnet)


def test_a_history_that_does_not_start_an_exchange_is_cut_at_the_next_user_turn() -> None:
    turns = [turn(vocab.ASSISTANT, 60), *exchanges((40, 60), (40, 60))]
    fit = fit_context(turns, 40, prompt_len(turns, 40) + answer_rows(60) - 1, 60, 1.0)
    assert fit.drop == 1 and fit.fits


def test_disabled_drops_nothing_and_says_it_does_not_fit() -> None:
    turns = exchanges((40, 60), (40, 60))
    limit = prompt_len(turns, 40) + answer_rows(60)
    assert fit_context(turns, 40, limit, 60, None) == fit_context(turns, 40, limit, 60, 0.5)
    fit = fit_context(turns, 40, limit - 1, 60, None)
    assert fit.drop == 0 and not fit.fits


def test_a_user_turn_too_long_for_the_whole_answer_caps_it_or_does_not_fit() -> None:
    turns = exchanges((40, 60))
    alone = head_rows(0) + 2 + 10 + 400  # the prompt with the user turn only
    capped = fit_context(turns, 400, alone + answer_rows(0) + 120, 500, 0.8)
    assert capped.fits and capped.drop == 2 and capped.max_frames == 120
    assert capped.prompt_rows + answer_rows(capped.max_frames) == alone + answer_rows(0) + 120
    short = fit_context(turns, 400, alone + answer_rows(0) + MIN_ANSWER_FRAMES - 1, 500, 0.8)
    assert not short.fits and short.drop == 2
    # an answer asked shorter than a second is given whole or not at all
    assert fit_context([], 400, alone + answer_rows(20), 20, 0.8) == capped.__class__(0, 20, alone, True)
    assert not fit_context([], 400, alone + answer_rows(20) - 1, 20, 0.8).fits


def test_at_least_keeps_the_drop_an_incremental_prefill_assumed() -> None:
    turns = exchanges(*[(40, 60)] * 4)
    assert fit_context(turns, 40, 10_000, 60, 0.5, at_least=2).drop == 2
    assert fit_context(turns, 40, 10_000, 60, 0.5, at_least=3).drop == 4  # only ever at an exchange start
    # shorter answers asked after the prefill need no drop: the response keeps the prefill's (its KV is cached)
    limit = prompt_len(turns, 40) + answer_rows(60) - 1
    prefill = fit_context(turns, 40, limit, 60, 0.5)
    assert prefill.drop == 6
    assert fit_context(turns, 40, limit, 30, 0.5).drop == 0
    assert fit_context(turns, 40, limit, 30, 0.5, at_least=prefill.drop).drop == 6


@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_any_ratio_fits_when_the_user_turn_does(ratio: float) -> None:
    turns = exchanges(*[(30, 30)] * 6)
    fit = fit_context(turns, 30, 300, 50, ratio)
    assert fit.fits and fit.prompt_rows + answer_rows(50) <= 300
    assert fit.prompt_rows == prompt_len(turns[fit.drop :], 30)
