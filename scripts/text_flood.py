"""A hostile client's text against `duplex serve` (tiny model, CPU) while a witness call is answered: what
each attack costs the server and the witness (issue 39). Run it on two checkouts to compare them:

    PYTHONPATH=. python scripts/text_flood.py                 # this tree
    PYTHONPATH=/path/to/other/tree python scripts/text_flood.py

Attacks, one after the other, each on its own connection beside the witness's answer (first 5 s of none):
- `hoard`: `--hoard` assistant messages of ~250 KB (memory the session makes the server hold);
- `instructions`: session.update with 1.9 MB of instructions, `--updates` times;
- `system_items`: system messages of 1.9 MB each, `--items` of them (each joined the instructions, and
  all the system text was tokenized again at each);
Printed per attack: each event's round trip (send -> the server's answer), the witness's largest gap
between two audio deltas of one answer while it ran and its largest ping round trip, and the server's
RSS growth (its process tree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import secrets
import time

import websockets

from realtime.soak.server_process import ServerProcess, process_sample

ZERO_WIDTH = "\u200b"


def huge(n_bytes: int) -> str:
    """Text of about `n_bytes` UTF-8 bytes: words and zero-width spaces (8 bytes, 5 tokens of the tiny model)."""
    return (ZERO_WIDTH + "word ") * (n_bytes // 8)


def item(role: str, text: str) -> str:
    """conversation.item.create of a message holding `text` in parts of 60 000 characters (an older bound
    was 65 536 characters a part, with no bound on the parts)."""
    kind = "input_text" if role == "system" else "output_text"
    parts = [{"type": kind, "text": text[k:k + 60_000]} for k in range(0, len(text), 60_000)]
    return json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": role, "content": parts}},
                      ensure_ascii=False)


async def connect(base: str, token: str, tries: int = 10):
    """A session; a refusal (the last attacker's session still ending) is retried."""
    for _ in range(tries):
        ws = await websockets.connect(base.replace("http", "ws", 1) + "/v1/realtime", max_size=1 << 23,
                                      additional_headers={"Authorization": f"Bearer {token}"})
        if (first := json.loads(await ws.recv()))["type"] == "session.created":
            return ws
        await ws.close()
        await asyncio.sleep(2)
    raise RuntimeError(f"no session: {first}")


async def witness(base: str, token: str, stop: asyncio.Event, arrivals: list[tuple[float, str]],
                  pings: list[tuple[float, float]]) -> None:
    """Answers one after another (the model speaks first), recording when each audio delta arrives (with
    its response), and a WebSocket ping every 20 ms (when its pong came, and its round trip: the server's
    event loop answers it, so a stalled loop shows there whatever the answers do)."""
    ws = await connect(base, token)

    async def ping() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            await (await ws.ping())
            pings.append((time.monotonic(), time.monotonic() - t0))
            await asyncio.sleep(0.02)

    pinger = asyncio.create_task(ping())
    await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}))
    while not stop.is_set():
        await ws.send(json.dumps({"type": "response.create"}))
        while True:
            ev = json.loads(await ws.recv())
            if ev["type"] == "response.output_audio.delta":
                arrivals.append((time.monotonic(), ev["response_id"]))
            elif ev["type"] in ("response.done", "error"):
                break
    await pinger
    await ws.close()


def attack(base: str, token: str, events: list[str], done: tuple[str, ...]) -> tuple[list[float], dict[str, int]]:
    """In its own process (its own costs are neither the server's nor the witness's): each event sent once
    the server answered the last; the round trips, and how many events were accepted or refused (by code)."""

    async def main() -> tuple[list[float], dict[str, int]]:
        ws = await connect(base, token)
        rtts: list[float] = []
        outcomes: dict[str, int] = {}
        try:
            for message in events:
                t0 = time.monotonic()
                await ws.send(message)
                code = "accepted"
                while (ev := json.loads(await ws.recv()))["type"] not in done:
                    code = ev["error"]["code"] if ev["type"] == "error" and ev["error"]["code"] != "input_rate_exceeded" else code
                code = ev["error"]["code"] if ev["type"] == "error" else code
                rtts.append(time.monotonic() - t0)
                outcomes[code] = outcomes.get(code, 0) + 1
        except websockets.ConnectionClosed as e:  # the server ended the session (its input budget)
            outcomes[f"closed {e.rcvd.code if e.rcvd else None}"] = 1
        await ws.close()
        return rtts, outcomes

    return asyncio.run(main())


async def run(args: argparse.Namespace) -> None:
    token = secrets.token_urlsafe(12)
    # the capacity forced and the overload control off (as the soak's fault runs): these runs are about the attacks
    config = {"session": {"max_response_ms": 4000.0}, "engine": {"capacity_override": 4},
              "limits": {"max_message_bytes": 2 << 20, "overload": {"slow_start": False, "degrade": False}}}
    server = await asyncio.to_thread(ServerProcess, config, token)
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        stop, arrivals, pings = asyncio.Event(), [], []
        w = asyncio.create_task(witness(server.base, token, stop, arrivals, pings))
        await asyncio.sleep(5)  # the witness's answers are streaming
        text = huge(1_900_000)
        attacks = {
            "quiet": ([], ()),  # no attack for 5 s: the witness's own gaps on this machine
            "hoard": ([item("assistant", huge(250_000) + str(k)) for k in range(args.hoard)], ("conversation.item.done", "error")),
            "instructions": ([json.dumps({"type": "session.update", "session": {"instructions": text + str(k)}}, ensure_ascii=False)
                              for k in range(args.updates)], ("session.updated",)),
            "system_items": ([item("system", text + str(k)) for k in range(args.items)], ("conversation.item.done", "error")),
        }
        for name, (events, done) in attacks.items():
            await asyncio.sleep(3)  # the last attacker's session ends
            rss0 = process_sample(server.pid).get("rss_mib", 0.0)
            t0 = time.monotonic()
            if events:
                rtts, outcomes = await asyncio.to_thread(pool.apply, attack, (server.base, token, events, done))
            else:
                rtts, outcomes = [], {}
                await asyncio.sleep(5)
            t1 = time.monotonic()
            rss1 = process_sample(server.pid).get("rss_mib", 0.0)
            during = [(t, r) for t, r in arrivals if t0 <= t <= t1]
            gaps = [b - a for (a, ra), (b, rb) in zip(during, during[1:]) if ra == rb]  # within an answer
            rtt = max((r for t, r in pings if t0 <= t <= t1 + 0.5), default=0.0)
            print(f"{name}: {len(events)} events {outcomes}, round trip mean {1000 * sum(rtts) / max(1, len(rtts)):.0f} ms, max "
                  f"{1000 * max(rtts, default=0):.0f} ms (each: {', '.join(f'{1000 * r:.0f}' for r in rtts[:6])}{' ...' if len(rtts) > 6 else ''}); "
                  f"witness: {len(during)} audio deltas, largest gap {1000 * max(gaps, default=0):.0f} ms, "
                  f"largest ping round trip {1000 * rtt:.0f} ms; "
                  f"server RSS {rss0:.0f} -> {rss1:.0f} MiB ({rss1 - rss0:+.0f})", flush=True)
        stop.set()
        await asyncio.wait_for(w, 60)
    finally:
        pool.terminate()
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--items", type=int, default=4)
    p.add_argument("--hoard", type=int, default=200)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
