"""Two `duplex serve` replicas (tiny model, CPU) behind HAProxy with deploy/haproxy.cfg, on loopback
(docs/scaling.md): new sessions spread over the replicas with room, one more than both hold is refused
with `server_at_capacity`, a resume reaches the replica that holds its session, a SIGKILLed replica
costs the other replica's calls nothing (every frame they sent is counted there) and new calls go to
the survivor, and a SIGTERMed replica drains: no new session, its running calls go on, then it exits 0.
"""

from __future__ import annotations

import asyncio
import base64
import json
import secrets
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import websockets

pytestmark = pytest.mark.vllm

CAPACITY = 2  # per replica (engine.capacity_override): the test decides who is full, not the machine
FRAME = base64.b64encode(np.zeros(480, "<i2").tobytes()).decode()  # 20 ms of 24 kHz PCM16
CHECK_S = 2.5  # HAProxy checks every 1 s (deploy/haproxy.cfg): after this long it has seen a change


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _frames_accounted(base: str, token: str) -> dict[str, int]:
    """The replica's frame counters: consumed, dropped by a counted policy, rejected with an error."""
    from realtime.soak.report import frame_counts
    from realtime.soak.server_process import read_metrics

    return frame_counts({}, read_metrics(base, token))


def _frames_consumed(base: str, token: str) -> int:
    return _frames_accounted(base, token)["consumed"]


class Call:
    """One WebSocket session through the balancer; `replica` is read from its resume token."""

    def __init__(self, ws, created: dict) -> None:
        self.ws, self.created = ws, created
        self.token = created.get("resume_token")
        self.replica = self.token.split(".")[1] if self.token else None

    async def talk(self, frames: int) -> None:
        for _ in range(frames):
            await self.ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": FRAME}))
            await asyncio.sleep(0.02)


async def _open(lb: str, token: str) -> Call | dict:
    """A session through the balancer: a Call, or the refusal (the error event and the close code)."""
    ws = await websockets.connect(f"{lb}/v1/realtime?duplex=1", additional_headers={"Authorization": f"Bearer {token}"})
    first = json.loads(await ws.recv())
    if first["type"] == "error":
        try:
            await ws.recv()
        except websockets.ConnectionClosed as e:
            return {"error": first["error"], "close": e.rcvd.code if e.rcvd else None}
    return Call(ws, first)


def test_two_replicas_behind_haproxy(tiny_model):
    from realtime.soak.balancer import Balancer
    from realtime.soak.server_process import ServerProcess

    token = secrets.token_urlsafe(12)
    config = {"engine": {"capacity_override": CAPACITY}, "limits": {"resume_grace_s": 30.0, "drain_timeout_s": 60.0}}
    # the two engines start side by side, each on a port of the OS's choosing: a port picked free beforehand
    # could be taken meanwhile (the other replica's engine core binds ports of its own while it starts)
    with ThreadPoolExecutor(2) as pool:
        starting = [pool.submit(ServerProcess, config, token, 0, f"duplex-{i}") for i in range(2)]
        replicas = [f.result() for f in starting]
    lb = Balancer([r.port for r in replicas])
    try:
        lb.wait_routable()
        time.sleep(CHECK_S)  # both replicas' checks passed
        asyncio.run(_scenario(lb, replicas, token))  # its steps build on each other: it asserts as it goes
    finally:
        lb.stop()
        for r in replicas:
            if r.proc.poll() is None:
                r.kill()


async def _scenario(lb, replicas, token: str) -> None:
    ws_lb = lb.base.replace("http", "ws", 1)
    r0, r1 = replicas
    log = lambda: f"\n--- duplex-0\n{r0.log_tail(15)}\n--- duplex-1\n{r1.log_tail(15)}\n--- haproxy\n{lb.log_path.read_text()[-1500:]}"

    # up to both replicas' capacity: all admitted, spread over both (leastconn)
    calls = []
    for _ in range(2 * CAPACITY):
        c = await _open(ws_lb, token)
        assert isinstance(c, Call), f"refused below capacity: {c}{log()}"
        calls.append(c)
        await asyncio.sleep(0.3)
    by_replica = {name: [c for c in calls if c.replica == name] for name in ("duplex-0", "duplex-1")}
    assert [len(v) for v in by_replica.values()] == [CAPACITY, CAPACITY], [c.replica for c in calls]

    # one more: both are full (their /healthz says 503 at_capacity); it is refused the way clients understand
    await asyncio.sleep(CHECK_S)
    assert _get(r0.base + "/healthz")[1]["detail"] == "at_capacity"
    extra = await _open(ws_lb, token)
    assert isinstance(extra, dict), f"admitted beyond capacity on {extra.replica}"
    assert extra["error"]["code"] == "server_at_capacity" and extra["error"]["retry_after_s"] > 0 and extra["close"] == 1013

    # a resume through the balancer reaches the replica holding the session, which replays what was missed
    moving = by_replica["duplex-1"][0]
    await moving.talk(5)
    moving.ws.transport.abort()  # the connection dies without a close frame
    ws = await websockets.connect(f"{ws_lb}/v1/realtime?resume={moving.token}&last_seq=1",
                                  additional_headers={"Authorization": f"Bearer {token}"})
    resumed = json.loads(await ws.recv())
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["session"]["id"] == moving.created["session"]["id"] and resumed["missed"] == 0
    moving.ws = ws

    # SIGKILL duplex-0 while duplex-1's calls talk: they lose nothing
    survivors = by_replica["duplex-1"]
    await asyncio.sleep(1.0)  # what was sent before is counted by now (sessions count within 0.25 s)
    before = _frames_accounted(r1.base, token)
    talking = asyncio.gather(*(c.talk(100) for c in survivors))
    await asyncio.sleep(0.5)
    await asyncio.to_thread(r0.kill)
    await talking
    await asyncio.sleep(1.5)  # sessions report their counts at least once a second
    after = _frames_accounted(r1.base, token)
    counted = {k: after[k] - before[k] for k in after}
    assert counted == {"consumed": 100 * len(survivors), "dropped": 0, "rejected": 0}, f"sent {100 * len(survivors)}: {counted}{log()}"
    for c in by_replica["duplex-0"]:
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                await c.ws.recv()

    # a new call goes to the survivor once it has room
    await survivors[1].ws.close()
    await asyncio.sleep(CHECK_S)
    new = await _open(ws_lb, token)
    assert isinstance(new, Call) and new.replica == "duplex-1", new

    # SIGTERM duplex-1: it drains; its running calls go on; new callers are refused; it exits 0 once they end
    r1.proc.terminate()
    await asyncio.sleep(CHECK_S)
    status, health = _get(r1.base + "/healthz")
    assert status == 503 and health["detail"] == "draining", health
    assert _get(r1.base + "/livez") == (200, {"live": True, "draining": True, "detail": "ready", "replica_id": "duplex-1"})
    refused = await _open(ws_lb, token)
    assert isinstance(refused, dict) and refused["error"]["code"] == "server_at_capacity", refused
    assert "draining" in refused["error"]["message"]
    running = [survivors[0], new]
    before = _frames_consumed(r1.base, token)
    await asyncio.gather(*(c.talk(50) for c in running))
    await asyncio.sleep(1.5)
    assert _frames_consumed(r1.base, token) - before == 50 * len(running)
    assert r1.proc.poll() is None  # still serving them
    for c in running:
        await c.ws.close()
    code = await asyncio.to_thread(r1.proc.wait, 60)
    assert code == 0, log()
    assert "drained: every session ended" in r1.log_path.read_text()
