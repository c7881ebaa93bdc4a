"""Comparing a client's credential (bearer token, resume token, ticket, Twilio signature) with ours."""

from __future__ import annotations

import hmac


def same_secret(given: str, expected: str) -> bool:
    """Constant-time equality. `hmac.compare_digest` takes `str` only when both are ASCII (it raises
    TypeError otherwise): the UTF-8 bytes are compared instead, so any credential a client can send is
    just wrong, never an error. Lone surrogates (from %-decoding) are kept, not refused."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8", "surrogatepass"))
