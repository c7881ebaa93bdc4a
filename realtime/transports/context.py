"""What a transport may use from the server around it, handed to its `register(ctx)`."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from realtime.admission import Admission
from realtime.config import ServerConfig
from realtime.auth import Auth
from realtime.http import Routes
from realtime.metrics import GatewayMetrics


@dataclass(frozen=True)
class TransportContext:
    """Its settings, the one admission path, the auth, its route table."""

    config: ServerConfig
    admission: Admission
    metrics: GatewayMetrics
    auth: Auth
    voices: dict  # name -> 16 kHz PCM
    routes: Routes
    on_stop: Callable[[Callable[[], Awaitable[None]]], None]  # resources closed at stop(), after the sessions
