"""ServerVad endpointing on scripted probabilities, Silero on real speech, the pacer in simulated time."""

from __future__ import annotations

import numpy as np
import pytest

from realtime.pacing import Pacer
from realtime.vad import WINDOW_MS, ServerVad, SileroVad, VadParams

from rt_helpers import silence


def test_server_vad_start_stop_with_prefix_padding_and_min_speech():
    vad = ServerVad(VadParams(threshold=0.5, prefix_padding_ms=100, silence_duration_ms=96, min_speech_ms=64))
    probs = [0.1] * 10 + [0.9] * 20 + [0.2] * 5
    events = vad.feed(probs)
    assert [e.kind for e in events] == ["started", "stopped"]
    assert events[0].audio_ms == pytest.approx(10 * WINDOW_MS - 100)  # speech began at window 10
    assert events[1].audio_ms == pytest.approx(30 * WINDOW_MS)  # end of the last speech window


def test_server_vad_ignores_a_click_shorter_than_min_speech():
    vad = ServerVad(VadParams(min_speech_ms=96))
    assert vad.feed([0.1, 0.9, 0.9, 0.1, 0.1]) == []
    assert not vad.speaking


def test_server_vad_hysteresis_keeps_speech_through_a_dip():
    vad = ServerVad(VadParams(threshold=0.5, silence_duration_ms=64, min_speech_ms=32))
    events = vad.feed([0.9, 0.4, 0.4, 0.4, 0.9])  # 0.4 >= 0.5 - 0.15: still speech
    assert [e.kind for e in events] == ["started"]


def test_silero_detects_espeak_speech_not_silence(speech):
    pcm = np.concatenate([silence(500, 16_000), speech("hello there, how are you today", 16_000), silence(800, 16_000)])
    vad = SileroVad()
    probs = []
    for i in range(0, pcm.size, 320):  # 20 ms pieces: windows straddle calls
        probs += vad.process(pcm[i : i + 320])
    assert len(probs) == pcm.size // 512
    probs = np.array(probs)
    assert probs[:10].max() < 0.3  # leading silence
    assert probs[20:-30].mean() > 0.5 and probs.max() > 0.9
    events = ServerVad(VadParams()).feed(list(probs))
    assert [e.kind for e in events] == ["started", "stopped"]


def test_pacer_absolute_schedule_with_lead_and_reanchor():
    p = Pacer(16_000, lead_ms=100)
    t0 = 1000.0
    assert p.due(t0) == t0
    p.on_sent(16_000, t0)  # one second at once (the pacer decides when; here we force it)
    assert p.due(t0) == pytest.approx(t0 + 1.0 - 0.1)
    assert p.played_samples(t0 + 0.25) == 4000
    assert p.played_samples(t0 + 5) == 16_000  # never more than sent
    p.on_sent(320, t0 + 3.0)  # the source was 2 s late: re-anchor instead of bursting
    assert p.reanchors == 1
    assert p.due(t0 + 3.0) == pytest.approx(t0 + 3.0 + 0.02 - 0.1)
