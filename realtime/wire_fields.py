"""Reading fields of a client's JSON event: typed getters that raise `ClientError` naming the field.

Shared by the Realtime event machine and the parsers it delegates to (session.update,
conversation items, response.create), so every bad field gets the same kind of `error` event.
"""

from __future__ import annotations

from dataclasses import dataclass


class ClientError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None, error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.error_type = code, message, param, error_type


@dataclass(frozen=True)
class Notice:
    """A field accepted as a hint (it changes nothing the client relies on, but is not done as OpenAI
    would): `duplex.notice` {param, message} tells clients that opted in to our additions."""

    param: str
    message: str


def unsupported(param: str, why: str) -> ClientError:
    """A field the server understands but cannot honour: refused by name, never silently ignored."""
    return ClientError("unsupported_parameter", f"'{param}' is not supported by this server: {why}", param)


def get_field(obj: dict, key: str, types: type | tuple, *, required: bool = False, prefix: str = ""):
    if key not in obj or obj[key] is None and not required:
        if required:
            raise ClientError("missing_required_parameter", f"missing required parameter '{prefix}{key}'", prefix + key)
        return None
    value = obj[key]
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        value = None  # bool is an int in Python; never accept it as a number
    if value is None or not isinstance(value, types):
        names = "/".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise ClientError("invalid_type", f"'{prefix}{key}' must be of type {names}", prefix + key)
    return value


def number(obj: dict, key: str, lo: float, hi: float, *, integer: bool = False, required: bool = False,
           prefix: str = "") -> float | int | None:
    """A number within [lo, hi] (client_json already refused NaN, infinities and huge literals)."""
    value = get_field(obj, key, int if integer else (int, float), required=required, prefix=prefix)
    if value is not None and not lo <= value <= hi:
        raise ClientError("invalid_value", f"'{prefix}{key}' must be within [{lo:g}, {hi:g}], got {value:g}", prefix + key)
    return value
