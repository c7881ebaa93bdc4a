"""Side-by-side measurement of HTTP+WebSocket shells for the gateway (issue 35).

Candidates, each served from its own subprocess on 127.0.0.1 so the server's CPU is its own:
  ws            plain `websockets` asyncio server, HTTP via process_request (today's base)
  uv-<ws>-<loop>-<http>  Starlette on uvicorn, every installed ws implementation x loop x http parser
  aio-<loop>    aiohttp web.WebSocketResponse / multipart reader

Three loads, candidates alternated within each repeat (the machine is small and noisy; medians reported):
  1. realtime: N sessions each send a ~1 KB-audio JSON message every 20 ms; the server parses it and
     answers with a similar JSON message. Server CPU per session-second (% of one core), RTT p50/p99.
  2. upload: a 20 MB multipart POST while one realtime session runs on the same server: the server's
     time to answer and the largest gap between that session's replies during the upload.
  3. small requests: 200 sequential keep-alive GET /healthz, p50/p99.

    .venv/bin/python scripts/bench_http_shell.py [--seconds 4] [--sessions 8] [--repeats 3]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.client
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import psutil

UPLOAD_BYTES = 20 * 1024 * 1024
MAX_BODY = 25 * 1024 * 1024
AUDIO_B64 = base64.b64encode(os.urandom(768)).decode()  # ~1 KB of base64, as 20 ms of 16 kHz PCM16 would be
BOUNDARY = "benchboundary7MA4YWxkTrZu0gW"


# ---------------------------------------------------------------- servers (run in the subprocess)

def _reply(text: str | bytes) -> str:
    # Parse and rebuild, as the gateway does for every event; echo the audio like an output delta.
    msg = json.loads(text)
    return json.dumps({"type": "response.output_audio.delta", "seq": msg["seq"], "delta": msg["audio"]})


HEALTH = json.dumps({"status": "ok", "sessions": 0})


def serve_websockets(port: int) -> None:
    from websockets.asyncio.server import serve
    from websockets.datastructures import Headers
    from websockets.http11 import Response

    async def handler(ws) -> None:  # type: ignore[no-untyped-def]
        async for text in ws:
            await ws.send(_reply(text))

    def process_request(conn, req):  # type: ignore[no-untyped-def]
        if req.path == "/healthz":
            body = HEALTH.encode()
            return Response(200, "OK", Headers([("Content-Type", "application/json"),
                                                 ("Content-Length", str(len(body)))]), body)
        return None

    async def main() -> None:
        async with serve(handler, "127.0.0.1", port, process_request=process_request, compression=None,
                         max_size=1 << 20, max_queue=32, ping_interval=20, ping_timeout=20):
            print("READY", flush=True)
            await asyncio.Future()

    asyncio.run(main())


def serve_uvicorn(port: int, ws_impl: str, loop: str, http_impl: str) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route, WebSocketRoute
    from starlette.websockets import WebSocket, WebSocketDisconnect

    async def ws_endpoint(ws: WebSocket) -> None:
        await ws.accept()
        try:
            while True:
                await ws.send_text(_reply(await ws.receive_text()))
        except WebSocketDisconnect:
            pass

    async def healthz(request: Request) -> Response:
        return Response(HEALTH, media_type="application/json")

    async def upload(request: Request) -> Response:
        async with request.form(max_files=1, max_fields=10, max_part_size=MAX_BODY) as form:
            f = form["file"]
            n = 0
            while chunk := await f.read(1 << 16):  # type: ignore[union-attr]
                n += len(chunk)
        return JSONResponse({"bytes": n})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        print("READY", flush=True)  # before uvicorn binds; the bench then polls the port
        yield

    app = Starlette(routes=[WebSocketRoute("/ws", ws_endpoint), Route("/healthz", healthz),
                            Route("/upload", upload, methods=["POST"])], lifespan=lifespan)
    uvicorn.run(app, host="127.0.0.1", port=port, ws=ws_impl, loop=loop, http=http_impl,  # type: ignore[arg-type]
                log_level="warning", ws_per_message_deflate=False, lifespan="on")


def serve_aiohttp(port: int, loop: str) -> None:
    from aiohttp import WSMsgType, web

    async def ws_endpoint(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(compress=False, max_msg_size=1 << 20)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == WSMsgType.TEXT:
                await ws.send_str(_reply(msg.data))
        return ws

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(text=HEALTH, content_type="application/json")

    async def upload(request: web.Request) -> web.Response:
        reader = await request.multipart()
        n = 0
        async for part in reader:
            while chunk := await part.read_chunk(1 << 16):  # type: ignore[union-attr]
                n += len(chunk)
        return web.json_response({"bytes": n})

    async def on_startup(app: web.Application) -> None:
        print("READY", flush=True)

    app = web.Application(client_max_size=MAX_BODY)
    app.add_routes([web.get("/ws", ws_endpoint), web.get("/healthz", healthz), web.post("/upload", upload)])
    app.on_startup.append(on_startup)
    loop_factory = None
    if loop == "uvloop":
        import uvloop
        loop_factory = uvloop.new_event_loop
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None,
                loop=loop_factory() if loop_factory else None)


def run_server(kind: str, port: int) -> None:
    import warnings
    warnings.filterwarnings("ignore", message=".*implementation is deprecated")  # uvicorn ws=websockets
    parts = kind.split("-")
    if parts[0] == "ws":
        serve_websockets(port)
    elif parts[0] == "uv":
        ws_impl = "websockets-sansio" if parts[1] == "sansio" else parts[1]
        serve_uvicorn(port, ws_impl, parts[2], parts[3])
    else:
        serve_aiohttp(port, parts[1])


# ---------------------------------------------------------------- bench side

def candidates() -> list[str]:
    have = lambda m: importlib.util.find_spec(m) is not None  # noqa: E731
    loops = ["asyncio"] + (["uvloop"] if have("uvloop") else [])
    ws_impls = ["websockets"]
    if importlib.util.find_spec("uvicorn.protocols.websockets.websockets_sansio_impl"):
        ws_impls.append("sansio")
    if have("wsproto"):
        ws_impls.append("wsproto")
    out = ["ws"]
    for w in ws_impls:
        # asyncio+h11 is uvicorn's pure-Python floor; uvloop+httptools is what `uvicorn[standard]` picks.
        out.append(f"uv-{w}-asyncio-h11")
        if "uvloop" in loops and have("httptools"):
            out.append(f"uv-{w}-uvloop-httptools")
    out += [f"aio-{lp}" for lp in loops]
    return out


@dataclass
class Server:
    kind: str
    port: int
    proc: subprocess.Popen[str]
    ps: psutil.Process

    def cpu(self) -> float:
        # schedstat counts on-CPU nanoseconds per thread; psutil's times tick at 10 ms, too coarse for a
        # few seconds of light load. Summed over threads (executor threads included).
        try:
            total = 0
            for tid in os.listdir(f"/proc/{self.ps.pid}/task"):
                with open(f"/proc/{self.ps.pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            return total / 1e9
        except OSError:
            t = self.ps.cpu_times()
            return t.user + t.system


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(kind: str) -> Server:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "READY" not in line:
        raise RuntimeError(f"{kind} did not start: {line!r}")
    for _ in range(100):  # READY may precede listen() by a tick on uvicorn
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    return Server(kind, port, proc, psutil.Process(proc.pid))


@dataclass
class Session:
    rtts: list[float] = field(default_factory=list)
    recv_at: list[float] = field(default_factory=list)


async def ws_session(port: int, stop_at: float, out: Session) -> None:
    from websockets.asyncio.client import connect

    sent: dict[int, float] = {}
    async with connect(f"ws://127.0.0.1:{port}/ws", compression=None, max_size=1 << 20) as ws:
        async def reader() -> None:
            async for text in ws:
                now = time.perf_counter()
                seq = json.loads(text)["seq"]
                out.rtts.append(now - sent.pop(seq))
                out.recv_at.append(now)

        rt = asyncio.create_task(reader())
        seq = 0
        t_next = time.perf_counter()
        while t_next < stop_at:
            sent[seq] = time.perf_counter()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "seq": seq, "audio": AUDIO_B64}))
            seq += 1
            t_next += 0.020
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
        deadline = time.perf_counter() + 2.0
        while sent and time.perf_counter() < deadline:
            await asyncio.sleep(0.01)
        rt.cancel()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def realtime_load(srv: Server, sessions: int, seconds: float) -> tuple[float, float, float]:
    outs = [Session() for _ in range(sessions)]
    await asyncio.sleep(0.2)
    c0 = srv.cpu()
    w0 = time.perf_counter()
    stop_at = w0 + seconds
    await asyncio.gather(*(ws_session(srv.port, stop_at, o) for o in outs))
    cpu = srv.cpu() - c0
    rtts = [r for o in outs for r in o.rtts]
    return 100.0 * cpu / (sessions * (time.perf_counter() - w0)), pct(rtts, 0.5) * 1e3, pct(rtts, 0.99) * 1e3


UPLOAD_BODY = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
               "Content-Type: application/octet-stream\r\n\r\n").encode() + os.urandom(UPLOAD_BYTES) \
    + f"\r\n--{BOUNDARY}--\r\n".encode()


async def upload_during_session(srv: Server) -> tuple[float, float, float]:
    """Total POST time, server time to answer after the last body byte written, largest reply gap (all ms)."""
    out = Session()
    stop_at = time.perf_counter() + 60
    task = asyncio.create_task(ws_session(srv.port, stop_at, out))
    await asyncio.sleep(0.5)
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    t0 = time.perf_counter()
    writer.write(f"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                 f"Content-Length: {len(UPLOAD_BODY)}\r\n\r\n".encode() + UPLOAD_BODY)
    await writer.drain()
    t_sent = time.perf_counter()
    head = await reader.readuntil(b"\r\n\r\n")
    t1 = time.perf_counter()
    if b" 200 " not in head.split(b"\r\n", 1)[0]:
        raise RuntimeError(f"{srv.kind} upload: {head[:80]!r}")
    writer.close()
    await asyncio.sleep(0.3)
    task.cancel()
    stamps = [t0] + [t for t in out.recv_at if t0 <= t <= t1 + 0.3]
    gap = max(b - a for a, b in zip(stamps, stamps[1:])) if len(stamps) > 1 else float("nan")
    return (t1 - t0) * 1e3, (t1 - t_sent) * 1e3, gap * 1e3


def healthz(srv: Server, n: int = 200) -> tuple[float, float, int]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
    lat: list[float] = []
    reconnects = 0
    for _ in range(n):
        t = time.perf_counter()
        try:
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
        except (http.client.RemoteDisconnected, ConnectionError, BrokenPipeError):
            reconnects += 1  # a server without keep-alive: the next request opens a new connection
            conn.close()
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
        resp.read()
        if resp.will_close:
            conn.close()
            reconnects += 1
        lat.append(time.perf_counter() - t)
    conn.close()
    return pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3, reconnects


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=4.0, help="realtime load per candidate per repeat")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated candidate names (default: all available)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        run_server(args.serve, args.port)
        return

    kinds = [k for k in candidates() if not args.only or k in args.only.split(",")]
    print(f"candidates: {', '.join(kinds)}  (wsproto {'present' if importlib.util.find_spec('wsproto') else 'not installed'})",
          flush=True)
    servers = [start(k) for k in kinds]  # all up at once; idle ones cost nothing, and the order can alternate
    res: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}

    def add(k: str, name: str, v: float) -> None:
        res[k].setdefault(name, []).append(v)

    try:
        for r in range(args.repeats):
            order = servers if r % 2 == 0 else servers[::-1]
            for s in order:
                cpu, p50, p99 = asyncio.run(realtime_load(s, args.sessions, args.seconds))
                add(s.kind, "cpu", cpu), add(s.kind, "p50", p50), add(s.kind, "p99", p99)
            for s in order:
                h50, h99, rc = healthz(s)
                add(s.kind, "h50", h50), add(s.kind, "h99", h99), add(s.kind, "hrc", rc)
            for s in order:
                if s.kind != "ws":
                    total, up, gap = asyncio.run(upload_during_session(s))
                    add(s.kind, "uptot", total), add(s.kind, "up", up), add(s.kind, "gap", gap)
            print(f"repeat {r + 1}/{args.repeats} done", flush=True)
    finally:
        for s in servers:
            s.proc.terminate()
        for s in servers:
            try:
                s.proc.wait(5)
            except subprocess.TimeoutExpired:
                s.proc.kill()

    m = {k: {n: med(v) for n, v in d.items()} for k, d in res.items()}
    base = m["ws"] if "ws" in m else None

    def ratio(k: str, n: str) -> str:
        return f"{m[k][n] / base[n]:.2f}x" if base and n in base and base[n] else "-"

    print(f"\n{args.sessions} sessions x {args.seconds:g} s, 1 KB-audio JSON every 20 ms, {args.repeats} repeats, "
          f"medians; ratios vs `ws` (websockets {__import__('websockets').__version__}, today's base)")
    hdr = (f"{'candidate':30} {'cpu%/sess':>9} {'ratio':>6} {'rtt p50':>8} {'p99 ms':>7} {'ratio':>6} "
           f"{'get p50':>8} {'p99 ms':>7} {'ratio':>6} {'reconn':>6} {'20MB total':>10} {'tail':>5} {'max gap':>7}")
    print(hdr)
    print("-" * len(hdr))
    nan = float("nan")
    for k in kinds:
        d = m[k]
        print(f"{k:30} {d['cpu']:9.2f} {ratio(k, 'cpu'):>6} {d['p50']:8.2f} {d['p99']:7.2f} {ratio(k, 'p99'):>6} "
              f"{d['h50']:8.3f} {d['h99']:7.3f} {ratio(k, 'h50'):>6} {d['hrc']:6.0f} "
              f"{d.get('uptot', nan):10.0f} {d.get('up', nan):5.0f} {d.get('gap', nan):7.0f}")
    print("cpu%/sess: server process CPU per session-second, % of one core. get: 200 sequential GET /healthz on "
          "one keep-alive connection (reconn: connections the server closed). 20MB total: a multipart POST "
          "from first byte sent to response head; tail: of which after the last byte was written; max gap: longest pause between a concurrent session's "
          "replies during the upload (ms; 20 = none).")


if __name__ == "__main__":
    main()
