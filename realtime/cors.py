"""CORS for the API endpoints a browser page calls from its own origin (`HttpRoute.cors`).

These endpoints authenticate with bearer tokens, never cookies, so any origin may call them by
default (`server.cors_origins` unset: `Access-Control-Allow-Origin: *`); a list narrows it to those
origins (echoed, with `Vary: Origin`). A preflight is answered without credentials (browsers send
none with it): it only says which methods and headers the real request may use, and the real
request is authenticated as any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

MAX_AGE_S = 600
EXPOSED = "Location, Retry-After"  # the WebRTC answer's call URL; how long to wait after a 429/503


def allow_origin(origin: str | None, allowed: Sequence[str] | None) -> dict[str, str]:
    """The headers that let `origin` read a reply (none when it may not, or the request is not cross-origin)."""
    if not origin:
        return {}
    if allowed is None:
        return {"Access-Control-Allow-Origin": "*", "Access-Control-Expose-Headers": EXPOSED}
    if origin in allowed or "*" in allowed:
        return {"Access-Control-Allow-Origin": origin, "Access-Control-Expose-Headers": EXPOSED, "Vary": "Origin"}
    return {"Vary": "Origin"}


def preflight(headers: Mapping[str, str], methods: Sequence[str], allowed: Sequence[str] | None) -> dict[str, str]:
    """A preflight's reply headers: the route's methods, the headers the browser asked for."""
    out = allow_origin(headers.get("Origin"), allowed)
    if "Access-Control-Allow-Origin" not in out:
        return out
    out["Access-Control-Allow-Methods"] = ", ".join((*methods, "OPTIONS"))
    if requested := headers.get("Access-Control-Request-Headers"):
        out["Access-Control-Allow-Headers"] = requested
    out["Access-Control-Max-Age"] = str(MAX_AGE_S)
    return out
