"""ServerVad endpointing on scripted probabilities, Silero on real speech, the pacer in simulated time."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from realtime.pacing import Pacer
from realtime.session import PushAudio, Session
from realtime.vad import (
    WINDOW_MS, ServerVad, SileroVad, VadParams, VoicePaused, VoiceResumed, VoiceStarted, VoiceStopped, run_silero,
)
from realtime.vad_batch import VadBatcher

from rt_helpers import silence


def test_server_vad_start_stop_with_prefix_padding_and_min_speech():
    vad = ServerVad(VadParams(threshold=0.5, prefix_padding_ms=100, silence_duration_ms=96, min_speech_ms=64))
    probs = [0.1] * 10 + [0.9] * 20 + [0.2] * 5
    events = vad.feed(probs)
    assert [type(e) for e in events] == [VoiceStarted, VoiceStopped]
    assert events[0].audio_start_ms == pytest.approx(10 * WINDOW_MS - 100)  # speech began at window 10
    assert events[1].audio_end_ms == pytest.approx(30 * WINDOW_MS)  # end of the last speech window


def test_server_vad_ignores_a_click_shorter_than_min_speech():
    vad = ServerVad(VadParams(min_speech_ms=96))
    assert vad.feed([0.1, 0.9, 0.9, 0.1, 0.1]) == []
    assert not vad.speaking


def test_server_vad_hysteresis_keeps_speech_through_a_dip():
    vad = ServerVad(VadParams(threshold=0.5, silence_duration_ms=64, min_speech_ms=32))
    events = vad.feed([0.9, 0.4, 0.4, 0.4, 0.9])  # 0.4 >= 0.5 - 0.15: still speech
    assert [type(e) for e in events] == [VoiceStarted]


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
    kinds = [type(e) for e in events]
    assert [k for k in kinds if k in (VoiceStarted, VoiceStopped)] == [VoiceStarted, VoiceStopped]
    # pauses within the speech (speculate_after_ms) come back as speech; the last one ends the turn
    assert kinds[1:-1] == [VoicePaused, VoiceResumed] * ((len(kinds) - 3) // 2) + [VoicePaused]
    pause, stop = events[-2:]
    assert isinstance(stop, VoiceStopped)
    assert pause.at_ms - stop.audio_end_ms == pytest.approx(VadParams().speculate_after_ms, abs=32)
    assert stop.at_ms - stop.audio_end_ms == pytest.approx(VadParams().silence_duration_ms, abs=32)
    assert [type(e) for e in ServerVad(VadParams(speculate_after_ms=500)).feed(list(probs))] == [VoiceStarted, VoiceStopped]


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


def test_batched_silero_equals_each_stream_alone(speech):
    """Rows of one batched call are independent: each stream gets what it gets alone, whatever it is batched with."""
    sources = [
        np.concatenate([silence(300, 16_000), speech("hello there", 16_000), silence(600, 16_000)]),
        np.concatenate([speech("how are you today", 16_000), silence(400, 16_000)]),
        silence(900, 16_000),
    ]
    alone = []
    for pcm in sources:
        vad = SileroVad()
        alone.append(vad.process(pcm))
    streams = [SileroVad() for _ in sources]
    got = [[] for _ in sources]
    pieces = [[], [], []]
    steps = [320, 480, 160]  # ragged packet sizes: windows straddle packets differently per stream
    for k, (pcm, step) in enumerate(zip(sources, steps)):
        pieces[k] = [pcm[i : i + step] for i in range(0, pcm.size, step)]
    for tick in range(max(map(len, pieces))):
        fed = [[] for _ in sources]
        for k in range(len(sources)):
            for piece in pieces[k][tick * 2 : tick * 2 + 2]:  # two packets per tick, like a 40 ms tick
                streams[k].feed(piece)
                fed[k].append(piece.size)
        calls = run_silero(streams)
        assert calls <= 2  # one call per window round, all streams as rows
        for k, sizes in enumerate(fed):
            for n in sizes:
                assert streams[k].can_take(n)
                got[k] += streams[k].take(n)
    for k in range(len(sources)):
        assert len(got[k]) == len(alone[k]) == sources[k].size // 512
        np.testing.assert_allclose(got[k], alone[k], atol=1e-5)


def test_take_refuses_audio_whose_windows_were_not_run():
    vad = SileroVad()
    vad.feed(np.zeros(600, np.int16))
    assert vad.windows_pending == 1
    assert vad.can_take(100) and vad.take(100) == []  # completes no window: nothing to run
    assert not vad.can_take(500)
    with pytest.raises(RuntimeError, match="not been run"):
        vad.take(500)
    run_silero([vad])
    assert len(vad.take(500)) == 1


def test_deferred_session_gives_the_same_turn_as_inline(speech):
    """A session whose VAD waits for a batch produces exactly the events and engine commands of one
    that runs Silero per packet; only when they come differs, and their times are the audio's arrival."""
    pcm = np.concatenate([silence(400, 16_000), speech("hello there, how are you", 16_000), silence(900, 16_000)])
    inline, deferred = Session(), Session(vad_deferred=True)
    out = {"inline": [], "deferred": []}
    for i, start in enumerate(range(0, pcm.size, 320)):
        piece, now = pcm[start : start + 320], 100.0 + 0.02 * i
        inline.receive_audio(piece, now)
        deferred.receive_audio(piece, now)
        if i % 3 == 2:  # a batch every 60 ms
            deferred.settle_vad(run=False)  # nothing was run: only audio that completes no window settles
            run_silero([deferred.vad_stream()])
            deferred.settle_vad(run=False)
        for name, s in (("inline", inline), ("deferred", deferred)):
            out[name] += [_describe(x) for x in s.events() + s.commands()]
    deferred.settle_vad()
    out["deferred"] += [_describe(x) for x in deferred.events() + deferred.commands()]
    kinds = [d[0] for d in out["inline"]]
    assert "SpeechStarted" in kinds and "SpeechStopped" in kinds and "StartResponse" in kinds
    assert out["deferred"] == out["inline"]
    assert sum(d[0] == "PushAudio" for d in out["inline"]) > 10
    assert not deferred.vad_pending


def test_a_late_batch_answers_where_the_turn_ended_before_the_next_speech(speech):
    """A turn, its end and the next speech all wait for one late batch: the answer starts where the turn
    ended, and the speech after it barges in, in the audio's order, as in a session that runs Silero
    per packet (the answer started at the turn's end settles nothing more)."""
    talk = speech("hello there, how are you", 16_000)
    pcm = np.concatenate([silence(400, 16_000), talk, silence(900, 16_000), talk, silence(300, 16_000)])
    vad = VadParams(speculative=False)  # the turn's end starts the answer (no speculation to confirm)
    inline, deferred = Session(vad=vad), Session(vad=vad, vad_deferred=True)
    events: dict[str, list] = {"inline": [], "deferred": []}
    commands: dict[str, list] = {"inline": [], "deferred": []}
    for i, start in enumerate(range(0, pcm.size, 320)):
        piece, now = pcm[start : start + 320], 100.0 + 0.02 * i
        inline.receive_audio(piece, now)
        deferred.receive_audio(piece, now)
    deferred.settle_vad()
    for name, s in (("inline", inline), ("deferred", deferred)):
        events[name] = [_describe(x) for x in s.events()]
        commands[name] = [(type(x).__name__, x.pcm.tobytes() if isinstance(x, PushAudio) else None) for x in s.commands()]
    kinds = [d[0] for d in events["inline"]]
    # the answer to the first turn, then the second speech, which barges in on it
    assert kinds[:6] == ["SpeechStarted", "SpeechStopped", "InputCommitted", "ResponseCreated", "SpeechStarted", "ResponseDone"]
    assert events["deferred"] == events["inline"] and commands["deferred"] == commands["inline"]  # the same audio, sample for sample


def test_deferred_session_settles_before_a_commit(speech):
    """A client commit (or clear, or session.update) processes the audio that waits for the VAD first."""
    s = Session(vad_deferred=True)
    s.receive_audio(np.concatenate([speech("hello there", 16_000), silence(100, 16_000)]), 1.0)
    assert s.vad_pending and s.input_ms == 0
    s.receive_commit(2.0)
    assert not s.vad_pending and s.input_ms > 1000


def _describe(x) -> tuple:
    fields = {k: (v.size if isinstance(v, np.ndarray) else v) for k, v in vars(x).items() if not k.endswith("_id") and k != "item_id"}
    return (type(x).__name__, tuple(sorted(fields.items())))


def test_vad_batcher_waits_for_every_active_stream_or_its_period():
    # Bounds are fractions of a long period, so a loaded machine cannot blur "at once" and "waited".
    period_s = 0.6

    async def main():
        batcher = VadBatcher(period_ms=1000 * period_s)
        streams = [SileroVad() for _ in range(3)]
        done: list[int] = []

        def submit(k: int) -> None:
            streams[k].feed(np.zeros(512, np.int16))
            batcher.submit(streams[k], lambda: done.append(k))

        async def wait_done(n: int) -> float:
            t0 = time.monotonic()
            while len(done) < n:
                await asyncio.sleep(0.002)
            return time.monotonic() - t0

        submit(0)  # alone: run at once, not after the period
        assert await wait_done(1) < period_s / 2
        for k in range(3):
            submit(k)
        await wait_done(4)
        # all three are active now: a tick waits until each has submitted again
        done.clear()
        calls = batcher.calls
        submit(0)
        submit(1)
        await asyncio.sleep(period_s / 4)
        assert done == []
        submit(2)
        assert await wait_done(3) < period_s / 2
        assert sorted(done) == [0, 1, 2] and batcher.calls == calls + 1  # one call, three rows
        assert batcher.cpu_s > 0  # the model calls' CPU, which bench_gateway reports apart
        # streams that stop sending: the period bounds the wait, then they are no longer waited for
        await asyncio.sleep(0.12)  # > the 100 ms a stream counts as active
        done.clear()
        submit(0)
        assert period_s * 0.9 < await wait_done(1) < period_s * 2
        submit(0)
        assert await wait_done(2) < period_s / 2
        assert all(s.windows_pending == 0 for s in streams)

    asyncio.run(main())
