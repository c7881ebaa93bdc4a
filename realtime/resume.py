"""Reconnect-and-resume, server side: the session's outgoing messages by sequence number (sans-I/O).

Every message a session sends (JSON text or binary Opus) gets the next sequence number: 1, 2, ...
A client that lost its connection counts the messages it received (its `last_seq`) and reconnects
with its resume token; the runner replays what came after `last_seq` from this buffer. The buffer
keeps the newest messages up to `max_bytes`; a client that fell further behind than that gets what is
left and is told how many messages it missed (docs/protocol.md, "Reconnect and resume").
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass


def new_resume_token(replica_id: str | None = None) -> str:
    """A secret naming the session; behind a load balancer also the replica that holds it
    (`resume.<replica>.<secret>`: the balancer routes `?resume=` on the second dot-separated field,
    deploy/haproxy.cfg; the secret's alphabet has no dot)."""
    secret = secrets.token_urlsafe(24)
    return f"resume.{replica_id}.{secret}" if replica_id else "resume_" + secret


@dataclass(frozen=True)
class Replay:
    messages: list[str | bytes]  # to resend, in order: seq last_seq+1 ... (minus the missed ones)
    missed: int  # messages after last_seq the buffer no longer holds (0: nothing lost)


class ResumeRefused(Exception):
    """A resume request the session cannot honour; `code` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class ReplayBuffer:
    """The newest sent messages, at most `max_bytes` of them (the newest one is always kept)."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = max_bytes
        self.last_seq = 0  # sequence number of the newest message
        self._messages: deque[str | bytes] = deque()  # seq first_seq ... last_seq
        self._bytes = 0

    @property
    def first_seq(self) -> int:
        """Sequence number of the oldest message held (last_seq + 1 when empty)."""
        return self.last_seq - len(self._messages) + 1

    def append(self, message: str | bytes) -> int:
        self.last_seq += 1
        self._messages.append(message)
        self._bytes += len(message)
        while self._bytes > self.max_bytes and len(self._messages) > 1:
            self._bytes -= len(self._messages.popleft())
        return self.last_seq

    def since(self, last_seq: int) -> Replay:
        """What a client that received messages 1..last_seq is missing."""
        if not 0 <= last_seq <= self.last_seq:
            raise ResumeRefused("invalid_last_seq", f"last_seq {last_seq} is outside 0..{self.last_seq} (messages sent so far)")
        first = self.first_seq
        missed = max(0, first - (last_seq + 1))
        start = max(last_seq + 1, first) - first
        return Replay([self._messages[i] for i in range(start, len(self._messages))], missed)
