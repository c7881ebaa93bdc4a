"""A user turn's transcript, as the model writes it beside the answer (ConversationOptions.transcribe_user),
and the session events that tell it for the turn's audio item.

The engine writes the transcript of the whole user turn an answer answers, so it belongs to that
answer's exchange: its item is known once the answer is announced (a speculative answer is not,
until the turn is confirmed: what it wrote is held; a discarded one's is never told). When several
audio items made the turn, the last of them gets it; a turn without audio (typed text) has none.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputTranscriptDelta:
    item_id: str
    delta: str


@dataclass(frozen=True)
class InputTranscriptDone:
    item_id: str
    transcript: str
    audio_ms: float  # the turn's user audio the model heard


@dataclass(frozen=True)
class InputTranscriptFailed:
    item_id: str
    code: str
    message: str


InputTranscriptEvent = InputTranscriptDelta | InputTranscriptDone | InputTranscriptFailed


@dataclass
class UserTranscriptRelay:
    """One answer's user transcript on its way to the client: what the engine wrote, what the client was
    told, and when it may be told more (`due`)."""

    item_id: str | None = None  # the turn's last audio item (None: the turn had no audio item)
    audio_ms: float = 0.0
    announced: bool = False  # the item is known: the answer was announced
    text: str = ""
    sent_chars: int = 0
    end: tuple[str, str] | None = None  # ("", "") complete, (code, message) failed; None: still being written
    told_end: bool = False

    def announce(self, item_id: str | None, audio_ms: float) -> None:
        self.item_id, self.audio_ms, self.announced = item_id, audio_ms, True

    def add(self, delta: str) -> None:
        if self.end is None:
            self.text += delta

    def finish(self, code: str | None = None, message: str = "") -> None:
        if self.end is None:
            self.end = ("", "") if code is None else (code, message)

    def due(self, gone: set[str]) -> list[InputTranscriptEvent]:
        """What the client is to be told now (nothing before the answer is announced, for a turn without an
        audio item, or for an item no longer in the conversation: `gone`)."""
        item = self.item_id
        if not self.announced or item is None or item in gone or self.told_end:
            return []
        out: list[InputTranscriptEvent] = []
        if len(self.text) > self.sent_chars:
            out.append(InputTranscriptDelta(item, self.text[self.sent_chars :]))
            self.sent_chars = len(self.text)
        if self.end is not None:
            code, message = self.end
            out.append(InputTranscriptFailed(item, code, message) if code else InputTranscriptDone(item, self.text, self.audio_ms))
            self.told_end = True
        return out
