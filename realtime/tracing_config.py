"""`session.tracing`: whether and how a client wants its session traced (docs/protocol.md, "Tracing").

OpenAI's GA schema: `"auto"` (a trace with the server's defaults), an object `{workflow_name,
group_id, metadata}` (each optional) or `null` (no trace). This server honours it with OpenTelemetry
spans (realtime/tracing.py) instead of OpenAI's Traces dashboard.

OpenAI's rule, kept here: once tracing is on, its configuration cannot change (the session span
already carries it). Sending the same configuration again, or `"auto"`, changes nothing and is
accepted — the Agents SDKs send `"auto"` after `session.created` by default; a different object or
`null` is refused by name. Off, it may be turned on at any time.
"""

from __future__ import annotations

from dataclasses import dataclass

from realtime.wire_fields import ClientError, get_field

PARAM = "session.tracing"
_KEYS = ("workflow_name", "group_id", "metadata")


@dataclass(frozen=True)
class TracingConfig:
    workflow_name: str | None = None
    group_id: str | None = None
    metadata: dict[str, object] | None = None  # the client's, as sent (JSON values)
    auto: bool = False  # "auto": the server's defaults, echoed as "auto"

    def wire(self) -> str | dict[str, object]:
        """As session.created/updated echo it."""
        if self.auto:
            return "auto"
        return {"workflow_name": self.workflow_name, "group_id": self.group_id, "metadata": self.metadata}


def parse_tracing(value: object, current: TracingConfig | None) -> TracingConfig | None:
    """The session's tracing after a session.update's `tracing` (`current`: the session's now);
    raises ClientError naming the field."""
    new = _parse(value)
    if current is None:
        return new
    if new == current or (new is not None and new.auto):  # nothing changes: the trace goes on as it is
        return current
    raise ClientError("invalid_value", f"'{PARAM}' cannot be modified once tracing is enabled for a session "
                      f"(it is {current.wire()!r})", PARAM)


def _parse(value: object) -> TracingConfig | None:
    if value is None:
        return None
    if isinstance(value, str):
        if value != "auto":
            raise ClientError("invalid_value", f"'{PARAM}' must be \"auto\", an object or null, got {value!r}", PARAM)
        return TracingConfig(auto=True)
    if not isinstance(value, dict):
        raise ClientError("invalid_type", f"'{PARAM}' must be \"auto\", an object or null", PARAM)
    for key in value:
        if key not in _KEYS:
            raise ClientError("unknown_parameter", f"unknown parameter '{PARAM}.{key}'", f"{PARAM}.{key}")
    prefix = PARAM + "."
    return TracingConfig(get_field(value, "workflow_name", str, prefix=prefix), get_field(value, "group_id", str, prefix=prefix),
                         get_field(value, "metadata", dict, prefix=prefix))
