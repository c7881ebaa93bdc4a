"""Prometheus metrics of the gateway (`GET /metrics`), one registry per server instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.service_api import EngineLike
from realtime.session import SessionStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.sessions_active = Gauge("duplex_sessions_active", "Sessions open now", registry=r)
        self.sessions_total = Counter("duplex_sessions", "Sessions accepted since start", registry=r)
        self.sessions_refused = Counter("duplex_sessions_refused", "Sessions refused", ["reason"], registry=r)
        self.telephony_faults = Counter("duplex_telephony_faults", "Bad Twilio Media Streams input (message skipped or stream closed)", ["kind"], registry=r)
        self.ttfa = Histogram(
            "duplex_time_to_first_audio_seconds", "End of user speech to the first audio frame sent",
            buckets=(0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0), registry=r,
        )
        self.chunks_late = Counter("duplex_chunks_late", "Engine audio chunks received after their playback deadline", registry=r)
        self.underruns = Counter("duplex_client_underruns", "Playback underruns reported by clients", registry=r)
        self.barge_ins = Counter("duplex_barge_ins", "Responses interrupted by user speech", registry=r)
        self.responses = Counter("duplex_responses", "Responses by final status", ["status"], registry=r)
        self.client_errors = Counter("duplex_client_errors", "error events sent for bad client input", registry=r)
        self.sessions_with_tools = Counter("duplex_sessions_with_tools", "Ended sessions whose client offered function tools "
                                           "(accepted under tool_choice auto/none; OpusLM calls none)", registry=r)
        self.input_frames = Counter("duplex_input_frames", "Client audio frames consumed by sessions (all transports)", registry=r)
        self.sessions_ended = Counter("duplex_sessions_ended", "Sessions ended, by transport and reason", ["transport", "reason"], registry=r)
        self.handshakes_incomplete = Counter("duplex_handshakes_incomplete", "Connections closed before a complete HTTP request (slow or dropped handshakes)", registry=r)
        self.frames_dropped = Counter("duplex_input_frames_dropped", "Client audio frames dropped by policy", ["transport", "reason"], registry=r)
        self.input_rejected = Counter("duplex_input_rejected", "Client input beyond its session's budget (limits.input): audio frames or messages dropped, items with audio refused (kind item_audio)", ["kind"], registry=r)
        self.speculative = Counter("duplex_speculative_responses", "Answers started at a pause in the user's speech, by outcome: confirmed (the turn ended; sent) or discarded (the user went on; never sent)", ["outcome"], registry=r)
        self.exchanges_dropped = Counter("duplex_context_exchanges_dropped", "Exchanges (a user turn and its answer) dropped from conversations to fit the model's context", registry=r)
        self.auth_failures = Counter("duplex_auth_failures", "Requests refused for a missing, malformed or wrong credential", ["endpoint"], registry=r)
        self.http_rate_limited = Counter("duplex_http_rate_limited", "HTTP requests refused (429) for their client's request rate (limits.http_rate)", registry=r)
        self.webrtc_peers = Gauge("duplex_webrtc_peer_connections", "WebRTC peer connections alive", registry=r)
        # the one-shot audio endpoints (realtime/transports/audio_api.py); endpoint: transcriptions | speech
        self.audio_requests = Counter("duplex_audio_api_requests", "One-shot audio requests by endpoint and outcome "
                                      "(ok, bad_request, unauthorized, too_large, busy, at_capacity, engine_error, client_gone...)",
                                      ["endpoint", "outcome"], registry=r)
        self.audio_seconds = Counter("duplex_audio_api_audio_seconds", "Audio transcribed (decoded uploads) or synthesized (sent)",
                                     ["endpoint"], registry=r)
        self.audio_running = Gauge("duplex_audio_api_requests_running", "One-shot audio requests running now", registry=r)
        self.engine_step_ms = Gauge("duplex_engine_step_ms", "Recent engine step time", registry=r)
        self.engine_batch = Gauge("duplex_engine_batch_size", "Recent mean engine batch size", registry=r)
        self.engine_capacity = Gauge("duplex_engine_capacity", "Conversations the engine can serve in real time", registry=r)
        self.engine_conversations = Gauge("duplex_engine_conversations", "Engine conversations open", registry=r)
        self.capacity = Gauge("duplex_capacity", "Conversations admitted at most now: the smallest bound of the measured pipeline "
                              "and the lateness feedback (engine/capacity.py)", registry=r)
        self.capacity_limited_by = Gauge("duplex_capacity_limited_by", "1 for the resource that sets duplex_capacity now",
                                         ["resource"], registry=r)
        self.capacity_bound = Gauge("duplex_capacity_bound", "Each resource's bound on the conversations served on time",
                                    ["resource"], registry=r)
        # overload control (realtime/overload.py): slow start, and the degradation of admitted calls
        self.slow_start_allowed = Gauge("duplex_slow_start_allowed", "Sessions slow start admits at most now (confirmed + step)",
                                        registry=r)
        self.slow_start_confirmed = Gauge("duplex_slow_start_confirmed", "Sessions open at once whose audio live data showed on time",
                                          registry=r)
        self.overload_steps = Counter("duplex_overload_steps", "Degradation steps taken: cfg_off, short, shed (the newest "
                                      "session ended) and back: length_back, cfg_on", ["step"], registry=r)
        self.degraded_sessions = Gauge("duplex_degraded_sessions", "Sessions whose next answers run degraded: cfg_off "
                                       "(no CFG shadow), short (capped length)", ["step"], registry=r)
        # several engine ranks (engine.data_parallel_size): each rank's share, from engine.load().extra["ranks"]
        self.rank_conversations = Gauge("duplex_engine_rank_conversations", "Engine conversations on each engine rank",
                                        ["rank"], registry=r)
        self.rank_bound = Gauge("duplex_engine_rank_bound", "Conversations each engine rank steps in real time",
                                ["rank"], registry=r)
        self.rank_step_ms = Gauge("duplex_engine_rank_step_ms", "Each engine rank's predicted step time at its batch",
                                  ["rank"], registry=r)

    def add_stats_delta(self, new: SessionStats, old: SessionStats) -> None:
        """Count what one session did since its last snapshot."""
        self.barge_ins.inc(new.barge_ins - old.barge_ins)
        self.underruns.inc(new.underruns_reported - old.underruns_reported)
        self.chunks_late.inc(new.chunks_late - old.chunks_late)
        self.input_frames.inc(new.input_frames - old.input_frames)
        self.exchanges_dropped.inc(new.exchanges_dropped - old.exchanges_dropped)
        for ms in new.ttfa_ms[len(old.ttfa_ms):]:
            self.ttfa.observe(ms / 1000.0)

    def render(self, engine: EngineLike | None) -> bytes:
        if engine is not None:
            load = engine.load()
            self.engine_step_ms.set(load.step_ms)
            self.engine_batch.set(load.batch_size)
            self.engine_capacity.set(load.capacity)
            self.engine_conversations.set(load.conversations)
            self.capacity.set(load.capacity)
            limited = load.extra.get("limited_by")
            bounds = dict(load.extra.get("bounds") or {})
            if load.extra.get("feedback_ceiling") is not None:
                bounds["feedback"] = load.extra["feedback_ceiling"]
            for resource, bound in bounds.items():
                self.capacity_bound.labels(resource).set(bound)
                self.capacity_limited_by.labels(resource).set(1.0 if resource == limited else 0.0)
            for rank in load.extra.get("ranks") or ():
                label = str(rank["rank"])
                self.rank_conversations.labels(label).set(rank["conversations"])
                self.rank_bound.labels(label).set(rank["engine_bound"])
                self.rank_step_ms.labels(label).set(rank["step_ms"])
        return generate_latest(self.registry)
