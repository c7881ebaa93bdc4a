"""The demo page shows both sides' words (Chromium headless, Playwright) against a Gateway on the fake
engine in this process: the page learns from session.created that the model writes text, asks for
input transcription, and puts the transcript of your turn and the model's text of its answer on the
page as they stream. Skipped with a reason when Chromium, playwright or espeak-ng is missing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine, answer_text, user_transcript_text
from rt_helpers import silence
from test_web_page import CHROMIUM, _write_wav, browser, shot, state  # noqa: F401 (browser: the fixture)

from realtime.config import config_from_dict
from realtime.server import Gateway

TOKEN = "page-text-token"


@pytest.fixture
def text_server(loop_thread):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); needed for the page tests")
    pytest.importorskip("playwright", reason="the playwright package is needed for the page tests (pip install playwright)")
    engine = FakeEngine(capacity=1, answer_ms=1500, step_s=0.01)
    gw = Gateway(engine, config_from_dict({"server": {"port": 0}, "vad": {"silence_duration_ms": 400},
                                           "session": {"assistant_text": True}}), token=TOKEN)
    loop_thread.run(gw.start())
    yield gw, engine
    loop_thread.run(gw.stop())


def test_the_page_shows_your_transcript_and_the_models_text(text_server, browser, speech, tmp_path):  # noqa: F811
    gw, engine = text_server
    mic = _write_wav(tmp_path / "mic.wav", np.concatenate([silence(800, 48000), speech("Hello! How are you doing today?", 48000),
                                                          silence(15_000, 48000)]))
    page = browser(mic)
    page.goto(f"http://127.0.0.1:{gw.port}/?token={TOKEN}")
    page.click("#connect")
    page.wait_for_function("window.duplex.text === true", timeout=30_000)  # learnt from session.created
    page.wait_for_function("window.duplex.userTranscripts >= 1 && window.duplex.responses >= 1", timeout=60_000)
    s = state(page)
    shot(page, "transcripts")
    conv = engine.conversation(s["sessionId"])
    h = next(h for h in conv.handles if not h.discarded)  # the answer the page got first
    assert h.options.transcribe_user  # the page asked for it
    users = page.locator("#transcript li.user").all_inner_texts()
    answers = page.locator("#transcript li.assistant").all_inner_texts()
    assert users[0] == user_transcript_text(h.user_frames), users
    assert answers[0].startswith(answer_text(conv.index, h.index)), answers  # then its figures (the .meta line)
    assert page.locator("body").get_attribute("data-text") == "true"
    page.click("#hangup")
