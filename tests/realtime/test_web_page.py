"""The demo page in Debian's Chromium (headless, driven by Playwright) against a real `duplex serve`.

Chromium's fake microphone plays a WAV made with espeak-ng. Screenshots are saved under
`artifacts/web/` (override with DUPLEX_ARTIFACTS). Skipped with a reason when Chromium or the
playwright package is missing (scripts/install.sh --system installs both).
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest
from rt_helpers import silence

from realtime.soak.server_process import ServerProcess

pytestmark = pytest.mark.vllm

CHROMIUM = "/usr/bin/chromium"
TOKEN = "page-token"
ARTIFACTS = Path(os.environ.get("DUPLEX_ARTIFACTS", Path(__file__).resolve().parents[2] / "artifacts")) / "web"


def _write_wav(path: Path, pcm48: np.ndarray) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(48000)
        w.writeframes(pcm48.astype("<i2").tobytes())
    return path


class Server(ServerProcess):
    """`duplex serve` in a subprocess (the soak's), with what the page tests ask of it."""

    def health(self) -> dict:
        from realtime.soak.server_process import health

        return health(self.base)  # (503 at capacity: max_sessions 1 here)

    def wait_sessions(self, n: int, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while (got := self.health()["sessions"]) != n and time.monotonic() < deadline:
            time.sleep(0.2)
        return got


@pytest.fixture(scope="module")
def server(tiny_model):
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); needed for the page tests")
    pytest.importorskip("playwright", reason="the playwright package is needed for the page tests (pip install playwright)")
    srv = Server({
        "limits": {"max_sessions": 1},
        "vad": {"silence_duration_ms": 400},
        "session": {"max_response_ms": 3000.0, "temperature": 0.0},
    }, TOKEN)
    yield srv
    assert srv.stop() == 0, srv.log_tail()  # SIGTERM: a clean shutdown exits 0


@pytest.fixture
def browser(tmp_path):
    """A factory: browser(mic_wav) -> a fresh Chromium profile with that WAV as its microphone."""
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    contexts = []

    def launch(mic: Path | None, viewport=(900, 860), extra_args: tuple[str, ...] = (), **options):
        """`extra_args`: more Chromium flags; `options`: Playwright's context options (ignore_https_errors ...)."""
        args = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--use-fake-ui-for-media-stream",
                "--use-fake-device-for-media-stream", "--autoplay-policy=no-user-gesture-required", *extra_args]
        if mic is not None:
            args.append(f"--use-file-for-fake-audio-capture={mic}%noloop")
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / f"profile{len(contexts)}"), executable_path=CHROMIUM,
                                                    headless=True, args=args, viewport={"width": viewport[0], "height": viewport[1]},
                                                    **options)
        contexts.append(ctx)
        return ctx.pages[0] if ctx.pages else ctx.new_page()

    yield launch
    for ctx in contexts:
        ctx.close()
    pw.stop()


def state(page) -> dict:
    return page.evaluate("() => JSON.parse(JSON.stringify(window.duplex))")


def shot(page, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def test_page_holds_a_conversation(server, browser, speech, tmp_path):
    mic = _write_wav(tmp_path / "mic.wav", np.concatenate([silence(800, 48000), speech("Hello! How are you doing today?", 48000),
                                                          silence(12_000, 48000)]))
    page = browser(mic)
    page.goto(f"{server.base}/?token={TOKEN}")
    assert page.locator("#state").inner_text() == "not connected"
    page.click("#connect")
    page.wait_for_function("window.duplex.turns >= 1", timeout=60_000)  # the server's VAD heard the speech
    page.wait_for_function("window.duplex.state === 'answering'", timeout=60_000)
    # the answer's audio arrives over RTP: inbound bytes grow while it plays (a fixed total, as this test
    # once waited for, depends on how long the answer and the time before it were)
    before = page.evaluate("() => window.duplex.bytesIn")
    shot(page, "mid-conversation")
    page.wait_for_function("window.duplex.responses >= 1", timeout=90_000)
    page.wait_for_function(f"window.duplex.bytesIn > {before} + 2000", timeout=5_000)  # getStats polled every 500 ms
    s = state(page)
    shot(page, "after-answer")
    assert s["responses"] >= 1 and s["lastResponse"]["status"] == "completed"
    assert s["bytesIn"] > 0 and s["framesIn"] > 0  # inbound RTP, from getStats()
    assert s["lastTtfaMs"] is not None and s["lastTtfaMs"] > 0
    assert page.locator("body").get_attribute("data-responses") == str(s["responses"])
    assert page.locator("#ttfa").inner_text().endswith("ms")
    assert server.health()["sessions"] == 1
    page.click("#hangup")
    assert page.locator("#state").inner_text() == "not connected"
    assert server.wait_sessions(0) == 0  # hang-up frees the session and its peer connection


def test_page_interrupting_the_answer_clears_it(server, browser, speech, tmp_path):
    assert server.wait_sessions(0) == 0
    # Utterances after growing pauses: whatever the machine's time to first audio, one of them starts
    # while an answer is playing (an answer cut before its first audio is not "cleared").
    parts = [silence(800, 48000)]
    for text, pause_ms in (("Please tell me a long story about the sea.", 1700), ("Wait, stop, stop.", 3000),
                           ("No, go on please.", 5000), ("Hold on a moment.", 7000), ("Stop there.", 8000)):
        parts += [speech(text, 48000), silence(pause_ms, 48000)]
    mic = _write_wav(tmp_path / "mic.wav", np.concatenate(parts))
    page = browser(mic, viewport=(390, 844))  # a phone-sized screen
    page.goto(f"{server.base}/?token={TOKEN}")
    page.click("#connect")
    page.wait_for_function("window.duplex.cleared >= 1", timeout=120_000)
    s = state(page)
    shot(page, "interrupted-phone")
    assert s["interruptions"] >= 1
    assert s["lastResponse"] is None or s["lastResponse"]["status"] in ("cancelled", "completed")
    page.wait_for_function("window.duplex.lastResponse && window.duplex.lastResponse.reason === 'turn_detected'", timeout=30_000)
    assert page.locator("#transcript li.cut").count() >= 1
    page.click("#hangup")
    assert server.wait_sessions(0) == 0


def test_page_explains_a_bad_token_and_a_full_server(server, browser, tmp_path):
    import websockets.sync.client as ws_client

    assert server.wait_sessions(0) == 0
    mic = _write_wav(tmp_path / "quiet.wav", silence(2000, 48000))
    page = browser(mic)
    page.goto(f"{server.base}/?token=wrong-token")
    page.click("#connect")
    page.wait_for_function("window.duplex.error && window.duplex.error.code === 'bad_token'", timeout=30_000)
    assert "token" in page.locator("#error-text").inner_text()
    assert page.locator("#error").is_visible() and page.locator("#settings").get_attribute("open") is not None
    shot(page, "bad-token")

    # The server holds one session; a WebSocket client takes it, so the page's call is refused.
    port = server.base.rsplit(":", 1)[1]
    with ws_client.connect(f"ws://127.0.0.1:{port}/v1/realtime?token={TOKEN}") as ws:
        json.loads(ws.recv())  # session.created
        page.fill("#token", TOKEN)
        page.click("#save")
        page.click("#retry")
        page.wait_for_function("window.duplex.error && window.duplex.error.code === 'server_at_capacity'", timeout=30_000)
        assert "capacity" in page.locator("#error-text").inner_text()
        shot(page, "at-capacity")
    assert server.wait_sessions(0) == 0
    page.click("#retry")  # the slot is free again: the retry connects
    page.wait_for_function("window.duplex.state === 'listening'", timeout=30_000)
    assert state(page)["error"] is None
    assert server.health()["sessions"] == 1
    page.close()  # the tab goes away without hanging up: the server still frees the call
    assert server.wait_sessions(0) == 0


def test_page_reports_a_refused_microphone(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # no fake-UI flag and a denied permission: getUserMedia fails as when a user clicks "Block"
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / "p"), executable_path=CHROMIUM, headless=True,
                                                    args=["--no-sandbox", "--disable-gpu", "--use-fake-device-for-media-stream",
                                                          "--deny-permission-prompts"])
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        page.goto(f"{server.base}/?token={TOKEN}")
        page.click("#connect")
        page.wait_for_function("window.duplex.error !== null", timeout=30_000)
        code, text = state(page)["error"]["code"], page.locator("#error-text").inner_text()
        ctx.close()
    assert code == "microphone_refused", text
    assert "microphone" in text.lower()


# ---- the page's key: the server token traded for a client key (ek_) on load -----------------------------

def _requests(page, path: str) -> list:
    """The page's requests to `path`, as they are made (their headers are read afterwards)."""
    seen: list = []
    page.on("request", lambda r: seen.append(r) if r.url.split("?")[0].endswith(path) else None)
    return seen


def _mint(server: Server, token: str, body: dict) -> tuple[int, dict]:
    """POST /v1/realtime/client_secrets as an operator would (curl): (status, JSON body)."""
    import urllib.error

    req = urllib.request.Request(f"{server.base}/v1/realtime/client_secrets", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stored(page) -> str:
    """Everything the page could have kept: its storage, its cookies, its DOM (inputs' values included)."""
    return page.evaluate("""() => JSON.stringify([{...localStorage}, {...sessionStorage}, document.cookie,
        document.documentElement.outerHTML, [...document.querySelectorAll('input, textarea')].map((e) => e.value)])""")


def test_page_trades_the_token_for_a_key_and_calls_with_it(server, browser, speech, tmp_path):
    assert server.wait_sessions(0) == 0
    mic = _write_wav(tmp_path / "mic.wav", np.concatenate([silence(800, 48000), speech("Hello! How are you doing today?", 48000),
                                                          silence(12_000, 48000)]))
    page = browser(mic)
    mints, offers = _requests(page, "/v1/realtime/client_secrets"), _requests(page, "/v1/realtime/calls")
    page.goto(f"{server.base}/?lang=en&token={TOKEN}#top")
    page.wait_for_function("window.duplex.key === 'ready'", timeout=30_000)
    href = page.evaluate("() => location.href")
    assert TOKEN not in href and "token" not in href, href  # gone from the address bar at once
    assert href == f"{server.base}/?lang=en#top"  # the rest of the address stays
    assert TOKEN not in _stored(page)
    (mint,) = mints
    assert mint.method == "POST" and mint.all_headers()["authorization"] == f"Bearer {TOKEN}"
    assert json.loads(mint.post_data or "{}") == {"expires_after": {"anchor": "created_at", "seconds": 7200}}
    s = state(page)
    assert s["keyExpiresAt"] is not None and s["keyExpiresAt"] / 1000 > time.time() + 7000  # the lifetime asked for

    page.click("#connect")
    page.wait_for_function("window.duplex.responses >= 1", timeout=120_000)
    s = state(page)
    assert s["lastResponse"]["status"] == "completed" and s["bytesIn"] > 0
    (offer,) = offers  # the server answered this offer: it took the key
    auth = offer.all_headers()["authorization"]
    assert auth.startswith("Bearer ek_") and TOKEN not in auth
    assert TOKEN not in _stored(page) and TOKEN not in page.evaluate("() => location.href")
    page.click("#hangup")
    assert server.wait_sessions(0) == 0


def test_page_shows_why_the_token_was_refused(server, browser, tmp_path):
    status, refusal = _mint(server, "wrong-token", {})
    assert status == 401 and refusal["error"]["code"] == "invalid_api_key", refusal
    page = browser(_write_wav(tmp_path / "quiet.wav", silence(2000, 48000)))
    offers = _requests(page, "/v1/realtime/calls")
    page.goto(f"{server.base}/?token=wrong-token")
    page.wait_for_function("window.duplex.key === 'refused'", timeout=30_000)
    assert "wrong-token" not in page.evaluate("() => location.href")
    assert state(page)["error"]["code"] == "bad_token"
    text = page.locator("#error-text").inner_text()
    assert refusal["error"]["message"].rstrip(". ") in text and "duplex serve" in text, text  # the server's own words, then what to do
    assert page.locator("#error").is_visible() and page.locator("#settings").get_attribute("open") is not None
    shot(page, "token-refused")
    page.click("#connect")  # no key: the page says so again, and calls no one
    page.wait_for_function("window.duplex.state === 'error'", timeout=30_000)
    assert state(page)["error"]["code"] == "bad_token" and offers == []


def test_page_with_an_expired_key_says_so_without_calling(server, browser, tmp_path):
    status, minted = _mint(server, TOKEN, {"expires_after": {"anchor": "created_at", "seconds": 10}})
    assert status == 200 and minted["value"].startswith("ek_"), minted
    time.sleep(max(0.0, minted["expires_at"] - time.time() + 1))  # the shortest key the server grants, run out
    page = browser(_write_wav(tmp_path / "quiet.wav", silence(2000, 48000)))
    offers = _requests(page, "/v1/realtime/calls")
    page.goto(f"{server.base}/?key={minted['value']}")
    page.wait_for_function("window.duplex.key === 'expired'", timeout=30_000)
    assert "ek_" not in page.evaluate("() => location.href")
    text = page.locator("#error-text").inner_text()
    assert "key expired" in text and "open the link printed by `duplex serve` again" in text, text
    shot(page, "key-expired")
    page.click("#connect")
    page.wait_for_function("window.duplex.state === 'error'", timeout=30_000)
    assert state(page)["error"]["code"] == "key_expired" and offers == []  # no call tried with it


def test_page_over_https_from_another_machine(loop_thread, browser, speech, tmp_path):
    """The README's recipe: a self-signed certificate made by its openssl line, the gateway on it, and the page
    opened by a name that is not localhost (Chromium maps it to 127.0.0.1), so only https:// gives it the
    microphone. The browser's warning about the certificate is accepted (ignore_https_errors), as a user
    clicks through it. The gateway runs on the fake engine: what is tested is the page's way in."""
    import shutil
    import subprocess

    from fake_engine import FakeEngine

    from realtime.config import config_from_dict
    from realtime.server import Gateway

    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); needed for the page tests")
    pytest.importorskip("playwright", reason="the playwright package is needed for the page tests (pip install playwright)")
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed; it makes the certificate, as the README tells a user to")
    host = "duplex-demo.test"  # (.test: reserved, never a real machine's name)
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "30", "-keyout", "key.pem",
                    "-out", "cert.pem", "-subj", "/CN=duplex demo", "-addext", f"subjectAltName=DNS:{host},DNS:localhost"],
                   cwd=tmp_path, check=True, capture_output=True)
    engine = FakeEngine(capacity=1, answer_ms=1500, step_s=0.01)
    gw = Gateway(engine, config_from_dict({"server": {"port": 0, "tls_cert": str(tmp_path / "cert.pem"),
                                                      "tls_key": str(tmp_path / "key.pem")},
                                           "vad": {"silence_duration_ms": 400}}), token=TOKEN)
    loop_thread.run(gw.start())
    try:
        mic = _write_wav(tmp_path / "mic.wav", np.concatenate([silence(800, 48000), speech("Hello! Can you hear me?", 48000),
                                                              silence(10_000, 48000)]))
        page = browser(mic, extra_args=(f"--host-resolver-rules=MAP {host} 127.0.0.1",), ignore_https_errors=True)
        mints, offers = _requests(page, "/v1/realtime/client_secrets"), _requests(page, "/v1/realtime/calls")
        page.goto(f"https://{host}:{gw.port}/?token={TOKEN}")
        page.wait_for_function("window.duplex.key === 'ready'", timeout=30_000)
        assert page.evaluate("() => window.isSecureContext")  # what the microphone needs, away from localhost
        assert page.evaluate("() => location.href") == f"https://{host}:{gw.port}/"
        page.click("#connect")
        page.wait_for_function("window.duplex.responses >= 1", timeout=60_000)
        s = state(page)
        assert s["error"] is None and s["bytesIn"] > 0, s
        assert [m.url.split("://")[0] for m in mints] == ["https"]
        (offer,) = offers
        assert offer.url.startswith("https://") and offer.all_headers()["authorization"].startswith("Bearer ek_")
        assert TOKEN not in _stored(page)
        shot(page, "https-another-machine")
        page.click("#hangup")
    finally:
        loop_thread.run(gw.stop())
