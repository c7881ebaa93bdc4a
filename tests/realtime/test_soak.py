"""The short soak and the fault runs, each against its own `duplex serve` (tiny model, CPU).

The long versions are script runs documented in docs/soak.md; these assert what must hold on any
machine: nothing lost, every frame accounted, no crash, no error for honest callers, the server
healthy afterwards and exiting 0. Latency figures are reported, never asserted.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _needs_espeak(speech):
    return speech


def test_short_soak_every_frame_accounted(tmp_path, tiny_model):
    from realtime.soak.run import SoakConfig, run_soak

    cfg = SoakConfig(sessions=4, duration_s=20.0, ramp_s=2.0, mix=("ws-pcm16", "ws-opus", "webrtc", "twilio"), barge_in=0.3,
                     seed=1, out_dir=tmp_path, capacity=4)
    report = json.loads(asyncio.run(run_soak(cfg)).read_text())
    o = report["overall"]
    assert report["sessions_crashed"] == 0, report["callers"]
    assert report["frames_unaccounted"] == 0, report["accounting"]
    assert report["accounting"]["frames_consumed"] > 0.9 * report["accounting"]["frames_sent"]
    assert o["refused"] == {} and o["errors"] == {} and o["closed_by_server"] == 0, report["callers"]
    assert o["answers"] >= 1 and o["failed"] == 0
    assert set(report["by_transport"]) == {"ws-pcm16", "ws-opus", "webrtc", "twilio"}
    assert report["server"]["healthy_after"] and report["server"]["exit_code"] == 0
    assert (tmp_path / report["plot"].rsplit("/", 1)[1]).exists()
    # /healthz answers 503 while the forced cap is reached; the timeline still holds the model's bounds
    cap = report["capacity"]
    assert cap is not None and cap["samples"] > 5 and cap["limited_by"] in ("engine", "cpu", "max_conversations")


def test_a_burst_meets_slow_start_on_the_real_engine(tmp_path, tiny_model):
    """8 callers within half a second (issue 40): the first step (3 here; the priors allow 8) is admitted,
    the rest refused by slow start with server_at_capacity; the admitted calls lose nothing."""
    from realtime.soak.run import SoakConfig, run_soak

    cfg = SoakConfig(sessions=8, duration_s=12.0, ramp_s=0.5, mix=("ws-pcm16", "ws-opus", "webrtc", "twilio"), barge_in=0.2,
                     seed=2, out_dir=tmp_path, capacity=8, server_config={"limits": {"overload": {"first_step": 3}}})
    report = json.loads(asyncio.run(run_soak(cfg)).read_text())
    o, ov = report["overall"], report["overload"]
    assert o["admitted"] == 3 and o["refused"] == {"server_at_capacity": 5}, report["callers"]
    assert ov["refused_slow_start"] == 5 and ov["refused_capacity"] == 0, ov
    assert report["sessions_crashed"] == 0 and o["shed"] == 0, report["callers"]
    assert report["frames_unaccounted"] == 0, report["accounting"]
    assert o["answers"] >= 1 and o["failed"] == 0
    assert report["server"]["healthy_after"] and report["server"]["exit_code"] == 0


def test_fault_runs_leave_the_server_and_the_witness_unharmed(tmp_path, tiny_model):
    from realtime.soak.faults import FAULT_SERVER_CONFIG, run_faults

    report = json.loads(asyncio.run(run_faults(tmp_path)).read_text())
    faults, witness = report["faults"], report["witness"]
    for name, result in faults.items():
        assert "fault_client_error" not in result, (name, result)
        assert result["healthy_after"], (name, result)
    assert faults["slowloris"]["closed_by_server_after_s"] < FAULT_SERVER_CONFIG["limits"]["open_timeout_s"] + 2
    assert report["metrics_delta"]["duplex_handshakes_incomplete_total"] >= faults["slowloris"]["connections"]
    counted = report["metrics_delta"]

    def count(name: str, label: str = "") -> float:
        return sum(v for k, v in counted.items() if k.startswith(name) and label in k)

    # each fault is visible in the server's own metrics
    assert count("duplex_sessions_ended_total", 'reason="connection_lost"') >= 1  # vanished, not resumed in the grace
    assert count("duplex_sessions_ended_total", 'reason="message_too_big"') >= 1
    assert count("duplex_client_errors_total") >= 5  # the garbage frames
    assert faults["oversize_and_garbage"]["oversize_close_code"] == 1009
    assert faults["oversize_and_garbage"]["error_codes"] == ["invalid_binary_frame", "invalid_binary_frame", "invalid_audio",
                                                             "invalid_json", "unknown_event_type"]
    assert faults["engine_stall"].get("answer_status", "completed") == "completed"
    assert faults["slow_reader"]["answer_after_resuming"] is not False
    assert faults["lone_surrogates"] == {**faults["lone_surrogates"], "error_codes": ["invalid_json"] * 3, "went_on": True}
    assert faults["text_hoard"]["outcomes"] == {"string_above_max_length": 16, "accepted": 1024, "conversation_limit_exceeded": 6}
    bombs = faults["upload_bombs"]  # each a 400 naming the problem, the gateway's memory bounded (issue 39)
    assert all(got.startswith("400 ") for per_file in bombs["outcomes"].values() for got in per_file), bombs
    assert sum(n for per_file in bombs["outcomes"].values() for n in per_file.values()) == bombs["uploads"]
    for name in ("lone_surrogates", "text_hoard", "upload_bombs"):  # witnessed: the memory each took is bounded
        assert faults[name]["gateway_rss_peak_growth_mib"] < 100, (name, faults[name])
        assert faults[name]["witness_lost"] is None, (name, faults[name])
    assert witness["errors"] == [] and witness["crashed"] is None and witness["closed_by_server"] is None
    assert witness["answers"] >= 1
    # the floods: each abusive client is cut off by its budget (or as a slow reader of its own errors), the
    # vanished ones keep nobody out, and the second witness lost nothing (its latencies are the run's report,
    # docs/soak.md: timing is not asserted here)
    floods = report["floods"]["floods"]
    for kind in ("dtx_opus", "big_appends"):
        # the budget refused its input (an error at most once a second); closed 1008 if the flood outlasted
        # the burst allowance and overrun_close_s, else it ended first (its length is the machine's speed)
        client = floods[kind]["client"]
        assert client["outcome"] == "flood ended" or client["outcome"].startswith("closed 1008"), floods[kind]
        assert client["errors"].get("input_rate_exceeded", 0) >= 1 or "budget" in client["outcome"], floods[kind]
    assert floods["vanish_idle"]["client"]["refused"] == 0 and floods["vanish_idle"]["client"]["admitted"] >= 10
    assert set(floods["twilio_before_start"]["client"]["outcomes"]) == {"ConnectionClosedError"}
    assert report["floods"]["witness"]["lost"] is None and report["floods"]["witness"]["errors"] == []
    assert report["floods"]["witness"]["answers_completed"] >= 5
    assert count("duplex_input_rejected_total") > 0
    assert report["server_exit_code"] == 0


def test_accounting_counts_frames_sent_to_a_refused_call_as_refused_not_lost():
    from realtime.soak.callers import CallerRecord
    from realtime.soak.report import accounting

    records = [CallerRecord("ws-opus", 0, frames_sent=100), CallerRecord("twilio", 1, frames_sent=1, refused="server_at_capacity")]
    before = {"duplex_input_frames_total": 10.0}
    after = {"duplex_input_frames_total": 108.0, 'duplex_input_frames_dropped_total{transport="ws",reason="x"}': 2.0}
    acct = accounting(records, before, after)
    assert acct["frames_to_refused_calls"] == 1 and acct["frames_unaccounted"] == 0
    after["duplex_input_frames_total"] = 107.0  # one of the admitted caller's frames went nowhere
    assert accounting(records, before, after)["frames_unaccounted"] == 1


def test_the_report_takes_the_models_prediction_after_the_ramp():
    from realtime.soak.report import predicted_capacity

    timeline = [{"t": 1.0, "bounds": {"engine": 16, "cpu": 2}},  # during the ramp: left out
                {"t": 8.0, "ready": False, "detail": "HTTP 503"},  # no bounds: left out
                *({"t": 8.0 + k, "bounds": {"engine": 16, "cpu": c}} for k, c in enumerate((7, 8, 8, 9, 8)))]
    assert predicted_capacity(timeline, ramp_s=2.0) == {"predicted_p50": 8, "predicted_min": 7, "predicted_max": 9,
                                                       "limited_by": "cpu", "samples": 5}
    assert predicted_capacity(timeline[:2], ramp_s=2.0) is None


def test_the_report_reads_what_the_overload_control_did_from_the_metrics():
    from realtime.soak.report import overload

    delta = {'duplex_sessions_refused_total{reason="slow_start"}': 9.0, 'duplex_sessions_refused_total{reason="capacity"}': 2.0,
             'duplex_overload_steps_total{step="short"}': 1.0, 'duplex_overload_steps_total{step="cfg_off"}': 0.0,
             'duplex_overload_steps_total{step="shed"}': 1.0,
             'duplex_sessions_ended_total{transport="websocket",reason="server_overloaded"}': 1.0,
             'duplex_sessions_ended_total{transport="twilio",reason="client_closed"}': 3.0}
    assert overload(delta) == {"refused_slow_start": 9, "refused_capacity": 2, "degradation_steps": {"short": 1, "shed": 1}, "shed": 1}
