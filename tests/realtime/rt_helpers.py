"""Helpers for the realtime tests (imported by name: tests/ has no packages)."""

from __future__ import annotations

import contextlib
import functools
import subprocess
import tempfile
import wave
from pathlib import Path

import numpy as np


@functools.lru_cache(maxsize=16)
def espeak(text: str, rate_hz: int) -> np.ndarray:
    import soxr

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as w:
            src_rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.int16)
    return soxr.resample(pcm, src_rate, rate_hz).astype(np.int16)


def silence(ms: float, rate_hz: int) -> np.ndarray:
    return np.zeros(int(rate_hz * ms / 1000), np.int16)


async def sdk_until(conn, kind: str, seen: list) -> object:
    """Events of an openai SDK realtime connection, kept in `seen`, up to the first of type `kind`."""
    async for ev in conn:
        seen.append(ev)
        if ev.type == kind:
            return ev
    raise AssertionError(f"closed before {kind}")


@contextlib.asynccontextmanager
async def fake_gateway(engine, config: dict | None = None, token: str | None = None, voices: dict | None = None,
                       tracer_provider=None):
    """A Gateway on 127.0.0.1 (port chosen by the OS) in front of `engine` (tests' FakeEngine), in the
    running loop; `config` is the server config as a dict (`server.port` is forced to 0);
    `tracer_provider`: the sessions' OpenTelemetry spans go there (else: as the OTEL_* environment says)."""
    from realtime.config import config_from_dict
    from realtime.server import Gateway

    config = config or {}
    gw = Gateway(engine, config_from_dict({**config, "server": {**config.get("server", {}), "port": 0}}), token=token,
                 voices=voices, tracer_provider=tracer_provider)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


@contextlib.contextmanager
def running_gateway(loop_thread, model, capacity: int, config: dict):
    """A Gateway on 127.0.0.1 (port chosen by the OS) in front of the real engine (`model`, CPU), on the
    shared loop thread; `config` is the server config as a dict (`server.port` is forced to 0)."""
    from engine.service import Engine, EngineServiceConfig
    from realtime.config import config_from_dict
    from realtime.server import Gateway

    eng = loop_thread.run(Engine.start(EngineServiceConfig(model=str(model), capacity_override=capacity, warmup=False)))
    # one gateway serves a module's tests one after another on a busy 2-core machine: slow start (which a
    # late window there cuts to one more call at a time) is for bursts of callers, tested on its own
    limits = {**config.get("limits", {}), "overload": {"slow_start": False, **config.get("limits", {}).get("overload", {})}}
    cfg = config_from_dict({**config, "limits": limits, "server": {**config.get("server", {}), "port": 0}})
    gw = Gateway(eng, cfg)
    try:
        loop_thread.run(gw.start())
        yield gw
    finally:
        loop_thread.run(gw.stop())
        loop_thread.run(eng.shutdown())


async def aiortc_offer() -> str:
    """An SDP offer as a browser makes one (audio + the `oai-events` data channel), from a peer closed at once."""
    from aiortc import RTCConfiguration, RTCPeerConnection

    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pc.addTransceiver("audio")
    pc.createDataChannel("oai-events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp
