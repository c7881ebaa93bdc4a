"""Who a request is: the server token, an ephemeral client key (realtime/client_secrets.py), or
nobody; and which routes each may reach (`Scope`).

A credential comes as `Authorization: Bearer K`, as `?token=K`, or, from a browser WebSocket (which
cannot set headers), as the subprotocol `openai-insecure-api-key.K` (OpenAI's browser convention).
The server token reaches everything; an `ek_` key only a session (`Scope.SESSION`): it cannot mint
keys, read /metrics or use the one-shot audio API. With no server token (auth off) every request is
let in, and an `ek_` key still brings its session config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from realtime.client_secrets import ClientSecrets, Grant
from realtime.credentials import same_secret

class Scope(Enum):
    """Which credentials a route takes."""

    PUBLIC = "public"  # none: the handler authenticates itself (a signed webhook) or holds no secret
    SESSION = "session"  # the server token, or an ephemeral client key (a session and nothing else)
    SERVER = "server"  # the server token only


SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."
CLIENT_KEY_PREFIX = "ek_"


@dataclass(frozen=True)
class Credential:
    kind: str  # "server" (the token), "client_key" (an ek_ key), "open" (auth off)
    id: str  # what the request rate is kept per (never the secret itself)
    grant: Grant | None = None  # an ek_ key's session config and expiry

    def allows(self, scope: Scope) -> bool:
        return scope is not Scope.SERVER or self.kind != "client_key"


SERVER = Credential("server", "server")
OPEN = Credential("open", "open")


class Auth:
    """The gateway's token (None or "": auth off) and the keys it signs."""

    def __init__(self, token: str | None, secrets: ClientSecrets) -> None:
        self.token = token or None
        self.secrets = secrets

    def identify(self, headers: Mapping[str, str], query: Mapping[str, list[str]],
                 subprotocols: Sequence[str] = ()) -> Credential | None:
        """The request's credential; None when it offers none that is valid (and auth is on)."""
        offered = [v for v in query.get("token", [])]
        header = headers.get("Authorization", "")
        if header[:7].lower() == "bearer ":
            offered.insert(0, header[7:].strip())
        offered += [p[len(SUBPROTOCOL_KEY_PREFIX):] for p in subprotocols if p.startswith(SUBPROTOCOL_KEY_PREFIX)]
        for given in offered:
            if given.startswith(CLIENT_KEY_PREFIX):
                if (grant := self.secrets.verify(given)) is not None:
                    return Credential("client_key", grant.key_id, grant)
            elif self.token and same_secret(given, self.token):
                return SERVER
        return None if self.token else OPEN

    def matches(self, token: str) -> bool:
        """A token carried by the protocol itself (Twilio's customParameters)."""
        return bool(self.token and token and same_secret(token, self.token))
