"""Who may reach what, from where (issue 35): CORS for browser pages on other origins, ephemeral
client keys (mint, scope, expiry, their session config), browser WebSocket auth by subprotocol,
TLS, and WebRTC call hangup. The real gateway on 127.0.0.1 in front of the fake engine."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import websockets
from fake_engine import FakeEngine
from rt_helpers import fake_gateway

TOKEN = "access-token"
ORIGIN = "http://127.0.0.1:5173"  # a dev server's page: another origin than the gateway's


def run(main, timeout_s: float = 60) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout_s))


async def mint(base: str, body: dict | None = None, token: str = TOKEN) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base, timeout=10) as http:
        return await http.post("/v1/realtime/client_secrets", json=body or {}, headers={"Authorization": f"Bearer {token}"})


def test_preflights_are_answered_without_credentials_and_replies_carry_cors_headers():
    async def main():
        async with fake_gateway(FakeEngine(), token=TOKEN) as gw, httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as http:
            asked = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"}
            for path in ("/v1/realtime/calls", "/v1/audio/speech", "/v1/audio/transcriptions", "/v1/realtime/client_secrets",
                         "/v1/realtime/calls/rtc_1/hangup"):
                r = await http.options(path, headers=asked)
                assert r.status_code == 204, (path, r.status_code, r.text)
                assert r.headers["Access-Control-Allow-Origin"] == "*"
                assert "POST" in r.headers["Access-Control-Allow-Methods"]
                assert r.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
            # the real request: answered with the header too, refusals included (the page reads the error)
            r = await http.post("/v1/realtime/calls", content=b"v=0", headers={"Origin": ORIGIN, "Content-Type": "application/sdp"})
            assert r.status_code == 401 and r.headers["Access-Control-Allow-Origin"] == "*"
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await http.post("/v1/audio/speech", json={"model": "x", "input": "hi", "voice": "alloy", "response_format": "pcm"},
                                headers={"Origin": ORIGIN, "Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
            assert "Location" in r.headers["Access-Control-Expose-Headers"]
            # not an API endpoint a page calls: no CORS
            r = await http.options("/metrics", headers=asked)
            assert r.status_code != 204 and "Access-Control-Allow-Origin" not in r.headers

    run(main)


def test_cors_origins_narrow_who_may_read_the_replies():
    async def main():
        config = {"server": {"cors_origins": [ORIGIN]}}
        async with fake_gateway(FakeEngine(), config, token=TOKEN) as gw, httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as http:
            ok = await http.options("/v1/realtime/calls", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
            assert ok.headers["Access-Control-Allow-Origin"] == ORIGIN and ok.headers["Vary"] == "Origin"
            other = await http.options("/v1/realtime/calls", headers={"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
            assert "Access-Control-Allow-Origin" not in other.headers
        with pytest.raises(ValueError, match="server.cors_origins"):
            from realtime.config import config_from_dict

            config_from_dict({"server": {"cors_origins": "http://a"}})

    run(main)


def test_an_ephemeral_key_opens_a_session_with_its_config_and_nothing_else():
    async def main():
        async with fake_gateway(FakeEngine(), token=TOKEN) as gw:
            base = f"http://127.0.0.1:{gw.port}"
            r = await mint(base, {"expires_after": {"anchor": "created_at", "seconds": 60},
                                  "session": {"type": "realtime", "instructions": "Speak like a pirate."}})
            assert r.status_code == 200, r.text
            minted = r.json()
            key = minted["value"]
            assert key.startswith("ek_") and abs(minted["expires_at"] - (time.time() + 60)) < 5
            assert minted["session"]["instructions"] == "Speak like a pirate."
            # a bearer on the realtime WebSocket: its session config is the session's
            async with websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime",
                                          additional_headers={"Authorization": f"Bearer {key}"}) as ws:
                created = json.loads(await asyncio.wait_for(ws.recv(), 5))
                assert created["type"] == "session.created"
                assert created["session"]["instructions"] == "Speak like a pirate."
            # ... and nothing else: no minting, no metrics, no one-shot audio
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {key}"}) as http:
                for method, path in (("POST", "/v1/realtime/client_secrets"), ("GET", "/metrics"), ("POST", "/v1/audio/speech"),
                                     ("POST", "/v1/realtime/calls/rtc_x/hangup")):
                    r = await http.request(method, path, json={})
                    assert r.status_code == 401, (path, r.status_code)
            # a refused request on a route with parts is counted under the route, not its path (few labels)
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_auth_failures_total", {"endpoint": "/v1/realtime/calls/{call_id}/hangup"}) == 1
            assert m("duplex_auth_failures_total", {"endpoint": "/v1/realtime/calls/rtc_x/hangup"}) is None
            # a bad mint is an OpenAI-shaped 400 naming the field; the server token only
            r = await mint(base, {"expires_after": {"anchor": "created_at", "seconds": 5}})
            assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after.seconds", r.text
            r = await mint(base, {"session": {"turn_detection": {"type": "psychic"}}})
            assert r.status_code == 400 and "turn_detection" in (r.json()["error"]["param"] or ""), r.text
            r = await mint(base, token="wrong")
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"

    run(main)


def test_an_expired_or_forged_key_is_refused_with_an_openai_error():
    async def main():
        async with fake_gateway(FakeEngine(), token=TOKEN) as gw:
            base = f"http://127.0.0.1:{gw.port}"
            key = (await mint(base)).json()["value"]
            secrets = gw.auth.secrets
            real_clock = secrets.clock
            secrets.clock = lambda: real_clock() + 601  # the default life is 600 s
            forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
            async with httpx.AsyncClient(base_url=base) as http:
                for bad in (key, forged, "ek_", "ek_x.y"):
                    r = await http.post("/v1/realtime/calls", content=b"v=0", headers={"Authorization": f"Bearer {bad}",
                                                                                        "Content-Type": "application/sdp"})
                    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
            with pytest.raises(websockets.InvalidStatus) as refused:
                await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime", subprotocols=["realtime", f"openai-insecure-api-key.{key}"])
            assert refused.value.response.status_code == 401
            assert gw.metrics.registry.get_sample_value("duplex_auth_failures_total", {"endpoint": "/v1/realtime"}) == 1

    run(main)


def test_a_browser_websocket_authenticates_by_subprotocol_and_gets_realtime_selected():
    async def main():
        async with fake_gateway(FakeEngine(), token=TOKEN) as gw:
            key = (await mint(f"http://127.0.0.1:{gw.port}")).json()["value"]
            url = f"ws://127.0.0.1:{gw.port}/v1/realtime"
            # what OpenAI's browser clients send (a browser cannot set Authorization on a WebSocket)
            for offered in (["realtime", f"openai-insecure-api-key.{key}", "openai-beta.realtime-v1"],
                            ["realtime", f"openai-insecure-api-key.{TOKEN}"]):
                async with websockets.connect(url, subprotocols=offered) as ws:
                    assert ws.subprotocol == "realtime"
                    assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "session.created"
            with pytest.raises(websockets.InvalidStatus):
                await websockets.connect(url, subprotocols=["realtime", "openai-insecure-api-key.nope"])

    run(main)


def test_hangup_ends_a_webrtc_call_and_sip_call_control_is_refused_clearly():
    from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

    async def main():
        async with fake_gateway(FakeEngine(), token=TOKEN) as gw:
            base = f"http://127.0.0.1:{gw.port}"
            pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
            pc.addTransceiver("audio")
            channel = pc.createDataChannel("oai-events")
            events: list[dict] = []
            channel.on("message", lambda m: events.append(json.loads(m)))
            closed = asyncio.Event()
            channel.on("close", closed.set)
            try:
                await pc.setLocalDescription(await pc.createOffer())
                async with httpx.AsyncClient(base_url=base, timeout=10) as http:
                    r = await http.post("/v1/realtime/calls", content=pc.localDescription.sdp.encode(),
                                        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/sdp"})
                assert r.status_code == 201, r.text
                call_id = r.headers["Location"].rsplit("/", 1)[-1]
                await pc.setRemoteDescription(RTCSessionDescription(sdp=r.text, type="answer"))
                for _ in range(100):
                    if any(e["type"] == "session.created" for e in events):
                        break
                    await asyncio.sleep(0.05)
                assert call_id in gw.sessions
                client = openai.AsyncOpenAI(api_key=TOKEN, base_url=f"{base}/v1")
                await client.realtime.calls.hangup(call_id)  # the official SDK, as an app's backend calls it
                await asyncio.wait_for(closed.wait(), 10)
                for _ in range(100):
                    if call_id not in gw.sessions:
                        break
                    await asyncio.sleep(0.05)
                assert call_id not in gw.sessions
                with pytest.raises(openai.NotFoundError):
                    await client.realtime.calls.hangup(call_id)
                with pytest.raises(openai.BadRequestError, match="sip_not_supported|SIP"):
                    await client.realtime.calls.reject(call_id)
            finally:
                await pc.close()

    run(main)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and localhost, made here (nothing committed)."""
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


def test_tls_serves_https_and_wss_on_the_one_port(certificate):
    cert, key = certificate

    async def main():
        config = {"server": {"tls_cert": str(cert), "tls_key": str(key)}}
        async with fake_gateway(FakeEngine(), config, token=TOKEN) as gw:
            trust = ssl.create_default_context(cafile=str(cert))
            async with httpx.AsyncClient(base_url=f"https://127.0.0.1:{gw.port}", verify=trust) as http:
                assert (await http.get("/healthz")).status_code == 200
                key_value = (await http.post("/v1/realtime/client_secrets", json={},
                                             headers={"Authorization": f"Bearer {TOKEN}"})).json()["value"]
            async with websockets.connect(f"wss://127.0.0.1:{gw.port}/v1/realtime", ssl=trust,
                                          additional_headers={"Authorization": f"Bearer {key_value}"}) as ws:
                assert json.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "session.created"
            with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # plain HTTP is not served on a TLS port
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}") as http:
                    await http.get("/healthz")

    run(main)


def test_serve_refuses_a_bad_certificate_before_starting(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    for args, says in ((["--tls-cert", str(bad), "--tls-key", str(bad)], "cannot use certificate"),
                       (["--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(bad)], "no such file"),
                       (["--tls-cert", str(bad)], "go together")):
        r = subprocess.run([".venv/bin/python", "-m", "realtime.cli", "serve", "--port", "0", *args], capture_output=True, text=True,
                           timeout=60, cwd=Path(__file__).resolve().parents[2])
        assert r.returncode != 0 and says in r.stderr, (args, r.returncode, r.stderr[-500:])
