"""Flood runs: one abusive client at a time while a witness measures what everyone else gets (issue 23).

    python scripts/soak.py --faults        # the fault runs, then these floods

Each flood runs in its own process, niced, as an attacker on another machine would: its own CPU
then competes as little as possible with the server's, and what the witness sees is the server's
doing. The witness (in the run's process) holds two connections the whole time:
- a probe: `input_audio_buffer.clear` every 20 ms, timing each `input_audio_buffer.cleared` (the
  event loop's round trip);
- a listener: back-to-back answers (`response.create`, no turn detection), timing the gaps between
  its audio deltas (pacing sends one every 40 ms; a stalled event loop shows as a longer gap).
Both are summarised before, during and after each flood.

    python -m realtime.soak.floods KIND BASE_URL TOKEN SECONDS   # one flood client (what the run starts)
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

FLOODS = ("empty_opus", "dtx_opus", "big_appends", "event_flood", "twilio_before_start", "vanish_idle")
GAP_LIMIT_MS = 100.0
RTT_P99_LIMIT_MS = 50.0


# ---- the flood clients (run in a child process) ---------------------------------------------------------


async def _connect(base: str, token: str, path: str = "/v1/realtime", auth: bool = True) -> ClientConnection:
    import websockets

    headers = {"Authorization": f"Bearer {token}"} if auth else {}
    return await websockets.connect(base.replace("http", "ws", 1) + path, additional_headers=headers, max_size=None,
                                    open_timeout=10, ping_interval=None)


async def _drain(ws, errors: dict[str, int]) -> None:
    """Read what the server sends (counting its error codes), so the flood is about input, not a slow reader."""
    try:
        async for m in ws:
            if isinstance(m, str) and '"error"' in m:
                ev = json.loads(m)
                if ev.get("type") == "error":
                    code = ev["error"].get("code") or "?"
                    errors[code] = errors.get(code, 0) + 1
    except Exception:
        pass


async def _send_until(ws, message: str | bytes, until: float, errors: dict[str, int]) -> tuple[int, str]:
    import websockets

    sent = 0
    reader = asyncio.create_task(_drain(ws, errors))
    try:
        while time.monotonic() < until:
            await ws.send(message)
            sent += 1
            if sent % 64 == 0:
                await asyncio.sleep(0)  # let the reader run
    except websockets.ConnectionClosed as e:
        return sent, f"closed {e.rcvd.code if e.rcvd else None}: {e.rcvd.reason if e.rcvd else ''}"
    finally:
        reader.cancel()
    await ws.close()
    return sent, "flood ended"


async def flood(kind: str, base: str, token: str, seconds: float) -> dict:
    until = time.monotonic() + seconds
    if kind in ("empty_opus", "dtx_opus", "big_appends", "event_flood"):
        ws = await _connect(base, token)
        await ws.recv()  # session.created
        if kind == "empty_opus":
            message: str | bytes = b"\x01"  # an empty Opus packet: libopus would conceal 120 ms from it
        elif kind == "dtx_opus":
            message = b"\x01\x18"  # a valid TOC-only packet (SILK NB 60 ms, no data): 60 ms of audio in 2 bytes
        elif kind == "big_appends":
            # just under the fault server's message limit (262144): ~4 s of audio per message
            pcm = (np.random.default_rng(0).standard_normal(96_000) * 3000).astype("<i2").tobytes()
            message = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[:190_000]).decode()})
        else:
            message = json.dumps({"type": "input_audio_buffer.clear"})
        errors: dict[str, int] = {}
        sent, outcome = await _send_until(ws, message, until, errors)
        return {"messages_sent": sent, "outcome": outcome, "errors": errors}
    if kind == "twilio_before_start":
        # unauthenticated sockets sending 2 MB before `start`, ten at a time, again and again
        big = json.dumps({"event": "connected", "protocol": "Call", "padding": "x" * 2_000_000})

        async def one() -> str:
            ws = await _connect(base, token, "/v1/telephony/twilio", auth=False)
            try:
                await ws.send(big)
                await asyncio.wait_for(ws.recv(), 5)
                return "answered?"
            except Exception as e:
                return type(e).__name__
            finally:
                await ws.close()

        outcomes: dict[str, int] = {}
        while time.monotonic() < until:
            for r in await asyncio.gather(*(one() for _ in range(10)), return_exceptions=True):
                key = r if isinstance(r, str) else type(r).__name__
                outcomes[key] = outcomes.get(key, 0) + 1
        return {"outcomes": outcomes}
    if kind == "vanish_idle":
        # clients that connect and drop without a close: their slots must not keep new callers out
        vanished = refused = admitted = 0
        while time.monotonic() < until:
            ws = await _connect(base, token)
            first = json.loads(await ws.recv())
            if first.get("type") == "error":
                refused += 1
            else:
                admitted += 1
            ws.transport.abort()
            vanished += 1
            await asyncio.sleep(0.05)
        return {"vanished": vanished, "admitted": admitted, "refused": refused}
    raise ValueError(f"unknown flood {kind!r} (known: {', '.join(FLOODS)})")


def main() -> int:
    kind, base, token, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    print(json.dumps(asyncio.run(flood(kind, base, token, seconds))), flush=True)
    return 0


# ---- the witness (in the run's process) -------------------------------------------------------------------


@dataclass
class Witness:
    base: str
    token: str
    rtt: list[tuple[float, float]] = field(default_factory=list)  # (when, round trip ms)
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (when, ms since the previous delta of the answer)
    answers: int = 0
    errors: list[str] = field(default_factory=list)
    lost: str | None = None  # why a witness connection ended early

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._probe(stop)), asyncio.create_task(self._listen(stop))]
        await asyncio.gather(*tasks)

    async def _probe(self, stop: asyncio.Event) -> None:
        ws = await _connect(self.base, self.token)
        await ws.recv()
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                await ws.send('{"type":"input_audio_buffer.clear"}')
                while json.loads(await asyncio.wait_for(ws.recv(), 10))["type"] != "input_audio_buffer.cleared":
                    pass
                t1 = time.monotonic()
                self.rtt.append((t1, 1000.0 * (t1 - t0)))
                await asyncio.sleep(max(0.0, 0.02 - (t1 - t0)))
        except Exception as e:
            self.lost = f"probe: {type(e).__name__}: {e}"
        finally:
            await ws.close()

    async def _listen(self, stop: asyncio.Event) -> None:
        ws = await _connect(self.base, self.token)
        await ws.recv()
        await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}))
        try:
            while not stop.is_set():
                await ws.send('{"type":"response.create"}')
                last = None
                while True:
                    ev = json.loads(await asyncio.wait_for(ws.recv(), 30))
                    now = time.monotonic()
                    if ev["type"] == "response.output_audio.delta":
                        if last is not None:
                            self.gaps.append((now, 1000.0 * (now - last)))
                        last = now
                    elif ev["type"] == "error":
                        self.errors.append(ev["error"]["code"])
                    elif ev["type"] == "response.done":
                        self.answers += ev["response"]["status"] == "completed"
                        break
        except Exception as e:
            self.lost = f"listener: {type(e).__name__}: {e}"
        finally:
            await ws.close()

    def window(self, t0: float, t1: float) -> dict:
        rtt = [ms for t, ms in self.rtt if t0 <= t < t1]
        gaps = [ms for t, ms in self.gaps if t0 <= t < t1]
        # where a long gap ended, in seconds into the window, beside the loop's worst round trip: a gap with
        # no slow round trip is audio late from further down than the event loop
        late = [round(t - t0, 2) for t, ms in self.gaps if t0 <= t < t1 and ms > GAP_LIMIT_MS]
        return {"rtt_p50_ms": _pct(rtt, 50), "rtt_p99_ms": _pct(rtt, 99), "rtt_max_ms": round(max(rtt), 1) if rtt else None,
                "probes": len(rtt), "gap_max_ms": round(max(gaps), 1) if gaps else None,
                "gaps_over_100ms": len(late), "gaps_over_100ms_at_s": late, "deltas": len(gaps)}


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


async def run_floods(base: str, token: str, seconds: float = 5.0, settle_s: float = 2.0) -> dict:
    """Each flood in turn, beside the witness; the result says, per flood, what the witness saw
    before / during / after and whether it met the goal (no gap over 100 ms, round trip p99 < 50 ms)."""
    witness = Witness(base, token)
    stop = asyncio.Event()
    task = asyncio.create_task(witness.run(stop))
    await asyncio.sleep(settle_s + 1.0)  # the first answer under way
    results = {}
    for kind in FLOODS:
        t_before = time.monotonic() - settle_s
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "realtime.soak.floods", kind, base, token, str(seconds),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, preexec_fn=lambda: os.nice(10))
        out, err = await asyncio.wait_for(proc.communicate(), seconds + 60)
        t1 = time.monotonic()
        await asyncio.sleep(settle_s)
        try:
            client = json.loads(out.decode().strip().splitlines()[-1])
        except (IndexError, ValueError):
            client = {"client_failed": err.decode()[-400:]}
        during = witness.window(t0, t1)
        results[kind] = {"client": client, "before": witness.window(t_before, t0), "during": during,
                         "after": witness.window(t1, time.monotonic()),
                         "goal_met": (during["gap_max_ms"] is None or during["gap_max_ms"] <= GAP_LIMIT_MS)
                         and (during["rtt_p99_ms"] is not None and during["rtt_p99_ms"] < RTT_P99_LIMIT_MS)}
        print(f"flood {kind}: {results[kind]}", flush=True)
    stop.set()
    await asyncio.wait_for(task, 40)
    return {"floods": results, "witness": {"answers_completed": witness.answers, "errors": witness.errors, "lost": witness.lost},
            "all_goals_met": all(r["goal_met"] for r in results.values()) and witness.lost is None and not witness.errors}


if __name__ == "__main__":
    sys.exit(main())
