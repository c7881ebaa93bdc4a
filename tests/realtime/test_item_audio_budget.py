"""Audio inside conversation.item.create is counted by the session's input budget (issue 39: 1,962 s of
it was once accepted in 3.7 s, beside a witness call that got 74 gaps over 190 ms).

The budget (realtime/input_budget.py) takes an item's audio whole, costed from its length before it is
decoded, or refuses the item with an error naming the limit; the session goes on. Sans-I/O first, then
a real gateway (fake engine) on 127.0.0.1 with a flooding client and a witness call beside it. How long
the witness's audio gaps are under such a flood is measured side by side, before and after, by
scripts/bench_item_audio.py (timings are not asserted here).
"""

from __future__ import annotations

import asyncio
import base64
import json

import numpy as np
import pytest
from fake_engine import FakeEngine
from rt_helpers import fake_gateway
from runner_rig import run
from websockets.asyncio.client import connect

import realtime.item_audio
from realtime.audio import WireFormat
from realtime.input_budget import InputBudget, InputLimits
from realtime.item_audio import ItemAudio
from realtime.protocol import RealtimeProtocol, SessionSettings
from realtime.session import Session, SessionLimits
from realtime.session_input import apply_inputs

TOKEN = "s3cret"


def _pcm24_b64(seconds: float, seed: int = 0) -> str:
    pcm = (np.random.default_rng(seed).standard_normal(int(24_000 * seconds)) * 3000).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


def _item(audio_b64: str, item_id: str | None = None, event_id: str | None = None) -> str:
    item = {"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": audio_b64}]}
    if item_id:
        item["id"] = item_id
    return json.dumps({"type": "conversation.item.create", "item": item, **({"event_id": event_id} if event_id else {})})


class DecodeSpy:
    """Counts the item audio decoders made (one per input_audio part decoded)."""

    def __init__(self, monkeypatch) -> None:
        self.made = 0
        real = realtime.item_audio.InputDecoder

        def counted(fmt):
            self.made += 1
            return real(fmt)

        monkeypatch.setattr(realtime.item_audio, "InputDecoder", counted)


# ---- sans-I/O ----------------------------------------------------------------------------------------------


def test_an_items_length_is_known_before_decoding_and_decoding_is_as_before():
    pcm = ItemAudio(((_pcm24_b64(2.5), "item.content[0].audio"),), WireFormat.PCM16)
    assert pcm.seconds == pytest.approx(2.5)
    assert pcm.decode().size == pytest.approx(16_000 * 2.5, abs=32)  # 16 kHz
    ulaw = ItemAudio(((base64.b64encode(bytes(8000)).decode(), "a"), (base64.b64encode(bytes(4000)).decode(), "b")), WireFormat.PCMU)
    assert ulaw.seconds == pytest.approx(1.5) and ulaw.decode().size == pytest.approx(24_000, abs=32)


def test_the_budget_takes_an_item_whole_or_refuses_it_each_time_without_overdrawing():
    lim = InputLimits(audio_rate=2.0, audio_burst_s=10.0, max_item_audio_s=8.0, overrun_close_s=2.0)
    b = InputBudget(lim, now=0.0)
    assert b.item_audio(8.0, 0.0) is None  # from the burst: 2 s left
    r = b.item_audio(8.0, 1.0)  # 2 + 2 = 4 s now: not enough, and nothing is overdrawn
    assert r is not None and r.what == "item_audio" and r.report and r.retry_after_s == pytest.approx(2.0)
    again = b.item_audio(8.0, 1.1)
    assert again is not None and again.report  # each refused item is answered (an append's would wait a second)
    assert b.audio(0.02, 1.2) is None  # the microphone's 20 ms still fit: the refused items took nothing
    assert b.item_audio(8.0, 3.2) is None  # 4.18 + 4 s of refill: it fits
    assert b.rejected_audio_s == 16.0
    assert lim.item_audio_limit() == (8.0, "limits.input.max_item_audio_s")
    assert InputLimits(audio_burst_s=4.0).item_audio_limit() == (4.0, "limits.input.audio_burst_s")  # a longer item never fits
    assert ("max_item_audio_s", "must be > 0") in InputLimits(max_item_audio_s=0).problems()


def test_refused_items_count_as_input_over_budget_and_a_client_that_keeps_on_is_closed():
    b = InputBudget(InputLimits(audio_rate=1.0, audio_burst_s=5.0, max_item_audio_s=5.0, overrun_close_s=2.0), now=0.0)
    assert b.item_audio(5.0, 0.0) is None
    t = 0.1
    while t < 2.2:
        assert b.item_audio(5.0, t) is not None
        t += 0.2
    assert b.exhausted(t)


class Client:
    """A RealtimeProtocol over a real Session, its inputs applied under `budget` as the runner does."""

    def __init__(self, limits: InputLimits, input_format: WireFormat = WireFormat.PCM16) -> None:
        self.session = Session("sess_test", None, SessionLimits())
        self.proto = RealtimeProtocol(self.session, settings=SessionSettings(input_format=input_format))
        self.proto.open()
        self.proto.data_to_send()
        self.now = 100.0
        self.budget = InputBudget(limits, self.now)

    def send(self, message: str) -> list[dict]:
        self.proto.receive(message, self.now)
        apply_inputs(self.proto, self.session, self.now, self.budget)
        self.proto.send_session_events(self.session.events())
        return [json.loads(m) for m in self.proto.data_to_send() if isinstance(m, str)]


def test_an_item_beyond_the_cap_or_the_budget_is_refused_before_its_audio_is_decoded(monkeypatch):
    spy = DecodeSpy(monkeypatch)
    c = Client(InputLimits(audio_rate=1.0, audio_burst_s=4.0, max_item_audio_s=3.0))
    not_base64 = "!" * 200_000  # 3.75 s "of audio" that is not base64: decoding it would say so
    [e] = c.send(_item(not_base64, "big", "ev_big"))
    assert e["type"] == "error" and e["error"]["code"] == "audio_too_large" and e["error"]["param"] == "item.content[0].audio"
    assert "3 s of audio (limits.input.max_item_audio_s)" in e["error"]["message"] and e["error"]["event_id"] == "ev_big"
    kinds = [ev["type"] for ev in c.send(_item(_pcm24_b64(2.9), "a"))]  # 2.9 s of the 4 s burst
    assert kinds == ["conversation.item.added", "conversation.item.done"]
    [e] = c.send(_item(not_base64[:128_000], "b", "ev_b"))  # 2 s, 1.1 s left: over budget, not decoded
    assert e["error"]["code"] == "input_rate_exceeded" and e["error"]["param"] == "item" and e["error"]["event_id"] == "ev_b"
    assert "would fit in 0.9 s" in e["error"]["message"] and "1x real time after a 4 s burst" in e["error"]["message"]
    assert spy.made == 1  # the one item taken
    c.now += 1.2
    [e] = c.send(_item(not_base64[:128_000], "b"))  # now within the budget: decoded, and refused for what it is
    assert e["error"]["code"] == "invalid_base64" and e["error"]["param"] == "item.content[0].audio"
    c.now += 3.0
    kinds = [ev["type"] for ev in c.send(_item(_pcm24_b64(1.0), "b"))]  # the refused ids were never added
    assert kinds == ["conversation.item.added", "conversation.item.done"]
    assert spy.made == 2 and c.budget.rejected_audio_s == pytest.approx(2.0)


def test_g711_items_are_costed_at_their_own_rate():
    c = Client(InputLimits(audio_rate=1.0, audio_burst_s=10.0, max_item_audio_s=10.0), WireFormat.PCMU)
    ok = base64.b64encode(bytes(8000 * 6)).decode()  # 6 s of μ-law (48 KB: as much as 1 s of pcm16)
    assert [ev["type"] for ev in c.send(_item(ok, "a"))] == ["conversation.item.added", "conversation.item.done"]
    [e] = c.send(_item(ok, "b"))
    assert e["error"]["code"] == "input_rate_exceeded" and "6.0 s of audio" in e["error"]["message"]
    [e] = c.send(_item(base64.b64encode(bytes(8000 * 190)).decode(), "c"))  # a 2 MiB message of G.711: 190 s
    assert e["error"]["code"] == "audio_too_large" and "190.0 s" in e["error"]["message"]


# ---- a real gateway on 127.0.0.1 ----------------------------------------------------------------------------


# the messages' weight is not what this test is about: its bucket holds the whole flood (21 MB)
LIMITS = {"audio_rate": 4.0, "audio_burst_s": 3.0, "max_item_audio_s": 1.0, "overrun_close_s": 600.0,
          "message_bytes_per_s": 1e9, "message_bytes_burst": 1e9}


def test_a_flood_of_item_audio_is_refused_beyond_the_budget_and_the_session_and_a_witness_go_on(monkeypatch):
    spy = DecodeSpy(monkeypatch)

    async def main():
        engine = FakeEngine(capacity=4, answer_ms=1200, chunk_ms=40)
        async with fake_gateway(engine, {"limits": {"input": LIMITS}}, token=TOKEN) as gw:
            url = f"ws://127.0.0.1:{gw.port}/v1/realtime?token={TOKEN}"
            async with connect(url, max_size=None) as flood, connect(url, max_size=None) as witness:
                for ws in (flood, witness):
                    assert json.loads(await ws.recv())["type"] == "session.created"
                    await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}}))
                await witness.send(json.dumps({"type": "response.create"}))
                second = _pcm24_b64(1.0)
                t0 = asyncio.get_running_loop().time()
                for n in range(300):  # 300 s of audio in items, sent as fast as the socket takes them
                    await flood.send(_item(second, f"i{n}", f"ev_{n}"))
                    if n % 50 == 0:
                        await flood.send(_item(_pcm24_b64(5.0), f"big{n}", f"ev_big{n}"))  # beyond the cap
                answered: dict[str, str] = {}  # client event id -> how the server answered it
                while len(answered) < 306:
                    ev = json.loads(await asyncio.wait_for(flood.recv(), 10))
                    if ev["type"] == "conversation.item.done":
                        answered["ev_" + ev["item"]["id"][1:]] = "added"
                    elif ev["type"] == "error":
                        answered[ev["error"]["event_id"]] = ev["error"]["code"]
                elapsed = asyncio.get_running_loop().time() - t0
                added = [k for k, v in answered.items() if v == "added"]
                codes = {v for k, v in answered.items() if k.startswith("ev_big")}
                assert codes == {"audio_too_large"}, answered
                assert {v for k, v in answered.items() if not k.startswith("ev_big")} == {"added", "input_rate_exceeded"}
                # the burst, then the rate: never more (it was 300 s before the budget saw item audio)
                assert 3 <= len(added) <= 3 + 4.0 * elapsed + 1, (len(added), elapsed)
                assert spy.made == len(added)  # refused items were never decoded
                refused = sum(v == "input_rate_exceeded" for v in answered.values())
                assert gw.metrics.registry.get_sample_value("duplex_input_rejected_total", {"kind": "item_audio"}) == refused
                conv = engine.conversations[next(iter(engine.conversations))]
                assert sum(a.size for turn in conv.user_turns for a in turn) == pytest.approx(16_000 * len(added), abs=32 * len(added))

                # the witness's answer, beside the flood: whole, and no error
                deltas, kinds = 0, []
                while "response.done" not in kinds:
                    ev = json.loads(await asyncio.wait_for(witness.recv(), 10))
                    kinds.append(ev["type"])
                    deltas += ev["type"] == "response.output_audio.delta"
                assert "error" not in kinds and deltas == 1200 // 40

                # the flooding session goes on: once the budget has refilled, an item is taken and answered
                await asyncio.sleep(0.3)
                await flood.send(_item(second, "after", "ev_after"))
                await flood.send(json.dumps({"type": "response.create"}))
                kinds = []
                while "response.done" not in kinds:
                    ev = json.loads(await asyncio.wait_for(flood.recv(), 10))
                    kinds.append(ev["type"])
                    assert ev["type"] != "error", ev
                    if ev["type"] == "response.done":
                        assert ev["response"]["status"] == "completed"
                assert kinds[:2] == ["conversation.item.added", "conversation.item.done"]

    run(main)


# ---- what messages weigh -----------------------------------------------------------------------------------


def test_messages_are_weighed_and_one_larger_than_the_burst_is_still_read_once_the_bucket_is_full():
    lim = InputLimits(message_bytes_per_s=1000.0, message_bytes_burst=4000.0)
    b = InputBudget(lim, now=0.0)
    assert b.message(0.0, 3000) is None
    r = b.message(0.0, 2000)  # 1000 left: held back, and told why and for how long
    assert r is not None and r.what == "bytes" and r.retry_after_s == pytest.approx(1.0)
    assert b.message(1.0, 2000) is None
    assert b.message(1.0, 10**9) is not None and b.message(5.0, 10**9) is None  # larger than the burst: a full bucket takes it
    assert b.message(5.0, 0) is None  # the count is its own bucket
    held = InputBudget(InputLimits(message_bytes_per_s=1000.0, message_bytes_burst=4000.0, overrun_close_s=5.0), now=0.0)
    t, closed_at = 0.0, None
    for _ in range(12):  # a client always waiting with the next 4 KB (each wait, 4 s, longer than the pause that ends an overrun)
        r = held.message(t, 4000)
        if held.exhausted(t):
            closed_at = t
            break
        t += 0 if r is None else r.retry_after_s
    assert closed_at == 8.0  # over budget since 0 s: closed at the first look after overrun_close_s


def test_a_flood_of_heavy_messages_is_held_back_unread_then_closed():
    from runner_rig import MemoryLink, Rig

    from realtime.messages import CloseReason

    async def main():
        limits = {"message_bytes_per_s": 100_000, "message_bytes_burst": 200_000, "overrun_close_s": 0.5}
        rig = Rig(FakeEngine(), {"limits": {"input": limits}})
        link = MemoryLink()
        runner = rig.open(link)
        heavy = "{" + "x" * 49_999  # 50 KB that would be an invalid_json error each, if it were parsed
        t0 = asyncio.get_running_loop().time()
        link.feed(*[heavy] * 200)  # 10 MB at once
        await rig.ended(runner)
        elapsed = asyncio.get_running_loop().time() - t0
        errors = [e["error"] for e in link.of("error")]
        parsed = sum(e["code"] == "invalid_json" for e in errors)
        assert 4 <= parsed <= 4 + 2 * elapsed + 1, (parsed, elapsed)  # the burst, then 100 KB a second
        assert link._in.qsize() > 150  # the rest never read
        rate = [e for e in errors if e["code"] == "input_rate_exceeded"]
        assert rate and "0.0953674 MiB a second" in rate[0]["message"] and errors[-1]["code"] == "input_rate_exceeded"
        assert runner.end_reason() is CloseReason.POLICY and link.closes[-1][0] == 1008
        assert rig.metric("duplex_input_rejected_total", kind="bytes") >= 1

    run(main)
