"""The session's conversation items as the engine's history holds them, grouped by exchange.

Every response adds one exchange to the engine's history: the user items committed since the last
response (heard as one user turn), then the answer. Context management drops an exchange whole; a
client may delete a finished exchange's user turn or its answer. `ExchangeLedger` keeps which items
make which exchange, which are gone, and which item came last (the next one's `previous_item_id`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.service_api import SAMPLE_RATE_HZ as RATE_HZ
from engine.service_api import Role

from realtime.paced_response import PacedResponse
from realtime.session_events import ResponseStatus, SessionError


@dataclass
class Exchange:
    answer: PacedResponse
    items: list[str] = field(default_factory=list)  # the items still in the history: its user items, then the answer's


class ExchangeLedger:
    def __init__(self) -> None:
        self.last_item: str | None = None  # the newest item: the next one's previous_item_id
        self.deleted: set[str] = set()  # items gone from the history (deleted, or dropped to fit the context)
        self._open: list[str] = []  # user items committed since the last response: the next exchange's
        self._open_audio_item: str | None = None  # the last of them with audio: the item its user transcript is for
        self._open_audio_samples = 0  # their user audio
        self._answers: dict[str, PacedResponse] = {}  # assistant item id -> its response, oldest first
        self._exchanges: dict[str, Exchange] = {}  # response id -> its exchange, while any of it is in the history

    def add_user(self, item_id: str, audio_samples: int | None) -> str | None:
        """A user item joins the open exchange (`audio_samples`: its audio; None: it has none); returns
        the item before it."""
        previous, self.last_item = self.last_item, item_id
        self._open.append(item_id)
        if audio_samples is not None:
            self._open_audio_item = item_id
            self._open_audio_samples += audio_samples
        return previous

    def add_answer(self, r: PacedResponse) -> None:
        """`r` answers the open exchange and closes it; its user transcript learns the item it is for."""
        self._answers[r.item_id] = r
        self._exchanges[r.id], self._open = Exchange(r, [*self._open, r.item_id]), []
        r.user_transcript.announce(self._open_audio_item, 1000.0 * self._open_audio_samples / RATE_HZ)
        self._open_audio_item, self._open_audio_samples = None, 0
        self.last_item = r.item_id

    def statuses(self) -> list[ResponseStatus]:
        """Every announced response's status, oldest first."""
        return [r.status for r in self._answers.values()]

    def response(self, response_id: str) -> PacedResponse | None:
        """An announced response (finished ones too), the latest looked at first."""
        return next((r for r in reversed(self._answers.values()) if r.id == response_id), None)

    def answer(self, item_id: str) -> PacedResponse | None:
        """The response whose assistant item this is, while the item is in the history."""
        return None if item_id in self.deleted else self._answers.get(item_id)

    def drop(self, response_ids: tuple[str, ...]) -> list[str]:
        """Context management dropped these responses' exchanges: the items that left the history."""
        gone = [item for rid in response_ids if (ex := self._exchanges.pop(rid, None)) is not None for item in ex.items]
        self.deleted.update(gone)
        return gone

    def deletion(self, item_id: str) -> tuple[str, Role]:
        """What deleting this item takes out of the engine's history: (response id, role); raises
        SessionError when it cannot be deleted (yet)."""
        rid, ex = next(((rid, ex) for rid, ex in self._exchanges.items() if item_id in ex.items), (None, None))
        if rid is None or ex is None:
            raise SessionError("item_not_deletable", f"item {item_id!r} is a user turn with no response yet: it can be "
                                                     "deleted once answered (input_audio_buffer.clear drops audio before a commit)", "item_id")
        if not ex.answer.status.finished:
            raise SessionError("item_not_deletable", f"response {rid} is in progress: cancel it first", "item_id")
        user_items = [item for item in ex.items if item != ex.answer.item_id]
        if item_id != ex.answer.item_id and len(user_items) > 1:
            raise SessionError("item_not_deletable", f"item {item_id!r} is one of {len(user_items)} user items the model heard as "
                                                     "one turn: that turn cannot lose one of them", "item_id")
        return rid, Role.ASSISTANT if item_id == ex.answer.item_id else Role.USER

    def delete(self, response_id: str, item_id: str) -> None:
        """The item (checked by `deletion`) leaves the history."""
        self._exchanges[response_id].items.remove(item_id)
        self.deleted.add(item_id)
