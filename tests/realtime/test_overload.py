"""Overload control (realtime/overload.py, issue 40): slow start of admissions and graceful degradation.

The rules themselves run on virtual time (`SlowStart`, `Ladder`: time is passed in). The gateway's use of
them runs over real sockets on 127.0.0.1 against the fake engine whose step clock costs time per row
(a CFG answer is two) and slows down after admission, as a machine that turns out slower than its
warm-up said: slow start refuses a burst's tail on the one refusal path, dropping CFG keeps the
admitted calls' new answers on time, the length and CFG come back when the machine does, and only
when nothing cheaper helps the newest call is ended with `server_overloaded` and `retry_after_s`.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import websockets
from fake_engine import FakeEngine
from runner_rig import until

from engine.service_api import NO_DEGRADATION, ConversationOptions, Degradation
from realtime.config import config_from_dict
from realtime.overload import Candidate, Delivery, Ladder, OverloadLimits, SlowStart
from realtime.server import Gateway

TOKEN = "overload-token"


# ---- the rules, on virtual time ------------------------------------------------------------------------


def test_slow_start_first_step_is_bounded_by_the_priors_and_grows_only_on_confirmed_load():
    lim = OverloadLimits(first_step=4, max_step=8, confirm_s=5.0, confirm_chunks=50)
    s = SlowStart(lim)
    assert s.refusal(0.0, 0, prior_capacity=7) is None and s.step == 4  # min(first_step, the priors' 7)
    for n in range(1, 4):
        assert s.refusal(0.1 * n, n, 7) is None
    why = s.refusal(0.5, 4, 7)  # the burst's fifth caller
    assert why is not None and "slow start admits 4" in why and "0 confirmed" in why
    s.admitted(4)
    s.observe(3.0, 4, Delivery(200, 0, 0), live_bound=6, degraded=False)  # the window is not over
    assert (s.confirmed, s.step) == (0, 4)
    s.observe(5.0, 4, Delivery(100, 2, 0), live_bound=6, degraded=False)  # on time (late inside the lead is no gap)
    assert (s.confirmed, s.step, s.allowed) == (4, 8, 12)
    assert s.refusal(5.1, 11, 7) is None and s.refusal(5.2, 12, 7) is not None
    # a window whose load was not used (nobody new came) confirms the level but does not grow the step
    s.observe(10.0, 6, Delivery(300, 0, 0), live_bound=6, degraded=False)
    assert (s.confirmed, s.step) == (6, 8)
    # the live bound caps what a window confirms: the model disagrees with more
    s.admitted(14)
    s.observe(15.0, 14, Delivery(300, 0, 0), live_bound=9, degraded=False)
    assert s.confirmed == 9


def test_slow_start_waits_for_evidence_and_steps_back_on_lateness():
    lim = OverloadLimits(first_step=4, confirm_s=5.0, confirm_chunks=50)
    s = SlowStart(lim)
    assert s.refusal(0.0, 0, prior_capacity=2) is None and s.step == 2  # a machine whose priors say 2: 2
    s.admitted(2)
    s.observe(6.0, 2, Delivery(10, 0, 0), live_bound=8, degraded=False)  # silence proves nothing: the window goes on
    assert (s.confirmed, s.step) == (0, 2)
    s.observe(7.0, 2, Delivery(100, 0, 0), live_bound=8, degraded=False)
    assert (s.confirmed, s.step) == (2, 4)
    s.observe(12.0, 2, Delivery(400, 30, 5), live_bound=8, degraded=False)  # 5 of 400 heard late: > 0.5 %
    assert (s.confirmed, s.step) == (2, 1)
    s.observe(17.0, 3, Delivery(400, 0, 0), live_bound=8, degraded=True)  # calls degraded: nobody new
    assert (s.confirmed, s.step) == (2, 0) and s.refusal(17.1, 2, 8) is not None
    s.observe(22.0, 2, Delivery(400, 0, 0), live_bound=8, degraded=False)
    assert (s.confirmed, s.step) == (2, 1)


def test_slow_start_restarts_after_a_window_with_no_call():
    """Lateness heard with calls open says nothing of an idle server (TCP's restart after idle): once a whole
    window passed with no call, the first step is allowed again; a window with calls in it does not count."""
    lim = OverloadLimits(first_step=4, confirm_s=5.0, confirm_chunks=50)
    s = SlowStart(lim)
    assert s.refusal(0.0, 0, prior_capacity=8) is None
    s.admitted(3)
    s.observe(5.0, 3, Delivery(400, 0, 9), live_bound=8, degraded=False)  # heard late: one more at a time
    assert (s.confirmed, s.step) == (0, 1) and s.refusal(5.1, 1, 8) is not None
    s.observe(10.0, 0, Delivery(0, 0, 0), live_bound=8, degraded=False)  # the calls ended within this window
    assert s.step == 1
    s.observe(15.0, 0, Delivery(0, 0, 0), live_bound=8, degraded=False)  # a whole window with none
    assert (s.confirmed, s.step) == (0, 4) and s.refusal(15.1, 3, 8) is None and s.refusal(15.2, 4, 8) is not None


def test_the_ladder_degrades_cheapest_first_sheds_last_and_recovers_in_reverse():
    lim = OverloadLimits(escalate_s=2.0, shed_after_s=5.0, recover_s=10.0, short_response_ms=1500.0)
    lad = Ladder(lim)
    sessions = [Candidate("a", True), Candidate("b", True), Candidate("c", False), Candidate("d", True)]  # oldest first
    assert lad.step(0.0, behind=False, late=False, sessions=sessions) is None
    assert lad.step(1.0, True, False, sessions) == ("cfg_off", ("d", "b"))  # the newest half of those with CFG
    assert lad.degradation("d") == Degradation(cfg=False) and lad.degradation("c") == NO_DEGRADATION
    assert lad.step(2.0, True, True, sessions) is None  # one step every escalate_s
    assert lad.step(3.0, True, True, sessions) == ("cfg_off", ("a",))
    assert lad.step(5.0, True, False, sessions) == ("short", ())
    assert lad.degradation("c") == Degradation(max_response_ms=1500.0)
    assert lad.step(9.0, True, False, sessions) is None  # predicted behind, nothing late: nobody is ended
    assert lad.step(10.0, True, True, sessions) == ("shed", ("d",))  # late 5 s after the last step: the newest
    sessions = sessions[:3]
    assert lad.step(12.0, True, True, sessions) is None
    assert lad.step(15.0, True, True, sessions) == ("shed", ("c",))
    assert lad.step(25.0, True, True, sessions[:1]) is None  # the last session is never ended
    # on time again: one step back every recover_s, the last step first
    assert lad.step(26.0, False, False, sessions[:1]) is None
    assert lad.step(36.0, False, False, sessions[:1]) == ("length_back", ())
    assert lad.step(40.0, False, False, sessions[:1]) is None
    assert lad.step(46.0, False, False, sessions[:1]) == ("cfg_on", ("a",))
    assert not lad.degraded and lad.degradation("a") == NO_DEGRADATION


def test_a_degradation_takes_cfg_and_length_from_the_next_answers_only_while_it_lasts():
    opts = ConversationOptions(cfg_scale=2.5, max_response_ms=8000.0)
    assert Degradation(cfg=False, max_response_ms=2000.0).apply(opts) == ConversationOptions(cfg_scale=1.0, max_response_ms=2000.0)
    assert Degradation(max_response_ms=9000.0).apply(opts) is opts  # never longer than the client asked
    assert NO_DEGRADATION.apply(opts) is opts
    with pytest.raises(ValueError, match="limits.overload.first_step"):
        config_from_dict({"limits": {"overload": {"first_step": 0}}})


# ---- the gateway, over real sockets, on the fake engine ------------------------------------------------


def _config(**overload) -> dict:
    return {"server": {"port": 0}, "vad": {"enabled": False}, "limits": {"retry_after_s": 3, "overload": {
        "tick_s": 0.05, "window_s": 0.6, "late_share": 0.02, "min_late": 1, "escalate_s": 0.3, "recover_s": 0.8, **overload}}}


async def _connect(port: int):
    return await websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime?duplex=1", additional_headers={"Authorization": f"Bearer {TOKEN}"})


async def _answer(ws) -> dict:
    """One answer to an empty turn (turn detection off: the client asks), read to its response.done."""
    await ws.send(json.dumps({"type": "response.create"}))
    while True:
        ev = json.loads(await ws.recv())
        if ev["type"] == "response.done":
            return ev["response"]
        assert ev["type"] != "error", ev


async def _converse(ws, stop: asyncio.Event) -> None:
    while not stop.is_set():
        assert (await _answer(ws))["status"] == "completed"


def _healthz(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        assert e.code == 503
        return json.loads(e.read())


def _on_time(handle) -> bool:
    return all(at <= c.deadline for c, at in zip(handle.produced, handle.produced_at))


def test_slow_start_refuses_the_bursts_tail_then_cfg_off_keeps_the_admitted_on_time_and_comes_back():
    async def main():
        # 40 ms of audio a step; each row costs 4 ms: 2 CFG calls (4 rows) take 16 ms, in real time ...
        engine = FakeEngine(capacity=8, answer_ms=1200, chunk_ms=40, row_s=0.004, deadline_offset_s=0.3)
        cfg = _config(first_step=2, confirm_s=60.0)
        cfg["session"] = {"cfg_scale": 2.0}
        gw = Gateway(engine, config_from_dict(cfg), token=TOKEN)
        await gw.start()
        try:
            # a burst of 5 callers before any live data: the first step (2) is admitted, the tail refused
            conns = await asyncio.gather(*(_connect(gw.port) for _ in range(5)))
            first = [json.loads(await ws.recv()) for ws in conns]
            admitted = [ws for ws, ev in zip(conns, first) if ev["type"] == "session.created"]
            refused = [ev for ev in first if ev["type"] == "error"]
            assert len(admitted) == 2 and len(refused) == 3, first
            for ev in refused:
                assert ev["error"]["code"] == "server_at_capacity" and ev["error"]["retry_after_s"] == 3
                assert "slow start" in ev["error"]["message"]
            assert gw.metrics.registry.get_sample_value("duplex_sessions_refused_total", {"reason": "slow_start"}) == 3
            health = await asyncio.to_thread(_healthz, gw.port)  # a balancer sends the next callers elsewhere
            assert health["at_capacity"] is True and "slow start" in health["reason"] and health["retry_after_s"] == 3
            convs = [engine.conversation(r.id) for r in gw.admission.sessions.values()]
            # ... then the machine turns out 4x slower: 4 rows take 64 ms a 40 ms step, 2 rows 32 ms
            engine.slowdown = 4.0
            stop = asyncio.Event()
            talk = [asyncio.create_task(_converse(ws, stop)) for ws in admitted]
            await until(lambda: all(not c.degradation.cfg for c in convs), "CFG off for both calls", timeout=20)
            dropped_at = {c.id: len(c.handles) for c in convs}
            slow_cfg = [h for c in convs for h in c.handles[:dropped_at[c.id]] if h.options.cfg_scale == 2.0]
            assert any(not _on_time(h) for h in slow_cfg)  # with CFG the slower machine was late: that is what was fixed
            await until(lambda: all(len(c.handles) >= dropped_at[c.id] + 2 for c in convs), "two answers each without CFG",
                        timeout=20)
            for c in convs:  # every answer started without CFG's shadow was on time on the slower machine
                new = [h for h in c.handles[dropped_at[c.id]:] if h.ended]
                assert new and all(h.options.cfg_scale == 1.0 and _on_time(h) for h in new), [
                    (h.options.cfg_scale, _on_time(h)) for h in new]
                assert c.options.cfg_scale == 2.0  # the client's own setting is kept
            assert gw.metrics.registry.get_sample_value("duplex_overload_steps_total", {"step": "cfg_off"}) >= 1
            # the machine is fast again: the steps are undone, CFG last
            engine.slowdown = 1.0
            await until(lambda: all(c.degradation == NO_DEGRADATION for c in convs), "CFG back", timeout=20)
            back_at = {c.id: len(c.handles) for c in convs}
            await until(lambda: all(len(c.handles) > back_at[c.id] for c in convs), "an answer after the recovery", timeout=20)
            assert all(c.handles[back_at[c.id]].options.cfg_scale == 2.0 for c in convs)
            assert gw.metrics.registry.get_sample_value("duplex_overload_steps_total", {"step": "cfg_on"}) >= 1
            stop.set()
            await asyncio.gather(*talk)
            for ws in conns:
                await ws.close()
        finally:
            await gw.stop()

    asyncio.run(asyncio.wait_for(main(), 90))


def test_when_nothing_cheaper_helps_the_newest_call_is_ended_with_server_overloaded():
    async def main():
        engine = FakeEngine(capacity=8, answer_ms=1200, chunk_ms=40, row_s=0.004, deadline_offset_s=0.2)
        gw = Gateway(engine, config_from_dict(_config(shed_after_s=0.5, short_response_ms=1000.0)), token=TOKEN)
        await gw.start()
        try:
            conns = []
            for _ in range(3):
                ws = await _connect(gw.port)
                assert json.loads(await ws.recv())["type"] == "session.created"
                conns.append(ws)
            engine.slowdown = 5.0  # 3 rows: 60 ms a 40 ms step; 1 row: 20 ms
            stop = asyncio.Event()
            errors: list[list[dict]] = [[], [], []]

            async def talk(k: int) -> None:
                ws = conns[k]
                try:
                    while not stop.is_set():
                        await ws.send(json.dumps({"type": "response.create"}))
                        while (ev := json.loads(await ws.recv()))["type"] != "response.done":
                            if ev["type"] == "error":
                                errors[k].append(ev["error"])
                except websockets.ConnectionClosed:
                    pass

            tasks = [asyncio.create_task(talk(k)) for k in range(3)]
            await until(lambda: conns[2].close_code is not None and conns[1].close_code is not None, "the two newest ended",
                        timeout=30)
            for k in (1, 2):
                assert conns[k].close_code == 1013, conns[k].close_reason
                err = errors[k][-1]
                assert err["code"] == "server_overloaded" and err["retry_after_s"] == 3 and "try again in 3 s" in err["message"]
            await asyncio.sleep(1.0)
            assert conns[0].close_code is None and errors[0] == []  # the oldest (the last one) is never ended
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_overload_steps_total", {"step": "short"}) == 1 and m("duplex_overload_steps_total", {"step": "shed"}) == 2
            assert m("duplex_sessions_ended_total", {"transport": "websocket", "reason": "server_overloaded"}) == 2
            oldest = engine.conversation(next(iter(gw.admission.sessions)))
            assert oldest.degradation == Degradation(max_response_ms=1000.0)
            assert oldest.handles[-1].options.max_response_ms == 1000.0 or not oldest.handles[-1].started
            stop.set()
            await conns[0].close()
            await asyncio.gather(*tasks)
        finally:
            await gw.stop()

    asyncio.run(asyncio.wait_for(main(), 90))
