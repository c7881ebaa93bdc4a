"""Which conversations hold an engine slot, and on which engine rank: admission against the capacity
that engine/capacity.py measures (its model and its lateness feedback), for the whole server and,
with several engine ranks (data parallelism), for each rank.

A conversation holds a slot from `open` to `release`, except while suspended (its client is away:
`set_suspended`), when it keeps its rank and its history but no slot.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from engine.capacity import CapacityModel, LatenessFeedback
from engine.service_api import AtCapacity


class SlotHolder(Protocol):
    """What admission reads of a conversation."""

    @property
    def rank(self) -> int: ...

    @property
    def responding(self) -> bool: ...

    async def close(self) -> None:
        """Ends it; it releases its slot (`Slots.release`)."""


H = TypeVar("H", bound=SlotHolder)


class Slots:
    def __init__(self, capacity: CapacityModel, feedback: LatenessFeedback, capacity_override: int | None) -> None:
        self.model = capacity
        self.feedback = feedback
        self.override = capacity_override  # a fixed capacity instead of the measured one
        self._held: dict[str, SlotHolder] = {}
        self._suspended: set[str] = set()  # open, but their clients are away: no slot held

    def capacity(self) -> int:
        if self.override is not None:
            return self.override
        # never refuse everyone: one conversation is served even on an overloaded box
        return max(1, self.model.capacity(self.feedback.ceiling))

    def open(self, session_id: str, make: Callable[[int], H]) -> H:
        """A slot for a new conversation on the rank with the most headroom: `make(rank)` builds it.
        AtCapacity when the server, or that rank, is full."""
        if session_id in self._held:
            raise ValueError(f"conversation {session_id!r} is already open")
        self._check_room()
        rank = self.pick_rank()
        self._check_rank_room(rank)
        holder = make(rank)
        self._held[session_id] = holder
        return holder

    def release(self, session_id: str) -> None:
        """A closed conversation no longer counts for capacity."""
        self._held.pop(session_id, None)
        self._suspended.discard(session_id)

    def set_suspended(self, session_id: str, suspended: bool) -> None:
        """A conversation's slot freed (its client is away) or taken again (AtCapacity when none is free)."""
        if suspended:
            if session_id in self._held:
                self._suspended.add(session_id)
        elif session_id in self._suspended:
            self._check_room()
            self._check_rank_room(self._held[session_id].rank)  # it comes back to its own rank
            self._suspended.discard(session_id)

    def holders(self) -> list[SlotHolder]:
        """The open conversations, suspended ones included."""
        return list(self._held.values())

    def pick_rank(self) -> int:
        """The engine rank with the most headroom now (data parallelism)."""
        return self.model.pick_rank(self.rank_active())

    def active(self) -> int:
        return len(self._held) - len(self._suspended)

    def rank_active(self) -> list[int]:
        """Active (not suspended) conversations on each engine rank."""
        counts = [0] * self.model.ranks
        for sid, holder in self._held.items():
            if sid not in self._suspended:
                counts[holder.rank] += 1
        return counts

    def rank_responding(self) -> list[int]:
        """Conversations generating an answer now, on each engine rank."""
        counts = [0] * self.model.ranks
        for holder in self._held.values():
            if holder.responding:
                counts[holder.rank] += 1
        return counts

    def _check_room(self) -> None:
        cap, active = self.capacity(), self.active()
        if active >= cap:
            raise AtCapacity(f"server at capacity: {active} conversations active, {cap} can respond in real time")

    def _check_rank_room(self, rank: int) -> None:
        """Admission per engine rank (data parallelism): a conversation is served by its rank alone.
        With one rank the server's check says it all; a fixed capacity override has no per-rank part."""
        if self.model.ranks == 1 or self.override is not None:
            return
        active, cap = self.rank_active()[rank], max(1, self.model.rank_bound(rank))
        if active >= cap:
            raise AtCapacity(f"engine rank {rank} at capacity: {active} conversations active, {cap} can respond in real time")
