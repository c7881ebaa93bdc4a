"""Stock clients as a web app and a Node app use them, against a real Gateway on 127.0.0.1 (issue 35, item 8).

- The OpenAI Agents SDK for JavaScript (`@openai/agents-realtime`, its browser bundle, tests/js) in Debian's
  Chromium (headless, driven by Playwright), in a page (tests/js/agents_browser.html) served from ANOTHER
  origin than the gateway's (a static server on another port): the page gets an ephemeral key (`ek_...`)
  the test mints with the server token, never the token itself. Over WebRTC (the SDK's browser default:
  its calls POST crosses origins, so CORS preflights are real) and over the browser WebSocket (its
  authentication is the subprotocols `realtime, openai-insecure-api-key.<key>`). Chromium's fake microphone
  plays espeak-ng speech; the gateway's VAD hears it, the answer's audio reaches the page (WebRTC: the remote
  track's inbound RTP carries audio energy; WebSocket: non-silent pcm16 `audio` events). No page error, no
  console error (a CORS refusal is one), no failed request, the server token in no request.
- The `openai` npm package's `OpenAIRealtimeWS` in Node over wss:// against a gateway serving TLS with a
  certificate the test makes (a CA and a server certificate for 127.0.0.1/localhost, `cryptography`), trusted
  through NODE_EXTRA_CA_CERTS.

All in front of the fake engine (tests/realtime/fake_engine.py): what is tested is the gateway's HTTP shell
and the clients' transports; the answers' audio is the fake's sawtooth, never silent. Skipped with a reason
when Chromium, playwright, Node or tests/js is missing (scripts/install.sh installs them).
"""

from __future__ import annotations

import datetime
import functools
import http.server
import ipaddress
import json
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_engine import FakeEngine
from rt_helpers import silence

from realtime.config import config_from_dict
from realtime.server import Gateway

CHROMIUM = "/usr/bin/chromium"
TOKEN = "browser-clients-token"
JS_DIR = Path(__file__).resolve().parents[1] / "js"  # tests/js: package.json, the page, the scripts
BUNDLE = JS_DIR / "node_modules" / "@openai" / "agents-realtime" / "dist" / "bundle"
FAKE_ANSWER_MS = 1500
KEY_INSTRUCTIONS = "You are the browser test's assistant."  # the minted key's session: session.created shows it
SENTENCE = "Hello there! What is the weather like today?"
TURN_TIMEOUT_MS = 40_000


# ---------------------------------------------------------------- the gateway and what it is asked over HTTP


def _request(url: str, *, method: str = "GET", body: dict | None = None, token: str | None = TOKEN,
             context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    """One request: (status, JSON body)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, method=method, headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=10, context=context) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as e:
        raw = e.read()
        return e.code, json.loads(raw) if raw else {}


def mint(base: str, context: ssl.SSLContext | None = None) -> str:
    """An ephemeral key for a browser, as an app's backend mints one (OpenAI's GA request)."""
    before = time.time()
    status, body = _request(f"{base}/v1/realtime/client_secrets", method="POST", context=context, body={
        "expires_after": {"anchor": "created_at", "seconds": 600},
        "session": {"type": "realtime", "instructions": KEY_INSTRUCTIONS},
    })
    assert status == 200, body
    assert body["value"].startswith("ek_") and TOKEN not in body["value"], body
    assert before + 600 - 5 <= body["expires_at"] <= time.time() + 600 + 5, body
    assert body["session"]["instructions"] == KEY_INSTRUCTIONS, body
    return body["value"]


def wait_sessions(gw: Gateway, n: int, timeout: float = 15) -> int:
    deadline = time.monotonic() + timeout
    while len(gw.sessions) != n and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(gw.sessions)


@pytest.fixture(scope="module")
def gateway(loop_thread) -> Iterator[Gateway]:
    """Plain http/ws: the page's origin differs by its port (and 127.0.0.1 is a secure context to Chromium)."""
    gw = Gateway(FakeEngine(capacity=2, answer_ms=FAKE_ANSWER_MS), config_from_dict({"server": {"port": 0}}),
                 token=TOKEN)
    loop_thread.run(gw.start())
    try:
        yield gw
    finally:
        loop_thread.run(gw.stop())


# ---------------------------------------------------------------- the page's own origin


class _Files(http.server.BaseHTTPRequestHandler):
    """GET of the page and of the SDK's browser bundle; nothing else."""

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/agents_browser.html":
            file, kind = JS_DIR / "agents_browser.html", "text/html; charset=utf-8"
        elif path.startswith("/bundle/") and "/" not in path[len("/bundle/"):] and path.endswith(".mjs"):
            file, kind = BUNDLE / path[len("/bundle/"):], "text/javascript"
        else:
            file, kind = None, ""
        if file is None or not file.is_file():
            self.send_error(404)
            return
        data = file.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:  # quiet
        pass


@pytest.fixture(scope="module")
def page_origin() -> Iterator[str]:
    """A static server on another port of 127.0.0.1: the web app's origin."""
    if not BUNDLE.is_dir():
        pytest.skip("tests/js is not installed: run scripts/install.sh (it runs `npm ci` in tests/js)")
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join()


# ---------------------------------------------------------------- Chromium


class Tab:
    """A Chromium page and what went wrong in it: page errors, console errors, failed requests; and every
    request it made (to check that the server token is in none)."""

    def __init__(self, page) -> None:
        self.page = page
        self.problems: list[str] = []
        self.requests: list = []  # playwright Requests: their headers are read once the page is done
        page.on("pageerror", lambda e: self.problems.append(f"pageerror: {e}"))
        page.on("console", lambda m: self.problems.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
        page.on("requestfailed", lambda r: self.problems.append(f"requestfailed: {r.method} {r.url}: {r.failure}"))
        page.on("request", lambda r: self.requests.append(r))

    def sent(self) -> list[str]:
        """Every request the page made, as text: method, URL, all headers (Authorization too), body."""
        return [f"{r.method} {r.url} {json.dumps(r.all_headers())} {r.post_data or ''}" for r in self.requests]

    def state(self) -> dict:
        return self.page.evaluate("() => JSON.parse(JSON.stringify(window.agents))")

    def wait(self, condition: str, timeout_ms: int = TURN_TIMEOUT_MS) -> dict:
        """Waits for `condition` (JavaScript, over `a` = window.agents); the state, or a failure showing it."""
        from playwright.sync_api import TimeoutError as PlaywrightTimeout

        try:
            self.page.wait_for_function(f"() => {{ const a = window.agents; return {condition}; }}", timeout=timeout_ms)
        except PlaywrightTimeout:
            raise AssertionError(f"timed out waiting for {condition}: {self.state()}, problems: {self.problems}") from None
        return self.state()


@pytest.fixture
def chromium(tmp_path, speech):
    """A fresh Chromium profile whose fake microphone says SENTENCE once (then silence): the Tab."""
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium); needed for the browser tests")
    pytest.importorskip("playwright", reason="the playwright package is needed for the browser tests (pip install playwright)")
    from playwright.sync_api import sync_playwright

    mic = tmp_path / "mic.wav"
    with wave.open(str(mic), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(48000)
        pcm = np.concatenate([silence(800, 48000), speech(SENTENCE, 48000), silence(10_000, 48000)])
        w.writeframes(pcm.astype("<i2").tobytes())
    args = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--use-fake-ui-for-media-stream",
            "--use-fake-device-for-media-stream", "--autoplay-policy=no-user-gesture-required",
            f"--use-file-for-fake-audio-capture={mic}%noloop"]
    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
                                                    args=args)
        try:
            yield Tab(ctx.pages[0] if ctx.pages else ctx.new_page())
        finally:
            ctx.close()


def open_page(tab: Tab, origin: str) -> None:
    tab.page.goto(f"{origin}/agents_browser.html")
    tab.wait("a.status === 'ready'", 15_000)  # the module loaded: the SDK's bundle imported without error


def assert_clean(tab: Tab, state: dict) -> None:
    """No page error, no console error (a CORS refusal is one), no failed request, no SDK error, no error
    event from the server; the server token in no request the page made."""
    assert tab.problems == [] and state["errors"] == [], (tab.problems, state["errors"])
    assert [e for e, _ in state["events"] if e == "error"] == [], state["events"]
    assert not [r for r in tab.sent() if TOKEN in r], "the page sent the server token"


def start_session(chromium, page_origin, transport: str, url: str, key: str) -> dict:
    """The test page (on its own origin) starts the SDK's session over `transport` with only `key`; its state once connected."""
    open_page(chromium, page_origin)
    chromium.page.evaluate("(o) => { window.startSession(o); }", {"transport": transport, "url": url, "key": key})
    s = chromium.wait("a.status !== 'connecting'", 20_000)
    assert s["status"] == "connected", (s, chromium.problems)
    return s


def test_agents_sdk_in_chromium_over_webrtc_from_another_origin_with_an_ephemeral_key(gateway, page_origin, chromium):
    """The SDK's browser default (`OpenAIRealtimeWebRTC`) with `ek_`: a spoken turn answered with audio heard
    on the remote track; the call's id (the answer's Location header, readable across origins) lets the
    app's backend hang up, which ends the session."""
    base = f"http://127.0.0.1:{gateway.port}"
    key = mint(base)
    s = start_session(chromium, page_origin, "webrtc", f"{base}/v1/realtime/calls", key)
    assert s["sessionCreated"]["instructions"] == KEY_INSTRUCTIONS  # the key's session config, applied
    s = chromium.wait("a.events.some(([t, st]) => t === 'response.done' && st === 'completed')")
    # heard: the remote track's decoded audio has energy (Chromium plays it into the page's <audio>); the
    # gateway's RTP before the answer is silence (energy 0), the fake's sawtooth adds ~0.3 a second
    s = chromium.wait("a.rtp && a.rtp.totalAudioEnergy > 0.1 && a.assistantMessages >= 1", 10_000)
    kinds = [k for k, _ in s["events"]]
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.created")  # the fake mic's speech
    assert "output_audio_buffer.started" in kinds, kinds
    assert_clean(chromium, s)
    assert any(f"Bearer {key}" in r for r in chromium.sent())  # (what the token check reads: Authorization too)
    assert wait_sessions(gateway, 1) == 1
    assert s["callId"], "the SDK found no call id: the calls answer's Location header is not exposed to the page"
    status, body = _request(f"{base}/v1/realtime/calls/{s['callId']}/hangup", method="POST")
    assert status == 200, (status, body)
    assert wait_sessions(gateway, 0) == 0
    chromium.page.evaluate("() => window.closeSession()")
    assert_clean(chromium, chromium.state())


def test_agents_sdk_in_chromium_over_the_browser_websocket_with_an_ephemeral_key(gateway, page_origin, chromium):
    """`OpenAIRealtimeWebSocket` in a browser: the key in the subprotocols (the server selects `realtime`,
    else Chromium fails the connection); the page streams the microphone as pcm16: a spoken turn answered
    with non-silent audio."""
    assert wait_sessions(gateway, 0) == 0
    key = mint(f"http://127.0.0.1:{gateway.port}")
    s = start_session(chromium, page_origin, "websocket", f"ws://127.0.0.1:{gateway.port}/v1/realtime", key)
    s = chromium.wait("a.sessionCreated !== null", 10_000)  # (this transport's connect() ends at the socket's open)
    assert s["wsProtocol"] == "realtime"  # of `realtime, openai-insecure-api-key.<key>, openai-agents-sdk.<version>`
    assert s["sessionCreated"]["instructions"] == KEY_INSTRUCTIONS
    s = chromium.wait("a.events.some(([t, st]) => t === 'response.done' && st === 'completed')")
    kinds = [k for k, _ in s["events"]]
    assert s["micChunks"] > 0 and kinds.index("input_audio_buffer.speech_started") < kinds.index("response.created")
    # all of the fake engine's answer, and not silence
    assert s["audioBytes"] == FAKE_ANSWER_MS * 48 and s["audioPeak"] > 1000, s
    assert s["assistantMessages"] >= 1
    assert_clean(chromium, s)
    assert wait_sessions(gateway, 1) == 1
    chromium.page.evaluate("() => window.closeSession()")
    assert wait_sessions(gateway, 0) == 0
    assert_clean(chromium, chromium.state())


# ---------------------------------------------------------------- the openai npm package over wss://


def make_certificates(d: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signs for 127.0.0.1 and localhost: (ca.pem, server.pem, server.key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def builder(subject: str, issuer: str, public_key):
        return (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                .public_key(public_key).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))

    usage = functools.partial(x509.KeyUsage, content_commitment=False, key_encipherment=False, data_encipherment=False,
                              key_agreement=False, encipher_only=False, decipher_only=False)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (builder("duplex test CA", "duplex test CA", ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(usage(digital_signature=True, key_cert_sign=True, crl_sign=True), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (builder("127.0.0.1", "duplex test CA", key.public_key())
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage(digital_signature=True, key_cert_sign=False, crl_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    paths = d / "ca.pem", d / "server.pem", d / "server.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return paths


def test_openai_npm_realtime_ws_in_node_over_wss_with_the_gateways_certificate(loop_thread, tmp_path):
    """`duplex serve --tls-cert/--tls-key` as config (`server.tls_cert`/`server.tls_key`): https (a key minted
    over it, the CA verified) and wss on one port; the openai package's `OpenAIRealtimeWS` (always wss://)
    holds a session.update and a response with audio. Without the CA Node refuses the certificate: the
    client really verifies TLS."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed (Node 20+; scripts/install.sh --system); needed for the openai npm client")
    assert (JS_DIR / "node_modules" / "openai").is_dir(), "tests/js is not installed: run scripts/install.sh"
    pytest.importorskip("cryptography", reason="the cryptography package makes the test's certificates")
    ca, cert, key = make_certificates(tmp_path)
    gw = Gateway(FakeEngine(capacity=2, answer_ms=FAKE_ANSWER_MS),
                 config_from_dict({"server": {"port": 0, "tls_cert": str(cert), "tls_key": str(key)}}), token=TOKEN)
    loop_thread.run(gw.start())
    try:
        base = f"https://127.0.0.1:{gw.port}"
        mint(base, context=ssl.create_default_context(cafile=str(ca)))  # https on the port, the certificate verified

        def run(extra_env: dict) -> tuple[int, dict, str]:
            proc = subprocess.run([node, str(JS_DIR / "openai_ws_tls.mjs"), f"{base}/v1", TOKEN], cwd=JS_DIR,
                                  capture_output=True, text=True, timeout=40,
                                  env={"PATH": str(Path(node).parent), "DUPLEX_JS_TIMEOUT_MS": "30000", **extra_env})
            lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            return proc.returncode, lines[-1]["summary"] if lines else {}, proc.stderr

        rc, summary, stderr = run({})  # Node's own CAs only: the test CA is unknown to it
        assert rc == 1 and summary["events"] == [] and summary["errors"], (rc, summary, stderr[-2000:])
        assert "certificate" in " ".join(summary["errors"]).lower(), summary["errors"]

        rc, summary, stderr = run({"NODE_EXTRA_CA_CERTS": str(ca)})
        assert rc == 0, (rc, summary, stderr[-2000:])
        assert summary["url"].startswith(f"wss://127.0.0.1:{gw.port}/v1/realtime"), summary["url"]
        assert summary["errors"] == [] and summary["response"] == {"status": "completed"}, summary
        kinds = summary["events"]
        assert kinds[:2] == ["session.created", "session.updated"], kinds
        assert kinds.count("response.output_audio.delta") > 0 and "response.output_audio.done" in kinds, kinds
        assert summary["audio_bytes"] == FAKE_ANSWER_MS * 48 and summary["audio_peak"] > 1000, summary
        assert wait_sessions(gw, 0) == 0
    finally:
        loop_thread.run(gw.stop())
