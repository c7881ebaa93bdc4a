"""audio.input.noise_reduction (issue 36): WebRTC's suppressor on the session's input, before the VAD and
the model. The real suppressor and the real Silero VAD on espeak-ng speech in seeded noise; session.update
parsing and its echo; a session over a real WebSocket against a Gateway on the fake engine."""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
import websockets
from fake_engine import FakeEngine
from rt_helpers import fake_gateway, silence
from test_protocol import Client

from realtime.config import config_from_dict
from realtime.noise_suppression import FRAME_SAMPLES, NoiseSuppressor
from realtime.session import PushAudio, Session, SessionLimits, SpeechStarted, SpeechStopped
from realtime.vad import WINDOW_SAMPLES, SileroVad, VadParams

SENTENCES = ("hello, can you hear me", "what is the weather like today", "please remind me to call my sister")


def _clean(speech) -> np.ndarray:
    """Three sentences, 1.5 s apart (float, at a quarter of espeak's level: the noise added fits int16)."""
    parts = [silence(1000, 16_000)]
    for text in SENTENCES:
        parts += [speech(text, 16_000), silence(1500, 16_000)]
    return 0.25 * np.concatenate(parts).astype(np.float64)


def _labels(clean: np.ndarray) -> np.ndarray:
    """Per Silero window: speech where the clean signal is within 35 dB of its loudest window."""
    n = clean.size // WINDOW_SAMPLES
    rms = np.sqrt(np.mean(clean[: n * WINDOW_SAMPLES].reshape(n, WINDOW_SAMPLES) ** 2, axis=1) + 1e-9)
    return 20 * np.log10(rms / rms.max()) > -35


def _noisy(clean: np.ndarray, snr_db: float, seed: int = 0) -> np.ndarray:
    """White noise at `snr_db` against the active speech level, from a fixed seed."""
    labels = _labels(clean)
    active = np.mean(clean[: labels.size * WINDOW_SAMPLES].reshape(labels.size, WINDOW_SAMPLES)[labels] ** 2)
    noise = np.random.default_rng(seed).standard_normal(clean.size) * np.sqrt(active / 10 ** (snr_db / 10))
    x = clean + noise
    assert np.abs(x).max() < 32767  # no clipping: the noise is what the suppressor meets, nothing else
    return x.astype(np.int16)


def _suppress(mode: str, pcm: np.ndarray, piece: int = 320) -> np.ndarray:
    ns = NoiseSuppressor(mode)
    return np.concatenate([ns.process(pcm[i : i + piece]) for i in range(0, pcm.size, piece)] + [ns.flush()])


def _vad_f1(pcm: np.ndarray, labels: np.ndarray) -> float:
    pred = np.array(SileroVad().process(pcm))[: labels.size] >= 0.5
    tp, fp, fn = np.sum(pred & labels), np.sum(pred & ~labels), np.sum(~pred & labels)
    return 2 * tp / max(1, 2 * tp + fp + fn)


@pytest.mark.parametrize("mode", ["near_field", "far_field"])
def test_the_vad_finds_speech_in_noise_with_suppression_that_it_misses_without(speech, mode):
    """White noise at -10 dB SNR: Silero alone hears almost none of the speech (F1 0.00-0.09 over seeds 0-4
    when measured), after either suppressor most of it (0.77-0.91)."""
    clean = _clean(speech)
    labels, noisy = _labels(clean), _noisy(clean, -10.0)
    without, with_ns = _vad_f1(noisy, labels), _vad_f1(_suppress(mode, noisy), labels)
    assert without < 0.3 and with_ns > 0.6 and with_ns - without > 0.4, (without, with_ns)


def _turns(pcm: np.ndarray, mode: str | None) -> tuple[int, int]:
    s = Session("sess_ns", VadParams(), SessionLimits(), noise_reduction=mode)
    events = []
    for i in range(0, pcm.size, 320):  # 20 ms frames, as clients send them
        s.receive_audio(pcm[i : i + 320], 100.0 + i / 16_000)
        events += s.events()
    return sum(isinstance(e, SpeechStarted) for e in events), sum(isinstance(e, SpeechStopped) for e in events)


def test_a_session_with_noise_reduction_turns_each_sentence_in_noise_into_a_turn(speech):
    noisy = _noisy(_clean(speech), -10.0)
    assert _turns(noisy, "near_field") == (3, 3)  # each sentence started and ended a turn
    started, _ = _turns(noisy, None)
    assert started < 3  # without it, the noise hides sentences from the VAD


def test_streaming_in_any_pieces_gives_the_same_audio_as_whole_frames(speech):
    pcm = _noisy(_clean(speech), 0.0)[: 16_000 * 3]
    whole = _suppress("far_field", pcm, piece=FRAME_SAMPLES * 2)
    for piece in (1, 37, 160, 333, 480, 1000):
        ns, out = NoiseSuppressor("far_field"), []
        for i in range(0, pcm.size, piece):
            out.append(ns.process(pcm[i : i + piece]))
            assert ns.held_samples < FRAME_SAMPLES
        np.testing.assert_array_equal(np.concatenate(out + [ns.flush()]), whole)
    assert whole.size == pcm.size and not np.array_equal(whole, pcm)


def test_flush_returns_exactly_the_held_samples():
    ns = NoiseSuppressor("near_field")
    out = ns.process(np.full(250, 1000, np.int16))
    assert out.size == FRAME_SAMPLES and ns.held_samples == 90
    assert ns.flush().size == 90 and ns.held_samples == 0 and ns.flush().size == 0
    with pytest.raises(ValueError, match="near_field, far_field"):
        NoiseSuppressor("studio")


def test_a_committed_turn_carries_every_sample_and_noise_reduction_can_be_turned_off(speech):
    pcm = _noisy(_clean(speech), 5.0)[:15_990]  # not whole 10 ms frames: a tail is held at the end
    s = Session("sess_ns", None, SessionLimits(), noise_reduction="near_field")
    for i in range(0, pcm.size, 333):
        s.receive_audio(pcm[i : i + 333], 100.0)
    s.receive_commit(100.0)
    pushed = [c.pcm for c in s.commands() if isinstance(c, PushAudio)]
    assert sum(p.size for p in pushed) == pcm.size  # the suppressor's held tail is the turn's, flushed at commit
    assert not np.array_equal(np.concatenate(pushed), pcm)
    s.set_noise_reduction(None)
    assert s.noise_reduction is None
    s.receive_audio(pcm[:320], 101.0)
    s.receive_commit(101.0)
    np.testing.assert_array_equal([c.pcm for c in s.commands() if isinstance(c, PushAudio)][0], pcm[:320])


# ---- session.update: parsing, the session's suppressor, the echo ----

def _noise_reduction(c: Client) -> dict | None:
    return c.sent[-1]["session"]["audio"]["input"]["noise_reduction"]


def test_session_update_turns_noise_reduction_on_and_off_and_echoes_it():
    c = Client(extensions=False)
    assert _noise_reduction(c) is None and c.session.noise_reduction is None
    c.send({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"noise_reduction": {"type": "near_field"}}}}})
    assert c.errors() == [] and c.sent[-1]["type"] == "session.updated"
    assert _noise_reduction(c) == {"type": "near_field"} and c.session.noise_reduction == "near_field"
    c.send({"type": "session.update", "session": {"input_audio_noise_reduction": {"type": "far_field"}}})  # the beta spelling
    assert _noise_reduction(c) == {"type": "far_field"} and c.session.noise_reduction == "far_field"
    c.send({"type": "session.update", "session": {"audio": {"input": {"noise_reduction": {}}}}})  # no type: the current one
    assert _noise_reduction(c) == {"type": "far_field"} and c.session.noise_reduction == "far_field"
    c.send({"type": "session.update", "session": {"audio": {"input": {"noise_reduction": None}}}})
    assert _noise_reduction(c) is None and c.session.noise_reduction is None
    assert c.errors() == []


@pytest.mark.parametrize("value,param", [
    ({"type": "studio"}, "session.audio.input.noise_reduction.type"),
    ({"type": 3}, "session.audio.input.noise_reduction.type"),
    ("near_field", "session.audio.input.noise_reduction"),
    ({"type": "near_field", "level": 2}, "session.audio.input.noise_reduction.level"),
    ({"type": "near_field", "strength": 0.3}, "session.audio.input.noise_reduction.strength"),
])
def test_a_bad_noise_reduction_is_an_error_naming_the_field_and_the_session_goes_on(speech, value, param):
    c = Client(extensions=False)
    c.send({"type": "session.update", "session": {"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}})
    c.take()
    c.send({"type": "session.update", "event_id": "u1", "session": {"instructions": "be brief",
                                                                      "audio": {"input": {"noise_reduction": value}}}})
    errs = c.errors()
    assert len(errs) == 1 and errs[0]["param"] == param and errs[0]["event_id"] == "u1"
    assert param.rsplit(".", 1)[-1] in errs[0]["message"]
    # the valid fields applied, the noise reduction as it was
    assert c.sent[-1]["session"]["instructions"] == "be brief" and _noise_reduction(c) == {"type": "near_field"}
    assert c.session.noise_reduction == "near_field"
    c.append_pcm24(np.concatenate([silence(300, 24_000), speech("hello, can you hear me", 24_000), silence(700, 24_000)]))
    assert "response.created" in c.types()  # and it still hears a turn


def test_the_server_config_sets_the_default_of_new_sessions():
    cfg = config_from_dict({"session": {"noise_reduction": "far_field"}})
    assert cfg.session.noise_reduction == "far_field"
    with pytest.raises(ValueError, match="session.noise_reduction"):
        config_from_dict({"session": {"noise_reduction": "loud"}})


def test_a_gateway_session_with_near_field_turns_noisy_speech_into_a_turn(speech):
    """Over a real WebSocket: a Gateway (fake engine) whose config says far_field; the client asks for
    near_field, then streams speech in white noise at 5 dB SNR as pcm16 at 24 kHz."""
    utt = speech("hello, can you hear me", 24_000).astype(np.float64) * 0.5
    noise = np.random.default_rng(1).standard_normal(utt.size) * np.sqrt(np.mean(utt**2) / 10 ** 0.5)
    pcm = np.concatenate([silence(400, 24_000), (utt + noise).astype(np.int16), silence(900, 24_000)])

    async def main():
        async with fake_gateway(FakeEngine(answer_ms=400), {"session": {"noise_reduction": "far_field"}}, "t") as gw:
            async with websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime?token=t") as ws:
                seen: list[dict] = []

                async def until(kind: str) -> dict:
                    while True:
                        ev = json.loads(await ws.recv())
                        seen.append(ev)
                        if ev["type"] == kind:
                            return ev

                created = await until("session.created")
                assert created["session"]["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
                await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {
                    "noise_reduction": {"type": "near_field"}}}}}))
                updated = await until("session.updated")
                assert updated["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
                runner = next(iter(gw.admission.sessions.values()))
                for i in range(0, pcm.size, 480):  # 20 ms appends, faster than real time (within the input budget)
                    await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm[i : i + 480].astype("<i2").tobytes()).decode()}))
                await until("input_audio_buffer.speech_started")
                assert runner.session.noise_reduction == "near_field"
                await until("input_audio_buffer.committed")
                done = await until("response.done")
                assert done["response"]["status"] == "completed"
                assert [e for e in seen if e["type"] == "error"] == []

    asyncio.run(asyncio.wait_for(main(), 30))
