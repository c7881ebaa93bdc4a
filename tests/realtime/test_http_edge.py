"""The gateway's HTTP edge under hostile clients (issue 39), on a real Gateway (127.0.0.1, fake engine):
every malformed or refused request is answered with a status line, never dropped; refusals for
capacity or rate come before the body and cost (almost) no memory; a live session beside them goes on.

Raw sockets (asyncio.open_connection) where the request itself is malformed or only half sent; the
1000 requests/s flood comes from another process, so the flooder's own work is not on the loop that
carries the gateway and its witness session."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import textwrap
import time
from collections import Counter
from dataclasses import dataclass

import websockets
from fake_engine import FakeEngine, fake_transcript
from rt_helpers import fake_gateway
from test_audio_api import run, tone, wav_file
from test_upload_bombs import AnswerWitness, PeakRss, _gaps

from realtime.transports.audio_api import MAX_FORM_FIELDS

TOKEN = "edge-token"
SPEECH = json.dumps({"model": "x", "input": "Hello there.", "voice": "alloy", "response_format": "pcm"}).encode()


def gateway(engine: FakeEngine | None = None, config: dict | None = None):
    return fake_gateway(engine or FakeEngine(oneshot_step_s=0), config, TOKEN)


# ---- raw HTTP ----------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def error(self) -> dict:
        """The OpenAI-shaped error of a JSON reply."""
        assert self.headers.get("content-type") == "application/json", (self.status, self.headers, self.body[:200])
        err = json.loads(self.body)["error"]
        json.dumps(err, ensure_ascii=False).encode()  # valid Unicode: no lone surrogate escaped from the request's bytes
        return err


async def read_reply(reader: asyncio.StreamReader, timeout_s: float = 10) -> Reply:
    """One response: the status line and headers, then a body of Content-Length bytes, or a chunked
    body to the end of the connection (the gateway closes after a streamed reply)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
    status_line, *lines = head.decode("latin-1").split("\r\n")
    assert re.fullmatch(r"HTTP/1\.[01] \d{3} .*", status_line), status_line
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines if ln)}
    if "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), timeout_s)
    elif headers.get("transfer-encoding") == "chunked":
        body = await asyncio.wait_for(reader.read(), timeout_s)
    else:
        body = b""
    return Reply(int(status_line.split()[1]), headers, body)


async def exchange(port: int, head: bytes, body: bytes = b"") -> Reply:
    """Send a request (head and body at once, so a malformed one is all there) and read its answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head + body)
        await writer.drain()
        return await read_reply(reader)
    finally:
        writer.close()


def request_head(method: str, path: str, *headers: bytes | str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1",
             *(h.encode() if isinstance(h, str) else h for h in headers)]
    return b"".join(ln + b"\r\n" for ln in lines) + b"\r\n"


AUTH = f"Authorization: Bearer {TOKEN}"


def upload_head(length: int, boundary: str = "b") -> bytes:
    return request_head("POST", "/v1/audio/transcriptions", AUTH, f"Content-Type: multipart/form-data; boundary={boundary}",
                        f"Content-Length: {length}")


def speech_head(length: int = len(SPEECH)) -> bytes:
    return request_head("POST", "/v1/audio/speech", AUTH, "Content-Type: application/json", f"Content-Length: {length}")


def part(name: str, data: bytes, extra_headers: bytes = b"") -> bytes:
    return f'--b\r\nContent-Disposition: form-data; name="{name}"\r\n'.encode() + extra_headers + b"\r\n" + data + b"\r\n"


class SlowUpload:
    """A valid transcription upload whose body is held back after its first bytes: it holds an
    `audio_api.max_concurrent` slot from then until `finish()` sends the rest."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.pcm = tone(440, 1.0, 16_000)
        self.body = part("model", b"x") + part("file", wav_file(self.pcm, 16_000), b'Content-Type: audio/wav\r\n') + b"--b--\r\n"

    async def start(self, gw) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.write(upload_head(len(self.body)) + self.body[:1000])
        await self.writer.drain()
        await until(lambda: gw.transports["audio_api"].running == 1)

    async def finish(self) -> Reply:
        self.writer.write(self.body[1000:])
        await self.writer.drain()
        try:
            return await read_reply(self.reader)
        finally:
            self.writer.close()


async def until(condition, timeout_s: float = 5) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.005)


# ---- a live session beside the attacks -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def witness(port: int):
    """A realtime session open before the attacks; `alive()` after them: it still answers a session.update."""
    ws = await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", additional_headers={"Authorization": f"Bearer {TOKEN}"})
    assert json.loads(await ws.recv())["type"] == "session.created"
    n = 0

    async def alive() -> None:
        nonlocal n
        n += 1
        await ws.send(json.dumps({"type": "session.update", "session": {"instructions": f"still here {n}"}}))
        async with asyncio.timeout(5):
            while (ev := json.loads(await ws.recv()))["type"] != "session.updated":
                assert ev["type"] != "error", ev
        assert ev["session"]["instructions"] == f"still here {n}"

    try:
        yield alive
    finally:
        await ws.close()


# ---- 1. malformed request heads --------------------------------------------------------------------------------------

MALFORMED_HEADS = {
    "a bad request line": b"GARBAGE\r\n\r\n",
    "a request line with a fourth word": b"GET /healthz HTTP/1.1 extra\r\nHost: 127.0.0.1\r\n\r\n",
    "a header line without a colon": request_head("POST", "/v1/audio/speech", AUTH, "NoColonHere", "Content-Length: 0"),
    "a header line of 9000 bytes": request_head("POST", "/v1/audio/speech", AUTH, "X-Long: " + "a" * 9000, "Content-Length: 0"),
    "more than 128 headers": request_head("POST", "/v1/audio/speech", AUTH, *(f"X-H{i}: v" for i in range(130)), "Content-Length: 0"),
}


def test_malformed_heads_and_non_ascii_headers_are_answered_while_a_session_goes_on():
    async def main():
        async with gateway() as gw, witness(gw.port) as alive:
            for name, head in MALFORMED_HEADS.items():
                reply = await exchange(gw.port, head)
                assert reply.status == 400 and reply.body, (name, reply)
            # a Content-Type of Latin-1 or invalid UTF-8 bytes: not a form, 415 naming what it must be
            for ctype in (b"multipart/f\xe9rm-data; boundary=b", b"\xff\xfe"):
                reply = await exchange(gw.port, request_head("POST", "/v1/audio/transcriptions", AUTH, b"Content-Type: " + ctype,
                                                             "Content-Length: 0"))
                assert reply.status == 415 and reply.error()["code"] == "unsupported_media_type", (ctype, reply)
            # the right type with a UTF-8 boundary no body holds: 400, the form could not be read
            reply = await exchange(gw.port, request_head("POST", "/v1/audio/transcriptions", AUTH,
                                                         "Content-Type: multipart/form-data; boundary=\u00e9\u2603".encode(),
                                                         "Content-Length: 0"))
            assert reply.status == 400 and reply.error()["code"] == "invalid_request", reply
            # non-ASCII bytes in the credential (Latin-1, invalid UTF-8, UTF-8): 401 as OpenAI's, never a drop
            for token in (b"s3cr\xe9t", b"\xff\xfe\xe9", "s\u00e9cr\u2603t".encode()):
                reply = await exchange(gw.port, request_head("POST", "/v1/realtime/calls", b"Authorization: Bearer " + token,
                                                             "Content-Type: application/sdp", "Content-Length: 3"), b"v=0")
                assert reply.status == 401 and reply.error()["code"] == "invalid_api_key", (token, reply)
                assert reply.headers["www-authenticate"].startswith("Bearer")
            # a preflight asking for a non-ASCII header name: answered (what it may send is the browser's to check)
            reply = await exchange(gw.port, request_head("OPTIONS", "/v1/audio/speech", "Origin: http://a.example",
                                                         "Access-Control-Request-Method: POST", b"Access-Control-Request-Headers: x-\xe9"))
            assert reply.status == 204 and reply.headers["access-control-allow-origin"] == "*", reply
            await alive()
            assert gw.transports["audio_api"].running == 0

    run(main)


# ---- 2. multipart ----------------------------------------------------------------------------------------------------


def _nested_form(depth: int) -> bytes:
    """A form whose `file` field is multipart/mixed, whose part is multipart/mixed ... `depth` deep."""
    inner = b"x"
    for d in range(depth, 0, -1):
        ctype = f"multipart/mixed; boundary=n{d + 1}" if d < depth else "text/plain"
        inner = f"--n{d}\r\nContent-Type: {ctype}\r\n\r\n".encode() + inner + f"\r\n--n{d}--\r\n".encode()
    return (b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: multipart/mixed; boundary=n1\r\n\r\n" + inner + b"\r\n--b--\r\n")


FORMS = {
    # name: (the body, words the error message must hold)
    "nested 3000 deep": (lambda: _nested_form(3000), "may not itself be multipart"),
    "100 000 parts": (lambda: b"".join(part(f"f{i}", b"x") for i in range(100_000)) + b"--b--\r\n",
                      f"at most {MAX_FORM_FIELDS} fields"),
    "a part with 200 header lines": (lambda: part("file", b"x", b"".join(b"X-H%d: v\r\n" % i for i in range(200))) + b"--b--\r\n",
                                     "Too many headers"),
    "a part header line of 100 KB": (lambda: part("file", b"x", b"X-Long: " + b"a" * 100_000 + b"\r\n") + b"--b--\r\n",
                                     "8190 bytes"),
    "no closing boundary": (lambda: part("model", b"x") + part("file", b"abc"), "could not be read"),
    "cut inside a part": (lambda: part("model", b"x") + b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\nabc',
                          "could not be read"),
}


def test_hostile_forms_are_400s_naming_the_problem_while_a_session_goes_on():
    async def main():
        async with gateway() as gw, witness(gw.port) as alive:
            for name, (make, words) in FORMS.items():
                body = make()
                reply = await exchange(gw.port, upload_head(len(body)), body)
                err = reply.error()
                assert (reply.status, err["code"]) == (400, "invalid_request") and words in err["message"], (name, err)
                if len(body) > 1 << 20:  # 5.7 MB: refused at its 33rd part, the rest never read (so the connection ends)
                    assert reply.headers.get("connection") == "close", (name, reply.headers)
            await alive()
            assert gw.transports["audio_api"].running == 0
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": "bad_request"}) == len(FORMS)

    run(main)


# ---- 3. capacity and rate refusals, before the body ----------------------------------------------------------------


def test_an_upload_holds_its_slot_from_its_first_byte_and_the_next_is_refused_before_its_body():
    async def main():
        async with gateway(config={"audio_api": {"max_concurrent": 1}, "limits": {"retry_after_s": 3}}) as gw, \
                witness(gw.port) as alive:
            first = SlowUpload(gw.port)
            await first.start(gw)  # its head and 1000 bytes of its body: the slot is taken
            # the second: a head declaring 20 MB (under the 25 MiB limit: not a 413), and not a byte of body
            reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
            writer.write(upload_head(20_000_000))
            await writer.drain()
            reply = await read_reply(reader)
            writer.close()
            err = reply.error()
            assert (reply.status, err["code"], reply.headers["retry-after"]) == (429, "rate_limit_exceeded", "3"), reply
            assert "audio_api.max_concurrent" in err["message"]
            assert reply.headers.get("connection") == "close"  # its body was never read: the connection cannot go on
            await alive()
            done = await first.finish()  # the upload in flight went on
            assert done.status == 200 and json.loads(done.body)["text"] == fake_transcript(first.pcm), done
            assert gw.transports["audio_api"].running == 0

    run(main)


def test_the_request_rate_refuses_a_clients_sixth_quick_request_and_not_another_credential():
    async def main():
        config = {"limits": {"http_rate": {"requests_per_s": 2, "burst": 5}}}  # a token back each 0.5 s
        async with gateway(config=config) as gw, witness(gw.port) as alive:
            mint = b'{"expires_after": {"anchor": "created_at", "seconds": 600}}'
            reply = await exchange(gw.port, request_head("POST", "/v1/realtime/client_secrets", AUTH, "Content-Type: application/json",
                                                         f"Content-Length: {len(mint)}"), mint)
            assert reply.status == 200, reply
            key = json.loads(reply.body)["value"]
            assert key.startswith("ek_")
            # the server token from this address: 4 more (5 with the mint), then refused
            for _ in range(4):
                reply = await exchange(gw.port, speech_head(2), b"{}")
                assert reply.status == 400 and reply.error()["code"] != "rate_limit_exceeded", reply
            reply = await exchange(gw.port, speech_head(), SPEECH)
            err = reply.error()
            assert (reply.status, err["code"]) == (429, "rate_limit_exceeded") and "from this client" in err["message"], reply
            assert int(reply.headers["retry-after"]) >= 1
            # the ek_ key is another credential: its own bucket (the offer itself is refused, by the route)
            offer = b"v=0 not an offer"
            reply = await exchange(gw.port, request_head("POST", "/v1/realtime/calls", f"Authorization: Bearer {key}",
                                                         "Content-Type: application/sdp", f"Content-Length: {len(offer)}"), offer)
            assert (reply.status, reply.error()["code"]) == (400, "invalid_offer"), reply
            reply = await exchange(gw.port, speech_head(), SPEECH)  # the server token is still refused
            assert reply.status == 429, reply
            await alive()  # a session is not an HTTP request: the same client's session goes on
            assert gw.metrics.registry.get_sample_value("duplex_http_rate_limited_total") == 2
            assert gw.transports["audio_api"].running == 0

    run(main)


# ---- 4. what refusals cost --------------------------------------------------------------------------------------------

# Growth of this process's RSS (gateway and clients) allowed while 100 requests are answered: 4 served
# (each a 3 s PCM reply, 144 KB, and its encoder) and 96 refused, each refusal a connection (aiohttp's
# protocol, request and reply objects, a 64 KiB read buffer at most: ~0.1 MiB) on both sides: ~20 MiB at
# worst (+2 MiB measured), so 64 MiB leaves room for the allocator's slack; before issue 39 it was +1.1 GB.
REFUSAL_BOUND_MIB = 64.0


def test_96_refused_speech_requests_cost_little_memory():
    async def main():
        engine = FakeEngine(oneshot_step_s=0.1)
        config = {"audio_api": {"max_concurrent": 4}, "limits": {"http_rate": {"enabled": False}}}
        async with gateway(engine, config) as gw, witness(gw.port) as alive:
            long_speech = json.dumps({"model": "x", "input": "x" * 50, "voice": "alloy", "response_format": "pcm"}).encode()
            warm = await exchange(gw.port, speech_head(), SPEECH)  # lazy imports on both sides, before measuring
            assert warm.status == 200

            async def open_speech() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
                reader, writer = await asyncio.open_connection("127.0.0.1", gw.port)
                writer.write(speech_head(len(long_speech)) + long_speech)
                await writer.drain()
                return reader, writer

            with PeakRss() as rss:
                served = [await open_speech() for _ in range(4)]  # 3 s of audio each, an 80 ms chunk each 0.1 s: ~3.8 s
                await until(lambda: gw.transports["audio_api"].running == 4)
                refused = await asyncio.gather(*(exchange(gw.port, speech_head(), SPEECH) for _ in range(96)))
                still_running = gw.transports["audio_api"].running
                replies = [await read_reply(r, 20) for r, _ in served]
                for _, w in served:
                    w.close()
            assert still_running == 4, "the served requests must still be running when the others are refused"
            # each served in full: 3 s of 24 kHz PCM, chunked, with its last chunk
            assert [r.status for r in replies] == [200] * 4, replies
            assert all(len(r.body) > 3 * 24_000 * 2 and r.body.endswith(b"\r\n0\r\n\r\n") for r in replies)
            assert [(r.status, r.error()["code"]) for r in refused] == [(429, "rate_limit_exceeded")] * 96
            assert all("audio_api.max_concurrent" in r.error()["message"] for r in refused)
            assert rss.growth_mib < REFUSAL_BOUND_MIB, f"+{rss.growth_mib:.0f} MiB"
            await alive()

    run(main)


# 20 uploads declaring 25 MiB each (500 MiB if held) sending as fast as they can until answered: each is
# refused before its body is read, and what the gateway buffers of a body it will not read is bounded by
# aiohttp's flow control (reading pauses at 2 x 64 KiB a connection): ~3 MiB for all 20. The clients' own
# transports buffer up to a 1 MiB write each (~20 MiB); +12 to +16 MiB measured in all.
UPLOAD_REFUSAL_BOUND_MIB = 48.0


def test_20_refused_uploads_of_25_mib_cost_little_memory():
    chunk = bytes(1 << 20)  # the client sends this one buffer again and again: its own memory stays flat

    async def refused_upload(port: int) -> tuple[Reply, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(upload_head(25 << 20))
        sent = 0

        async def send() -> None:
            nonlocal sent
            with contextlib.suppress(ConnectionError):
                while sent < 25 << 20:
                    writer.write(chunk)
                    await writer.drain()
                    sent += len(chunk)

        sender = asyncio.create_task(send())
        try:
            return await read_reply(reader), sent
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
            writer.close()

    async def main():
        async with gateway(config={"audio_api": {"max_concurrent": 1}, "limits": {"http_rate": {"enabled": False}}}) as gw, \
                witness(gw.port) as alive:
            first = SlowUpload(gw.port)
            await first.start(gw)
            with PeakRss() as rss:
                outcomes = await asyncio.gather(*(refused_upload(gw.port) for _ in range(20)))
            assert [(r.status, r.error()["code"]) for r, _ in outcomes] == [(429, "rate_limit_exceeded")] * 20
            assert rss.growth_mib < UPLOAD_REFUSAL_BOUND_MIB, f"+{rss.growth_mib:.0f} MiB (sent {[s >> 20 for _, s in outcomes]} MiB)"
            await alive()
            assert (await first.finish()).status == 200
            assert gw.transports["audio_api"].running == 0

    run(main)


# ---- 5. the witness under a request flood ---------------------------------------------------------------------------

FLOOD_S, FLOOD_RATE = 2, 1000  # the flooder sends exactly this many requests: FLOOD_RATE a second, or as fast as it can

FLOODER = textwrap.dedent('''
    import asyncio, json, re, sys, time
    from collections import Counter

    port, token, duration_s, rate, workers = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), 50
    body = json.dumps({"model": "x", "input": "Hi.", "voice": "alloy", "response_format": "pcm"}).encode()
    request = (f"POST /v1/audio/speech HTTP/1.1\\r\\nHost: 127.0.0.1\\r\\nAuthorization: Bearer {token}\\r\\n"
               f"Content-Type: application/json\\r\\nContent-Length: {len(body)}\\r\\n\\r\\n").encode() + body
    counts = Counter()

    async def worker(i, t0):
        conn, n = None, 0
        while (at := (i + n * workers) / rate) < duration_s:  # this worker's share of `rate` requests a second
            n += 1
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            try:
                if conn is None:
                    conn = await asyncio.open_connection("127.0.0.1", port)
                reader, writer = conn
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\\r\\n\\r\\n"), 10)
                status = int(head.split(b" ", 2)[1])
                length = re.search(rb"(?i)\\r\\ncontent-length: *(\\d+)", head)
                reply = await asyncio.wait_for(reader.readexactly(int(length[1])) if length else reader.read(), 10)
                if status == 429:
                    status = "rate" if b"from this client" in reply else "busy"
                counts[str(status)] += 1
                if not length or re.search(rb"(?i)\\r\\nconnection: *close", head):
                    writer.close()
                    conn = None
            except Exception as e:
                counts["dropped: " + type(e).__name__] += 1
                conn = None

    async def main():
        t0 = time.monotonic()
        await asyncio.gather(*(worker(i, t0) for i in range(workers)))
        counts["elapsed_ms"] = round(1000 * (time.monotonic() - t0))

    asyncio.run(main())
    print(json.dumps(counts))
''')


def test_a_live_session_keeps_its_audio_pace_beside_a_flood_of_requests():
    """An answer streams on a WebSocket while another process sends 1000 speech requests a second for 2 s
    from one client (the default `limits.http_rate`: 20/s after a burst of 40): nearly all are refused
    429 before their body is read, every one is answered, and the largest gap between the answer's audio
    deltas stays under 100 ms (before issue 39: a 1.36 s gap and a 93 ms round trip). As in
    test_upload_bombs, a window is tried up to 3 times within the one answer and one must be clean: this
    machine's other work can stall any process for 100+ ms now and then; a stall the flood causes would
    be in every window."""
    async def flood(port: int, duration_s: float, rate: float) -> Counter:
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", FLOODER, str(port), TOKEN, str(duration_s), str(rate),
                                                    stdout=subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        return Counter(json.loads(out))

    async def main():
        engine = FakeEngine(answer_ms=12_000, chunk_ms=40, oneshot_step_s=0)
        async with gateway(engine, {"vad": {"enabled": False}}) as gw:
            witness = await AnswerWitness.connect(gw.port, TOKEN)
            assert (await exchange(gw.port, speech_head(), SPEECH)).status == 200  # the endpoint's lazy imports, before the answer
            deltas = await witness.answer()
            windows: list[tuple[float, float]] = []
            floods: list[Counter] = []
            for _ in range(3):
                started = time.monotonic()
                floods.append(await flood(gw.port, FLOOD_S, FLOOD_RATE))
                await asyncio.sleep(0.3)  # a stall would show in the delta after the flood's last request
                windows.append((started, time.monotonic()))
                if max(_gaps(deltas, *windows[-1])) < 0.100:
                    break
            status = await witness.end()
            assert status == "completed" and deltas[-1] > windows[-1][1], "the floods must all have run while the answer streamed"
            for counts in floods:
                # every request answered (200, or 429 for the client's rate or the endpoint's concurrency): no other
                # status, no connection dropped
                assert counts["200"] + counts["rate"] + counts["busy"] == FLOOD_S * FLOOD_RATE, counts
                assert counts["rate"] > FLOOD_S * FLOOD_RATE / 2, counts
                # admitted: at most the burst and the rate over the flood's time (a bucket that has not refilled
                # admits less)
                assert counts["200"] + counts["busy"] <= 40 + 20 * counts["elapsed_ms"] / 1000 + 2, counts
            largest = [round(1000 * max(_gaps(deltas, *w))) for w in windows]
            assert min(largest) < 100, f"largest gap in each window: {largest} ms; floods: {floods}"

    run(main, 90)
