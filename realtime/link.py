"""A transport's message channel to one client, as the session runner sees it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol


class Link(Protocol):
    """The WebSocket, the WebRTC data channel."""

    def messages(self) -> AsyncIterator[str | bytes]:
        """The client's messages; ends when the client goes away."""

    async def send(self, message: str | bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...

    def lost(self) -> bool:
        """After `messages()` ended: True when the connection died without a goodbye, so the client may
        come back and resume (asked only of a resumable session's link; a link that never resumes says False)."""
