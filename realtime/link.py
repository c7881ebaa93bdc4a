"""A transport's message channel to one client, as the session runner sees it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol


class Link(Protocol):
    """The WebSocket, the WebRTC data channel. A link of a resumable session also has `lost() -> bool`:
    after `messages()` ended, True when the connection died without a goodbye (the client may come back)."""

    def messages(self) -> AsyncIterator[str | bytes]:
        """The client's messages; ends when the client goes away."""

    async def send(self, message: str | bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...
