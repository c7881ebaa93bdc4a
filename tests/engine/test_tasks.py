"""engine.tasks: each task's prompt row by row against ESPnet's layout, written out by hand from
ESPnet's code (sources in engine/tasks.py's docstring); the dialogue prompt of engine.dialogue equals
ESPnet's whole-sequence interleave of the same conversation; the tiny model's tokenizer gives
prompts whose text ids are in range."""

from __future__ import annotations

import numpy as np
import pytest

from engine import delay, vocab
from engine.dialogue import (
    SPEAKER_PROMPT_FRAMES,
    DialogueTurn,
    answer_rows,
    fit_context,
    response_prompt,
    stable_user_prefix,
)
from engine.layout import DEFAULT_LAYOUT, PromptLayout
from engine.prompt import random_frames, special_rows
from engine.tasks import (
    INTER_SEGMENT_PAD,
    TaskPrompt,
    asr_prompt,
    audio_segment,
    continuation_prompt,
    interleaved,
    speaker_segment,
    text_dialogue_prompt,
    text_segment,
    tts_prompt,
    undelayed,
)
from engine.text import TextTokenizer

P = vocab.PAD


def frames_of(num: int) -> np.ndarray:
    """Recognisable frames: SSL cluster 100 + t, codebook j code 10 t + j."""
    t = np.arange(num)
    return vocab.frames_to_global(100 + t, 10 * t[:, None] + np.arange(vocab.NUM_CODEBOOKS))


# Two frames in global ids: SSL 356/357; codebook j of frame 0 is 5256 + 1025 j, of frame 1 ten more.
S0, S1 = 356, 357
C0 = [5256, 6281, 7306, 8331, 9356, 10381, 11406, 12431]
C1 = [c + 10 for c in C0]
T0, T1 = vocab.TEXT_OFFSET + 5, vocab.TEXT_OFFSET + 7  # two text tokens


def row(s0: int, **streams: int) -> list[int]:
    """A step: stream 0 = s0, stream k = streams['k<k>'], PAD elsewhere."""
    r = [s0] + [P] * vocab.NUM_CODEBOOKS
    for name, value in streams.items():
        r[int(name[1:])] = value
    return r


# The 8-step tail of two frames (rows after their SSL steps): stream k carries frame t at step t + k.
TWO_FRAME_TAIL = [
    row(P, k1=C1[0], k2=C0[1]),
    row(P, k2=C1[1], k3=C0[2]),
    row(P, k3=C1[2], k4=C0[3]),
    row(P, k4=C1[3], k5=C0[4]),
    row(P, k5=C1[4], k6=C0[5]),
    row(P, k6=C1[5], k7=C0[6]),
    row(P, k7=C1[6], k8=C0[7]),
    row(P, k8=C1[7]),
]
PAD_ROWS = [row(P)] * INTER_SEGMENT_PAD


def test_the_frames_helper_matches_the_constants() -> None:
    np.testing.assert_array_equal(frames_of(2), [[S0, *C0], [S1, *C1]])
    assert INTER_SEGMENT_PAD == 8  # espnet2/tasks/speechlm.py: codec_token_in_use - 1 for ar_delay


def test_asr_rows_one_by_one() -> None:
    # ESPnet (preprocessor.py::SpeechLMPreprocessor, codec_ssl_asr): <sos/eos> <task 80>, the condition
    # <codec_ssl> + frames + 8 pad rows (no end token: not a target), then the target's <text_bpe>.
    # ar_delay.py interleaves it whole: stream k of frame t at step 3 + t + k.
    p = asr_prompt(frames_of(2))
    expected = [
        row(vocab.SOS_EOS),
        row(vocab.TASK_ASR),
        row(vocab.CODEC_SSL),
        row(S0),
        row(S1, k1=C0[0]),
        *TWO_FRAME_TAIL,
        row(vocab.TEXT_BPE),
    ]
    np.testing.assert_array_equal(p.rows, expected)
    assert vocab.TASK_ASR == 80 and vocab.TEXT_BPE == 35
    assert p.start_modality == vocab.TEXT_BPE and p.rows.dtype == np.int64
    np.testing.assert_array_equal(p.carry, np.zeros((8, 9)))
    assert not p.continues_segment


def test_without_the_pad_rows_segments_would_overlap() -> None:
    """Why ESPnet pads: interleaving the whole sequence slides an audio segment's last codebooks into
    the next segment's first 8 steps unless 8 pad rows sit between them."""
    head = special_rows(vocab.SOS_EOS, vocab.TASK_ASR, vocab.CODEC_SSL)
    seq = np.concatenate([head, frames_of(2), special_rows(vocab.TEXT_BPE)])
    steps = delay.interleave(seq)
    np.testing.assert_array_equal(steps[5], row(vocab.TEXT_BPE, k1=C1[0], k2=C0[1]))  # the opener carries audio
    np.testing.assert_array_equal(asr_prompt(frames_of(2)).rows[-1], row(vocab.TEXT_BPE))  # with the pads it does not


def test_plain_tts_rows_one_by_one() -> None:
    # codec_ssl_plain_tts (82): condition <text_bpe> + text + 8 pad rows; target <codec_ssl>.
    p = tts_prompt([T0, T1])
    expected = [row(vocab.SOS_EOS), row(vocab.TASK_PLAIN_TTS), row(vocab.TEXT_BPE), row(T0), row(T1), *PAD_ROWS,
                row(vocab.CODEC_SSL)]
    np.testing.assert_array_equal(p.rows, expected)
    assert vocab.TASK_PLAIN_TTS == 82 and p.start_modality == vocab.CODEC_SSL and not p.continues_segment


def test_tts_with_a_speaker_prompt_pads_it_to_500_frames_after_the_text() -> None:
    # codec_ssl_tts (81): conditions in SPEECHLM_TASKS order, text then utt2spk (modality spk, 37);
    # the speaker prompt is speaker_prompt_length frames, zero-padded in all 9 streams.
    p = tts_prompt([T0, T1], speaker_frames=frames_of(2))
    head = [row(vocab.SOS_EOS), row(vocab.TASK_TTS), row(vocab.TEXT_BPE), row(T0), row(T1), *PAD_ROWS,
            row(vocab.SPEAKER)]
    n = len(head)
    np.testing.assert_array_equal(p.rows[:n], head)
    np.testing.assert_array_equal(p.rows[n : n + 10], [row(S0), row(S1, k1=C0[0]), *TWO_FRAME_TAIL])
    np.testing.assert_array_equal(p.rows[n + 10 : -1], np.zeros((SPEAKER_PROMPT_FRAMES - 2, 9)))  # the padding
    np.testing.assert_array_equal(p.rows[-1], row(vocab.CODEC_SSL))
    assert len(p.rows) == n + SPEAKER_PROMPT_FRAMES + 8 + 1 == 523
    assert vocab.TASK_TTS == 81 and vocab.SPEAKER == 37 and p.start_modality == vocab.CODEC_SSL


def test_a_long_speaker_prompt_is_cut_to_its_first_500_frames() -> None:
    voice = random_frames(np.random.default_rng(1), 620)
    long = tts_prompt([T0], speaker_frames=voice)
    exact = tts_prompt([T0], speaker_frames=voice[:SPEAKER_PROMPT_FRAMES])
    np.testing.assert_array_equal(long.rows, exact.rows)
    start = 2 + 2 + 8 + 1  # <sos> <task>, <text_bpe> T0, pads, <spk>
    np.testing.assert_array_equal(long.rows[start : start + SPEAKER_PROMPT_FRAMES + 8], delay.interleave(voice[:500]))


def test_continuation_is_one_segment_and_carries_the_prompt_tail() -> None:
    # codec_ssl_audiolm (83): no conditions, one target <codec_ssl> + audio: the prompt is that
    # segment's start, so the interleave carries frames 0-1's codebooks into the generated steps.
    p = continuation_prompt(frames_of(2))
    expected = [row(vocab.SOS_EOS), row(vocab.TASK_AUDIOLM), row(vocab.CODEC_SSL), row(S0), row(S1, k1=C0[0])]
    np.testing.assert_array_equal(p.rows, expected)
    np.testing.assert_array_equal(p.carry, TWO_FRAME_TAIL)
    assert vocab.TASK_AUDIOLM == 83 and p.start_modality == vocab.CODEC_SSL and p.continues_segment


def test_a_long_continuation_carries_frame_t_plus_s_minus_k_in_stream_k_before_step_k() -> None:
    frames = random_frames(np.random.default_rng(2), 20)
    p = continuation_prompt(frames)
    np.testing.assert_array_equal(p.rows[3:], delay.interleave(frames)[:20])
    for s in range(8):
        for k in range(9):
            assert p.carry[s, k] == (frames[20 + s - k, k] if s < k else P)


def test_text_dialogue_rows_one_by_one() -> None:
    # text_dialogue (88): chat segments, each role + <text_bpe> + text [+ end, targets] + 8 pads;
    # assistant messages are targets in ESPnet's text-dialogue data (data_prep_smoltalk.py).
    msgs = [(vocab.USER, [T0, T1]), (vocab.ASSISTANT, [T1]), (vocab.USER, [T0])]
    p = text_dialogue_prompt(msgs)
    expected = [
        row(vocab.SOS_EOS), row(vocab.TASK_TEXT_DIALOGUE),
        row(vocab.USER), row(vocab.TEXT_BPE), row(T0), row(T1), *PAD_ROWS,
        row(vocab.ASSISTANT), row(vocab.TEXT_BPE), row(T1), row(vocab.SOS_EOS), *PAD_ROWS,
        row(vocab.USER), row(vocab.TEXT_BPE), row(T0), *PAD_ROWS,
        row(vocab.ASSISTANT), row(vocab.TEXT_BPE),
    ]  # fmt: skip
    np.testing.assert_array_equal(p.rows, expected)
    assert vocab.TASK_TEXT_DIALOGUE == 88 and p.start_modality == vocab.TEXT_BPE
    eou = text_dialogue_prompt(msgs, history_end=vocab.EOU).rows
    assert eou[17, 0] == vocab.EOU and len(eou) == len(expected)
    bare = text_dialogue_prompt(msgs, history_end=None).rows
    assert len(bare) == len(expected) - 1 and vocab.SOS_EOS not in bare[2:, 0]
    system = text_dialogue_prompt(msgs, system_text_ids=[T1]).rows
    np.testing.assert_array_equal(system[2:13], [row(vocab.SYSTEM), row(vocab.TEXT_BPE), row(T1), *PAD_ROWS])


# --- the audio dialogue of engine.dialogue, rebuilt the way ESPnet builds it ---------------------


def _text(n: int) -> list[int]:
    return list(range(vocab.TEXT_OFFSET + 3, vocab.TEXT_OFFSET + 3 + n))


def _turns(rng: np.random.Generator) -> tuple[list[DialogueTurn], np.ndarray]:
    text = _text
    turns = [
        DialogueTurn(vocab.USER, random_frames(rng, 12), text(3)),
        DialogueTurn(vocab.ASSISTANT, random_frames(rng, 9), text(2)),
        DialogueTurn(vocab.USER, random_frames(rng, 5)),
        DialogueTurn(vocab.ASSISTANT, random_frames(rng, 4)),
        DialogueTurn(vocab.USER, random_frames(rng, 7), text(1)),
    ]
    return turns, random_frames(rng, 30)


def _espnet_segments(turns: list[DialogueTurn], speaker: np.ndarray, layout: PromptLayout = DEFAULT_LAYOUT) -> list:
    # egs2/TEMPLATE/asr1/pyscripts/utils/speechlm_dialogue_assemble.py (jctian98/espnet@25319702):
    # system codec_ssl (-> spk) first; a user turn is audio then text, an assistant turn text then audio.
    segments = [speaker_segment(speaker, vocab.SYSTEM, layout)]
    for t in turns:
        audio = audio_segment(t.frames, t.role)
        text = [text_segment(t.text_ids, t.role)] if t.text_ids else []
        segments += [audio, *text] if t.role == vocab.USER else [*text, audio]
    return segments


@pytest.mark.parametrize("text_first", [False, True])
def test_the_dialogue_prompt_is_espnets_whole_sequence_interleave(text_first: bool) -> None:
    turns, speaker = _turns(np.random.default_rng(3))
    opener = [vocab.ASSISTANT, vocab.TEXT_BPE if text_first else vocab.CODEC_SSL]
    espnet = interleaved(undelayed(vocab.TASK_AUDIO_DIALOGUE, _espnet_segments(turns, speaker), opener), opener[1])
    ours = response_prompt(turns, speaker, text_first=text_first)
    np.testing.assert_array_equal(ours, espnet.rows)
    np.testing.assert_array_equal(ours[-2:], [row(vocab.ASSISTANT), row(opener[1])])
    assert not espnet.continues_segment


# --- the layout values of the checkpoint's config (engine/layout.py) -----------------------------
# ESPnet's preprocessor (jctian98/espnet@72221036 SpeechLMPreprocessor.modality_specific_processing,
# modality spk): longer than speaker_prompt_length -> cut to it; shorter -> padded to it with PAD in
# every stream when pad_speaker_prompt, else kept at its own length.


def _espnet_speaker(frames: np.ndarray, length: int, pad: bool) -> np.ndarray:
    """The speaker prompt's undelayed rows, written out from ESPnet's rule (the first frames where it
    takes a random window)."""
    kept = frames[:length]
    if pad and len(kept) < length:
        kept = np.concatenate([kept, np.full((length - len(kept), 9), P, np.int64)])
    return kept


@pytest.mark.parametrize("length, pad, given", [(150, True, 2), (150, True, 400), (150, False, 40), (150, False, 400),
                                                 (7, True, 3)])
def test_tts_lays_out_the_checkpoints_speaker_prompt_length(length: int, pad: bool, given: int) -> None:
    layout = PromptLayout(speaker_prompt_length=length, pad_speaker_prompt=pad)
    voice = random_frames(np.random.default_rng(given), given)
    p = tts_prompt([T0, T1], speaker_frames=voice, layout=layout)
    head = [row(vocab.SOS_EOS), row(vocab.TASK_TTS), row(vocab.TEXT_BPE), row(T0), row(T1), *PAD_ROWS, row(vocab.SPEAKER)]
    n, held = len(head), layout.speaker_rows(given)
    assert held == (length if pad else min(given, length))
    np.testing.assert_array_equal(p.rows[:n], head)
    # the speaker segment: its held frames interleaved, with their 8-step tail; then the target opener
    np.testing.assert_array_equal(p.rows[n : n + held + 8], delay.interleave(_espnet_speaker(voice, length, pad)))
    np.testing.assert_array_equal(p.rows[n + held + 8 :], [row(vocab.CODEC_SSL)])
    assert len(p.rows) == n + held + 8 + 1
    if pad and given < length:  # the padding is PAD in all 9 streams once the voice's tail is out
        assert (p.rows[n + given + 8 : n + held] == P).all()


@pytest.mark.parametrize("layout", [PromptLayout(150), PromptLayout(150, pad_speaker_prompt=False), PromptLayout(20)])
@pytest.mark.parametrize("text_first", [False, True])
def test_the_dialogue_prompt_with_the_checkpoints_layout_is_espnets_interleave(layout: PromptLayout, text_first: bool) -> None:
    turns, speaker = _turns(np.random.default_rng(8))  # a 30-frame voice: padded to 150, cut to 20
    opener = [vocab.ASSISTANT, vocab.TEXT_BPE if text_first else vocab.CODEC_SSL]
    espnet = interleaved(undelayed(vocab.TASK_AUDIO_DIALOGUE, _espnet_segments(turns, speaker, layout), opener), opener[1])
    ours = response_prompt(turns, speaker, text_first=text_first, layout=layout)
    np.testing.assert_array_equal(ours, espnet.rows)
    held = layout.speaker_rows(len(speaker))
    np.testing.assert_array_equal(ours[2:4], [row(vocab.SYSTEM), row(vocab.SPEAKER)])
    np.testing.assert_array_equal(ours[4 : 4 + held + 8],
                                  delay.interleave(_espnet_speaker(speaker, layout.speaker_prompt_length,
                                                                   layout.pad_speaker_prompt)))
    assert ours[4 + held + 8, 0] == vocab.USER  # the first turn right after the speaker segment
    # the context arithmetic counts the same rows, and the stable prefix leads the prompt
    history, user = turns[:-1], turns[-1]
    prompt = response_prompt([*history, DialogueTurn(vocab.USER, user.frames)], speaker, layout=layout)
    fit = fit_context(history, len(user.frames), 1 << 20, 10, 0.5, speaker_frames=len(speaker), layout=layout)
    assert fit.prompt_rows == len(prompt)
    prefix = stable_user_prefix(history, user.frames, speaker, layout=layout)
    np.testing.assert_array_equal(prompt[: len(prefix)], prefix)


def test_bad_layout_values_are_refused() -> None:
    for bad in (0, -3, 1.5, "150", True):
        with pytest.raises(ValueError, match="speaker_prompt_length"):
            PromptLayout(speaker_prompt_length=bad)
    with pytest.raises(ValueError, match="pad_speaker_prompt"):
        PromptLayout(pad_speaker_prompt="yes")


def test_the_default_opener_is_still_assistant_audio() -> None:
    turns, _ = _turns(np.random.default_rng(4))
    np.testing.assert_array_equal(response_prompt(turns)[-2:], [row(vocab.ASSISTANT), row(vocab.CODEC_SSL)])
    np.testing.assert_array_equal(response_prompt(turns)[:-2], response_prompt(turns, text_first=True)[:-2])


def test_the_speaker_prompt_is_padded_and_the_stable_prefix_still_leads_the_prompt() -> None:
    turns, speaker = _turns(np.random.default_rng(5))
    history, user = turns[:-1], turns[-1]
    prompt = response_prompt([*history, DialogueTurn(vocab.USER, user.frames)], speaker[:3])
    assert prompt[2, 0] == vocab.SYSTEM and prompt[3, 0] == vocab.SPEAKER
    padded = np.concatenate([speaker[:3], np.zeros((SPEAKER_PROMPT_FRAMES - 3, 9), np.int64)])
    np.testing.assert_array_equal(prompt[4 : 4 + 508], delay.interleave(padded))
    prefix = stable_user_prefix(history, user.frames, speaker[:3])
    np.testing.assert_array_equal(prompt[: len(prefix)], prefix)
    fit = fit_context(history, len(user.frames), 1 << 20, 10, 0.5, speaker_frames=3)
    assert fit.prompt_rows == len(prompt)


def test_a_text_first_answer_reserves_its_text_rows() -> None:
    turns, _ = _turns(np.random.default_rng(6))
    assert answer_rows(50, 20) - answer_rows(50) == 20 + 1 + 8 + 2  # text, <sos/eos>, pads, <10 34>
    audio = fit_context(turns, 10, 230, 50, 1.0)  # 209 rows with the audio answer
    text = fit_context(turns, 10, 230, 50, 1.0, max_text_tokens=40)  # 51 more
    assert audio.drop == 0 and audio.fits and text.drop == 2 and text.fits
    assert text.prompt_rows + answer_rows(50, 40) <= 230


# --- inputs ---------------------------------------------------------------------------------------


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="frames"):
        asr_prompt(np.zeros((0, 9), np.int64))
    with pytest.raises(ValueError, match="ranges"):
        asr_prompt(frames_of(2)[:, ::-1])
    with pytest.raises(ValueError, match="global"):
        tts_prompt([5, 7])
    with pytest.raises(ValueError, match="at least one"):
        tts_prompt([])
    with pytest.raises(ValueError, match="role"):
        text_dialogue_prompt([(vocab.SYSTEM, [T0])])
    with pytest.raises(ValueError, match="start_modality"):
        TaskPrompt(np.zeros((1, 9), np.int64), vocab.SPEAKER, np.zeros((8, 9), np.int64))


def test_the_tiny_tokenizer_gives_text_ids_in_range(tiny_model) -> None:
    from engine.checkpoint import load_config

    tok = TextTokenizer.from_dir(tiny_model)
    vocab_size = load_config(tiny_model).vocab_size
    said = "Hello there, how are you?"
    ids = tok.encode(said)
    p = tts_prompt(ids, speaker_frames=frames_of(4))
    text = p.rows[3 : 3 + len(ids), 0]
    assert tok.is_text(text).all() and tok.decode(text) == said
    assert p.rows.max() < vocab_size and (p.rows[:, 1:] < vocab.TEXT_OFFSET).all()  # text only in stream 0
    chat = text_dialogue_prompt([(vocab.USER, ids), (vocab.ASSISTANT, tok.encode("Fine."))])
    in_text = chat.rows[:, 0] >= vocab.TEXT_OFFSET
    assert tok.is_text(chat.rows[in_text, 0]).all() and chat.rows.max() < tok.text_end <= vocab_size
    assert tok.decode(chat.rows[4 : 4 + len(ids), 0]) == said
