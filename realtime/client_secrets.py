"""Ephemeral client secrets (`ek_...`): minted by `POST /v1/realtime/client_secrets`, checked on connect.

An app's backend holds the server token; a browser gets only a short-lived key that opens a session
(OpenAI's GA shape: `{"expires_after": {"anchor": "created_at", "seconds": N}, "session": {...}}` in,
`{"value": "ek_...", "expires_at": T, "session": {...}}` out). The key carries its own grant, so no
store holds it:

    ek_<base64url(zlib(JSON {iat, exp, kid, session}))>.<base64url(HMAC-SHA256(signing key, that text))>

Any replica holding the same signing key verifies it (docs/scaling.md): the key is derived from
`server.client_secret_key` when set, else from the server token, so replicas sharing either honour
each other's keys. A key cannot be revoked before it expires (there is nothing to delete); its life is
bounded by `server.client_secret_max_ttl_s` instead.

Keys travel in an `Authorization` header and in a `Sec-WebSocket-Protocol` value
(`openai-insecure-api-key.<key>`), so they are made of HTTP token characters only (base64url, `_`,
`.`) and at most `MAX_KEY_CHARS` long; a session config too large for that is refused at minting.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from realtime.session_update import parse_session_update
from realtime.text_limits import TextLimits, check_string
from realtime.vad import VadParams
from realtime.wire_fields import ClientError

if TYPE_CHECKING:
    from realtime.config import ServerSection
    from realtime.protocol import SessionSettings

PREFIX = "ek_"
# Fits a header line of any common server or proxy (aiohttp, nginx and HAProxy take 8 KiB) with room for
# "Bearer " or the subprotocol's "openai-insecure-api-key." and the other protocols beside it.
MAX_KEY_CHARS = 4096
# The session config as JSON before compression: compression must not let a small key stand for a large
# config (the decompression in `verify` is bounded by the same number).
MAX_SESSION_BYTES = 64 * 1024
MIN_TTL_S = 10  # OpenAI's bounds on expires_after.seconds: [10, 7200]
DEFAULT_MAX_TTL_S = 7200.0
# Domain separation: the token (or shared secret) signs nothing else with this key.
_LABEL = b"duplex client secret signing key v1"
_B64URL = re.compile(r"[A-Za-z0-9_-]+")
_TOP_LEVEL = ("expires_after", "session")


@dataclass(frozen=True)
class Grant:
    """What a valid key allows: opening one session with `session` applied (as `preconfigure` does)."""

    session: dict  # the session config given at minting (may be empty)
    expires_at: int  # epoch seconds; the key is refused from then on
    key_id: str  # a short random id for logs and metrics; never the key itself


class SecretRequestError(ValueError):
    """A bad `POST /v1/realtime/client_secrets` body: the route answers 400 with an OpenAI-shaped error
    {message, type: invalid_request_error, param, code}."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def derive_signing_key(secret: str) -> bytes:
    """The signing key of a shared secret (the server token or `server.client_secret_key`)."""
    return hmac.new(secret.encode("utf-8", "surrogatepass"), _LABEL, hashlib.sha256).digest()


class ClientSecrets:
    def __init__(self, signing_key: bytes, default_ttl_s: float = 600, max_ttl_s: float = DEFAULT_MAX_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if not MIN_TTL_S <= default_ttl_s <= max_ttl_s:
            raise ValueError(f"default_ttl_s must be within [{MIN_TTL_S}, max_ttl_s={max_ttl_s:g}], got {default_ttl_s:g}")
        if not signing_key:
            raise ValueError("the signing key is empty")
        self._key = signing_key
        self.default_ttl_s, self.max_ttl_s, self.clock = default_ttl_s, max_ttl_s, clock

    @classmethod
    def for_server(cls, server: ServerSection, token: str | None, clock: Callable[[], float] = time.time) -> ClientSecrets:
        """Keys this server mints and honours. `token`: the server's effective bearer token (None or "":
        auth is off, and the keys are signed with a random key of this process, valid here only)."""
        if server.client_secret_key:
            key = derive_signing_key(server.client_secret_key)
        elif token:
            key = derive_signing_key(token)
        else:
            key = secrets.token_bytes(32)
        return cls(key, server.client_secret_ttl_s, server.client_secret_max_ttl_s, clock)

    # ---- minting ----
    def mint(self, body: object, validate: Callable[[dict], None] | None = None) -> dict:
        """A new key for the parsed JSON body of `POST /v1/realtime/client_secrets` (None: no body), as
        OpenAI's response. `validate(session)`: refuses a session config the session could not take
        (`session_validator`), raising SecretRequestError. Raises SecretRequestError for a bad body."""
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise SecretRequestError("the request body must be a JSON object", None, "invalid_type")
        for key in body:
            if key not in _TOP_LEVEL:
                raise SecretRequestError(f"unknown parameter '{key}'", str(key), "unknown_parameter")
        seconds = self._seconds(body.get("expires_after"))
        session = body.get("session")
        if session is None:
            session = {}
        if not isinstance(session, dict):
            raise SecretRequestError("'session' must be an object", "session", "invalid_type")
        if session.get("type", "realtime") != "realtime":
            raise SecretRequestError("'session.type' must be \"realtime\" (no transcription-only sessions here)",
                                     "session.type", "invalid_value")
        if validate is not None:
            validate(session)
        iat = int(self.clock())
        exp = iat + seconds
        value = self._encode({"iat": iat, "exp": exp, "kid": secrets.token_hex(4), "session": session})
        return {"value": value, "expires_at": exp,
                "session": {"type": "realtime", "object": "realtime.session", **session}}

    def _seconds(self, expires_after: object) -> int:
        """expires_after.seconds, checked as OpenAI documents it; absent: the configured default."""
        p = "expires_after"
        if expires_after is None:
            return int(self.default_ttl_s)
        if not isinstance(expires_after, dict):
            raise SecretRequestError(f"'{p}' must be an object", p, "invalid_type")
        for key in expires_after:
            if key not in ("anchor", "seconds"):
                raise SecretRequestError(f"unknown parameter '{p}.{key}'", f"{p}.{key}", "unknown_parameter")
        if expires_after.get("anchor", "created_at") != "created_at":
            raise SecretRequestError(f"'{p}.anchor' must be \"created_at\"", f"{p}.anchor", "invalid_value")
        seconds = expires_after.get("seconds")
        if seconds is None:
            return int(self.default_ttl_s)
        if isinstance(seconds, bool) or not isinstance(seconds, int):
            raise SecretRequestError(f"'{p}.seconds' must be an integer", f"{p}.seconds", "invalid_type")
        if not MIN_TTL_S <= seconds <= self.max_ttl_s:
            raise SecretRequestError(f"'{p}.seconds' must be within [{MIN_TTL_S}, {self.max_ttl_s:g}], got {seconds}",
                                     f"{p}.seconds", "invalid_value")
        return seconds

    def _encode(self, payload: dict) -> str:
        try:
            raw = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("ascii")  # (ensure_ascii: lone surrogates too)
        except (TypeError, ValueError):  # not from a JSON parser: the route passed something else
            raise SecretRequestError("'session' must hold JSON values only", "session", "invalid_type") from None
        if len(raw) > MAX_SESSION_BYTES:
            raise SecretRequestError(f"the session config is too large for a client secret ({len(raw)} bytes of JSON, "
                                     f"at most {MAX_SESSION_BYTES})", "session", "invalid_value")
        body = _b64(zlib.compress(raw, 9))
        value = f"{PREFIX}{body}.{self._sign(body)}"
        if len(value) > MAX_KEY_CHARS:
            raise SecretRequestError(f"the session config is too large for a client secret (its key would be {len(value)} "
                                     f"bytes, at most {MAX_KEY_CHARS}): send the rest with session.update once "
                                     "connected", "session", "invalid_value")
        return value

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode("ascii"), hashlib.sha256).digest())

    # ---- verifying ----
    def verify(self, value: object) -> Grant | None:
        """The grant of a valid, unexpired key of ours; None for anything else. Never raises: any string
        a client can send (any length, any characters) is just not a key."""
        if not isinstance(value, str) or len(value) > MAX_KEY_CHARS or not value.startswith(PREFIX):
            return None
        body, dot, mac = value[len(PREFIX):].partition(".")
        if not dot or not _B64URL.fullmatch(body) or not _B64URL.fullmatch(mac):  # (also: ASCII only)
            return None
        if not hmac.compare_digest(mac, self._sign(body)):
            return None
        payload = _payload(body)  # signed by us: well formed unless the signing key is shared with a stranger
        if payload is None:
            return None
        iat, exp, kid, session = (payload.get(k) for k in ("iat", "exp", "kid", "session"))
        if not (isinstance(iat, int) and isinstance(exp, int) and isinstance(kid, str) and isinstance(session, dict)):
            return None
        if self.clock() >= exp:
            return None
        return Grant(session, exp, kid)


def session_validator(settings: SessionSettings, text_model: bool, *, turn_detection: VadParams | None = None,
                      text_limits: TextLimits | None = None) -> Callable[[dict], None]:
    """`mint`'s `validate` for this server: a client secret's session config is refused at minting for the
    first field session.update would refuse (with session.update's param and code), so a key never opens
    a session with an error. `settings`: a new session's settings (the server's defaults and voices);
    `text_model`: the engine's model reads and writes text; `turn_detection`: a new session's (the
    server's `vad.params()`); `text_limits`: config `limits.text` (the instructions' byte bound)."""
    limits = text_limits or TextLimits()

    def validate(session: dict) -> None:
        upd = parse_session_update(session, settings, turn_detection, False, text_model)
        errors = list(upd.refused)
        if isinstance(instructions := upd.changes.get("instructions"), str):
            try:
                check_string(instructions, "session.instructions", limits, "max_instructions_bytes")
            except ClientError as e:
                errors.append(e)
        if errors:
            first = errors[0]
            raise SecretRequestError(first.message, first.param, first.code)

    return validate


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _payload(body: str) -> dict | None:
    try:
        packed = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        inflater = zlib.decompressobj()
        raw = inflater.decompress(packed, MAX_SESSION_BYTES + 1)
        if len(raw) > MAX_SESSION_BYTES or not inflater.eof:
            return None
        payload = json.loads(raw)
    except (binascii.Error, zlib.error, ValueError):  # (json's errors and UnicodeDecodeError are ValueErrors)
        return None
    return payload if isinstance(payload, dict) else None
