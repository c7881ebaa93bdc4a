"""Transports: one wire format per module (DESIGN.md §2).

Each module here defines `register(gw)`, which adds its routes to the gateway (`gw.ws_routes`,
`gw.http_routes`). The gateway registers every module it finds, so a new transport is one new file.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def discover() -> list[ModuleType]:
    mods = [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    return [m for m in mods if hasattr(m, "register")]
