"""`duplex serve`: start the engine (tiny default model when none is given), then the gateway."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import secrets
import signal

from engine.service_config import EngineServiceConfig
from realtime.config import ServerConfig, load_config, with_overrides
from realtime.voices import load_voices

log = logging.getLogger("duplex.serve")


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the realtime gateway (WebSocket /v1/realtime, /metrics, /healthz)",
                              description=__doc__)
    p.add_argument("--config", help="YAML config (configs/server.yaml); flags override its keys")
    p.add_argument("--host", help="server.host (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="server.port (default 8000; 0 = any free port)")
    p.add_argument("--token", help="server.token: bearer token clients must send (default: random, printed)")
    p.add_argument("--tls-cert", help="server.tls_cert: PEM certificate (chain): serve https:// and wss:// (with --tls-key)")
    p.add_argument("--tls-key", help="server.tls_key: its PEM private key")
    p.add_argument("--replica-id", help="server.replica_id: this replica's name behind a load balancer (a DNS label; docs/scaling.md)")
    p.add_argument("--model", help="engine.model: checkpoint directory, or hub id owner/name[@rev] of one (default: the cached tiny model)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> ServerConfig:
    cfg = load_config(args.config)
    return with_overrides(cfg, **{"server.host": args.host, "server.port": args.port, "server.token": args.token,
                                  "server.replica_id": args.replica_id, "engine.model": args.model,
                                  "server.tls_cert": args.tls_cert, "server.tls_key": args.tls_key})


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = build_config(args)
    from realtime.tls import server_context
    from realtime.tracing import exporter_names

    try:
        server_context(cfg.server)  # a missing or unusable certificate fails now, not after the engine's start-up
    except ValueError as e:
        raise SystemExit(f"duplex serve: {e}") from None

    exporter_names()  # a span exporter this server cannot honour (OTEL_TRACES_EXPORTER, ...) fails now
    voices = load_voices(cfg.session.voices)  # a bad voice file fails now, not after the engine's start-up
    return asyncio.run(_serve(cfg, cfg.engine, voices))


def _freeze_startup_heap() -> None:
    """Keep the garbage collector's full passes off the event loop's critical path. A full (gen-2)
    collection scans every tracked object, and the start-up heap (torch, vLLM, the model's modules:
    ~0.5-1 M objects) made each one block the loop for 150-350 ms, a gap in every caller's audio (seen
    in the flood runs, docs/soak.md). That heap lives as long as the server: move it out of the
    collector's view once, after start-up; later passes scan only what sessions allocate."""
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen for the garbage collector: %d objects", gc.get_freeze_count())


async def _serve(cfg: ServerConfig, ecfg: EngineServiceConfig, voices: dict) -> int:
    from engine.service import Engine
    from realtime.server import Gateway
    from realtime.tls import base_url

    token = cfg.server.token or secrets.token_hex(16)  # hex: never starts with "-", so it pastes into --token
    log.info("starting the engine (model: %s)...", ecfg.model or "tiny default")
    engine = await Engine.start(ecfg)
    gw = Gateway(engine, cfg, token=token, voices=voices)
    try:
        await gw.start()
        _freeze_startup_heap()
        base = base_url(cfg.server, gw.port or 0)
        ws = base.replace("http", "ws", 1)
        audio = f"\n  audio api:  {base}/v1/audio/transcriptions, {base}/v1/audio/speech" if cfg.audio_api.enabled else ""
        print(f"duplex serve: ready\n  demo page:  {base}/?token={token}\n  websocket:  {ws}/v1/realtime  "
              f"(Authorization: Bearer {token}){audio}\n  metrics:    {base}/metrics   health: {base}/healthz", flush=True)
        # SIGTERM (a rolling restart, Kubernetes, systemd): drain, the running calls end on their own
        # (up to limits.drain_timeout_s) while the balancer sends new ones elsewhere. SIGINT (Ctrl-C),
        # or a second SIGTERM while draining: stop now.
        stop, drain = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, lambda: stop.set() if drain.is_set() else drain.set())
        stopped, drained = asyncio.create_task(stop.wait()), asyncio.create_task(drain.wait())
        await asyncio.wait((stopped, drained), return_when=asyncio.FIRST_COMPLETED)
        if drain.is_set() and not stop.is_set():
            log.info("SIGTERM: draining %d sessions (up to %.0f s; SIGTERM again to stop now)",
                     len(gw.sessions), cfg.limits.drain_timeout_s)
            draining = asyncio.create_task(gw.drain())
            await asyncio.wait((stopped, draining), return_when=asyncio.FIRST_COMPLETED)
            draining.cancel()
        stopped.cancel()
        drained.cancel()
        log.info("shutting down: closing %d sessions", len(gw.sessions))
    finally:
        await gw.stop()
        await engine.shutdown()
    return 0
