"""Fault runs: misbehaving clients and an engine stall, while a witness caller holds a conversation.

    python scripts/soak.py --faults        # starts its own server; prints the JSON result's path

Each fault is a coroutine against the server; after each one the run checks that the server is
healthy, that no session of the fault is left behind, and (at the end) that the witness — an honest
caller on its own connection the whole time — lost nothing and saw no error. The server's RSS is
sampled before and after each fault. Then the floods (realtime/soak/floods.py): one abusive client
at a time, with a second witness timing the event loop's round trip and its answers' audio gaps.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from realtime.soak.callers import Script, WebSocketCaller
from realtime.soak.floods import run_floods
from realtime.soak.server_process import ServerProcess, health, process_sample, process_tree, read_metrics
from realtime.soak.speech import speech_sentences

if TYPE_CHECKING:
    from websockets.asyncio.client import ClientConnection

FAULT_MAX_MESSAGE_BYTES = 262144  # limits.max_message_bytes of the server below: one byte more is oversize
FAULT_SERVER_CONFIG = {
    "vad": {"silence_duration_ms": 500},
    "session": {"max_response_ms": 4000.0},
    # the capacity forced, so the overload control (slow start, degradation) is off: these runs are about the faults
    "limits": {"open_timeout_s": 3.0, "max_message_bytes": FAULT_MAX_MESSAGE_BYTES, "outbound_queue": 64,
               "overload": {"slow_start": False, "degrade": False}},
    "engine": {"capacity_override": 8},
}


async def _ws(base: str, token: str) -> ClientConnection:
    import websockets

    ws = await websockets.connect(base.replace("http", "ws", 1) + "/v1/realtime?duplex=1", additional_headers={"Authorization": f"Bearer {token}"},
                                  max_size=1 << 22)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created", created
    return ws


async def _speak(ws, pcm16k: np.ndarray) -> None:
    """Speech then silence, as 20 ms pcm16 appends at real-time pace (24 kHz on the wire)."""
    import base64

    import soxr

    pcm = soxr.resample(np.concatenate([pcm16k, np.zeros(16000, np.int16)]), 16000, 24000).astype("<i2")
    t0 = time.monotonic()
    for i, k in enumerate(range(0, pcm.size, 480)):
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[k:k + 480].tobytes()).decode()}))
        wait = t0 + (i + 1) * 0.02 - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)


async def _until_event(ws, kind: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), max(0.01, deadline - time.monotonic())))
        if ev.get("type") == kind:
            return ev


async def vanish_mid_answer(base: str, token: str, speech: np.ndarray) -> dict:
    """A client that disappears without a close frame while its answer is being sent."""
    ws = await _ws(base, token)
    speaker = asyncio.create_task(_speak(ws, speech))
    await _until_event(ws, "response.output_audio.delta", 60)
    speaker.cancel()
    ws.transport.abort()  # TCP reset, no WebSocket close
    return {"vanished_mid_answer": True}


async def slow_reader(base: str, token: str, speech: np.ndarray) -> dict:
    """A client that stops reading while its answer streams (its socket buffers fill)."""
    ws = await _ws(base, token)
    await _speak(ws, speech)
    await asyncio.sleep(8.0)  # no recv(): the client library's queue fills, then it stops reading the socket
    got_done: bool | str = False  # True, or why not
    try:
        await _until_event(ws, "response.done", 20)
        got_done = True
    except Exception as e:  # disconnected as a slow client is a valid outcome too
        got_done = f"closed: {e}"
    await ws.close()
    return {"answer_after_resuming": got_done}


async def slowloris(base: str, token: str, speech: np.ndarray, connections: int = 20) -> dict:
    """Handshakes that never finish: one byte every 0.5 s. The server must drop them after open_timeout."""
    host, port = base.rsplit("//", 1)[1].split(":")
    t0 = time.monotonic()

    async def one() -> float:
        reader, writer = await asyncio.open_connection(host, int(port))
        request = b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        try:
            for b in request:
                writer.write(bytes([b]))
                await writer.drain()
                if reader.at_eof():
                    break
                try:
                    if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                        break
                except asyncio.TimeoutError:
                    pass
        except (ConnectionError, OSError):
            pass
        writer.close()
        return time.monotonic() - t0

    closed_after = await asyncio.gather(*(one() for _ in range(connections)))
    return {"connections": connections, "closed_by_server_after_s": round(max(closed_after), 2)}


async def oversize_and_garbage(base: str, token: str, speech: np.ndarray) -> dict:
    """Garbage binary frames and bad JSON get error events and the session goes on; an oversize message closes it (1009)."""
    import websockets

    ws = await _ws(base, token)
    errors = []
    # not our binary frame (x2); an Opus packet whose code-3 frame count is 0 (random bytes are valid Opus about half
    # the time); not JSON; an unknown event
    for junk in (b"\x00\xff" * 50, b"\x02" + os.urandom(300), b"\x01\x03\x00", "{not json", json.dumps({"type": "no.such.event"})):
        await ws.send(junk)
        errors.append((await _until_event(ws, "error", 10))["error"]["code"])
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    await _until_event(ws, "input_audio_buffer.cleared", 10)  # still serving
    await ws.send("x" * (FAULT_MAX_MESSAGE_BYTES + 1))
    code: int | str | None = None  # the close code, or what happened instead
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 30)
    except websockets.ConnectionClosed as e:
        code = e.rcvd.code if e.rcvd else None
    except asyncio.TimeoutError:
        code = "no close within 30 s"
    return {"error_codes": errors, "oversize_close_code": code}


async def lone_surrogates(base: str, token: str, speech: np.ndarray) -> dict:
    """Valid JSON that is not valid Unicode (a lone UTF-16 surrogate, `"\\ud800"`) in the instructions, a system
    message and a typed user turn: each once closed the session with no error event. Each must get an
    `invalid_json` error, and the session go on (a valid update then applies)."""
    ws = await _ws(base, token)
    codes = []
    for event in ({"type": "session.update", "session": {"instructions": "be brief \ud800"}},
                  {"type": "conversation.item.create", "item": {"type": "message", "role": "system",
                                                                "content": [{"type": "input_text", "text": "\udfff rules"}]}},
                  {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                "content": [{"type": "input_text", "text": "hello \ud83d"}]}}):
        await ws.send(json.dumps(event))  # json escapes the surrogate as \ud800: valid JSON
        codes.append((await _until_event(ws, "error", 10))["error"]["code"])
    await ws.send(json.dumps({"type": "session.update", "session": {"instructions": "Be brief."}}))
    updated = await _until_event(ws, "session.updated", 10)
    await ws.close()
    return {"error_codes": codes, "went_on": updated["session"]["instructions"] == "Be brief."}


async def text_hoard(base: str, token: str, speech: np.ndarray, rounds: int = 8) -> dict:
    """A session that tries to make the server hold text: instructions and system messages of 64 KB (each
    was tokenized whole, on the event loop, at every change; within the input budget's bytes), and items
    by the thousand. Each beyond `limits.text` must be an error naming the limit, the session going on."""
    ws = await _ws(base, token)
    big = "\u200b" * 21_000  # 63 KB of UTF-8, 3 bytes a character: beyond limits.text's 16 KiB
    codes: dict[str, int] = {}

    async def ask(event: dict, done: str) -> None:
        """Send `event`; count its outcome: an error's code, or "accepted" (`done` came)."""
        await ws.send(json.dumps(event, ensure_ascii=False))
        code = "no answer"
        while True:
            ev = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if ev["type"] == "error" and ev["error"]["code"] != "input_rate_exceeded":  # (that one: this client's pace)
                code = ev["error"]["code"]
                if done == "session.updated":  # a refused field: the update's others still apply, and it is echoed
                    await _until_event(ws, done, 10)
                break
            if ev["type"] == done:
                code = "accepted"
                break
        codes[code] = codes.get(code, 0) + 1

    for _ in range(rounds):
        await ask({"type": "session.update", "session": {"instructions": big}}, "session.updated")
        await ask({"type": "conversation.item.create", "item": {"type": "message", "role": "system",
                                                                "content": [{"type": "input_text", "text": big}]}},
                  "conversation.item.done")
    for k in range(1030):  # beyond limits.text.max_items (1024)
        await ask({"type": "conversation.item.create", "item": {"type": "message", "role": "assistant",
                                                                "content": [{"type": "output_text", "text": f"note {k}"}]}},
                  "conversation.item.done")
    await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
    await _until_event(ws, "input_audio_buffer.cleared", 10)  # still serving
    await ws.close()
    return {"outcomes": codes}


async def upload_bombs(base: str, token: str, speech: np.ndarray, pid: int | None, rounds: int = 5) -> dict:
    """Decompression bombs to POST /v1/audio/transcriptions (realtime/soak/upload_bombs.py: a 55-byte FLAC
    at 8 Hz once took the gateway +2.4 GB, an 8 KB M4A declaring 85 million frames +2.9 GB, four at
    once +4.7 GB, a 4 KB WAV claiming ~100 MHz held its event loop 7.5 s), each sent `rounds` times,
    four at once. Each must be a 400 naming the problem (witnessed: `witnessed`)."""
    import httpx

    from realtime.soak.upload_bombs import hostile_uploads

    bombs = list(hostile_uploads().items()) * rounds
    outcomes: dict[str, dict[str, int]] = {}

    async def attack() -> dict:
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(name: str, data: bytes) -> None:
                r = await client.post(f"{base}/v1/audio/transcriptions", headers={"Authorization": f"Bearer {token}"},
                                      files={"file": (name, data)}, data={"model": "x"})
                got = f"{r.status_code} {r.json().get('error', {}).get('code')}"
                outcomes.setdefault(name, {})[got] = outcomes.setdefault(name, {}).get(got, 0) + 1

            for i in range(0, len(bombs), 4):
                await asyncio.gather(*(one(name, data) for name, data in bombs[i:i + 4]))
        return {"uploads": len(bombs), "outcomes": outcomes, "upload_seconds": round(time.monotonic() - t0, 2)}

    return await witnessed(base, token, pid, attack)


async def witnessed(base: str, token: str, pid: int | None, attack: Callable[[], Awaitable[dict]]) -> dict:
    """`attack()`'s outcome, run beside a flood witness (realtime/soak/floods.py: a second honest caller's
    audio gaps and the event loop's round trip), with the gateway's peak RSS sampled every 10 ms: issue
    39's bar for each fault of untrusted input is a largest gap <= 100 ms and RSS growth <= 100 MB."""
    from realtime.soak.floods import Witness

    witness, stop = Witness(base, token), asyncio.Event()
    watching = asyncio.create_task(witness.run(stop))
    await asyncio.sleep(4.0)  # its first answer under way
    rss0 = process_sample(pid).get("rss_mib", 0.0) if pid else 0.0
    peak = rss0

    async def sample() -> None:
        nonlocal peak
        while pid:
            peak = max(peak, process_sample(pid).get("rss_mib", 0.0))
            await asyncio.sleep(0.01)

    sampler = asyncio.create_task(sample())
    t0 = time.monotonic()
    try:
        outcome = await attack()
    finally:
        await asyncio.sleep(1.0)  # a stall shows in the deltas after the last refusal
        sampler.cancel()
        during = witness.window(t0, time.monotonic())
        stop.set()
        await asyncio.wait_for(watching, 40)
    return {**outcome, "witness_before": witness.window(t0 - 2.5, t0), "witness_during": during,
            "witness_lost": witness.lost, "gateway_rss_peak_growth_mib": round(peak - rss0, 1)}


async def engine_stall(base: str, token: str, speech: np.ndarray, pid: int | None, stall_ms: float = 400.0) -> dict:
    """The engine process frozen (SIGSTOP) for `stall_ms` in the middle of an answer."""
    if pid is None:
        return {"skipped": "needs a server started by this run"}
    engine = [p for p in process_tree(pid) if p != pid and b"EngineCore" in Path(f"/proc/{p}/cmdline").read_bytes()]
    if not engine:
        return {"skipped": "no separate engine process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"}
    ws = await _ws(base, token)
    speaker = asyncio.create_task(_speak(ws, speech))
    await _until_event(ws, "response.output_audio.delta", 60)
    os.kill(engine[0], signal.SIGSTOP)
    await asyncio.sleep(stall_ms / 1000.0)
    os.kill(engine[0], signal.SIGCONT)
    done = await _until_event(ws, "response.done", 60)
    speaker.cancel()
    await ws.close()
    return {"stall_ms": stall_ms, "answer_status": done["response"]["status"]}


async def run_faults(out_dir: Path, seed: int = 0) -> Path:
    import secrets

    token = secrets.token_urlsafe(12)
    server = await asyncio.to_thread(ServerProcess, FAULT_SERVER_CONFIG, token)
    base = server.base
    sentences = speech_sentences(seed)
    speech = sentences[2].pcm16k  # the longest: answers run while the faults hit
    before = await asyncio.to_thread(read_metrics, base, token)
    witness = WebSocketCaller(0, base, token, Script(sentences, barge_in=0.0), seed=seed)
    witness_task = asyncio.create_task(witness.run(time.monotonic() + 3600))
    await asyncio.sleep(3)
    results = {}
    for name, fault in (("vanish_mid_answer", vanish_mid_answer), ("slow_reader", slow_reader), ("slowloris", slowloris),
                        ("oversize_and_garbage", oversize_and_garbage),
                        ("lone_surrogates", lambda b, t, s: witnessed(b, t, server.pid, lambda: lone_surrogates(b, t, s))),
                        ("text_hoard", lambda b, t, s: witnessed(b, t, server.pid, lambda: text_hoard(b, t, s))),
                        ("upload_bombs", lambda b, t, s: upload_bombs(b, t, s, server.pid)),
                        ("engine_stall", lambda b, t, s: engine_stall(b, t, s, server.pid))):
        rss0 = process_sample(server.pid).get("rss_mib")
        t0 = time.monotonic()
        try:
            outcome = await asyncio.wait_for(fault(base, token, speech), 120)
        except Exception as e:
            outcome = {"fault_client_error": f"{type(e).__name__}: {e}"}
        await asyncio.sleep(2.0)
        h = await asyncio.to_thread(health, base)
        results[name] = {**outcome, "seconds": round(time.monotonic() - t0, 1), "healthy_after": bool(h.get("ready")),
                         "sessions_after": h.get("sessions"), "rss_before_mib": rss0,
                         "rss_after_mib": process_sample(server.pid).get("rss_mib")}
        print(f"fault {name}: {results[name]}", flush=True)
    floods = await run_floods(base, token)
    witness.hang_up()
    await asyncio.wait_for(witness_task, 60)
    after = await asyncio.to_thread(read_metrics, base, token)
    exit_code = server.stop()
    w = witness.record
    report = {
        "faults": results,
        "floods": floods,
        "witness": {"utterances": w.utterances, "answers": len(w.answers), "completed": sum(a.status == "completed" for a in w.answers),
                    "errors": w.errors, "crashed": w.crashed, "closed_by_server": w.closed_by_server,
                    "underruns": sum(a.playout.underruns for a in w.answers)},
        "metrics_delta": {k: round(after.get(k, 0) - before.get(k, 0), 3) for k in sorted(set(after) | set(before))
                          if k.split("{")[0].endswith("_total")},
        "server_exit_code": exit_code, "server_log": str(server.log_path),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"faults-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    return path
