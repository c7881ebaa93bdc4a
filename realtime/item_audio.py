"""The audio of a user's conversation.item.create, kept encoded until the input budget has taken it.

Decoding (base64, G.711 expansion, resampling to 16 kHz) is the work a client would make the event
loop do, so the protocol only checks the parts' shape and the runner costs the item's length against
the session's input budget (realtime/input_budget.py) before `decode()` does that work. The length
is known without decoding: the wire formats an item may use are fixed-rate PCM (Opus is refused).
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

import numpy as np

from realtime.audio import AudioFormatError, InputDecoder, WireFormat
from realtime.session_events import SessionError

# wire bytes per second of each format an item may carry
_BYTES_PER_S = {WireFormat.PCM16: 2 * WireFormat.PCM16.rate_hz, WireFormat.PCMU: WireFormat.PCMU.rate_hz,
                WireFormat.PCMA: WireFormat.PCMA.rate_hz}


@dataclass(frozen=True, slots=True)
class ItemAudio:
    parts: tuple[tuple[str, str], ...]  # (base64 audio, its field: "item.content[i].audio"), in order
    format: WireFormat  # pcm16 or G.711 (the protocol refuses Opus items before building one)

    @property
    def seconds(self) -> float:
        """The audio's length, from the base64 alone (exact for valid base64: 4 characters are 3 bytes, less
        the padding)."""
        return sum(len(b64) * 3 // 4 - b64.endswith("=") - b64.endswith("==") for b64, _ in self.parts) / _BYTES_PER_S[self.format]

    @property
    def param(self) -> str:
        """The field an error about the item's audio names (its first audio part)."""
        return self.parts[0][1]

    def decode(self) -> np.ndarray:
        """int16 at 16 kHz, the parts one after another; SessionError (invalid_base64 / invalid_audio)
        naming the part that is not audio."""
        pcm = []
        for b64, param in self.parts:
            try:
                payload = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise SessionError("invalid_base64", f"'{param}' is not valid base64", param) from None
            decoder = InputDecoder(self.format)  # each part's own, as each part is whole (and the input stream's is not touched)
            try:
                pcm += [decoder.decode(payload), decoder.flush()]
            except AudioFormatError as e:
                raise SessionError("invalid_audio", f"{e} (input format {self.format.value})", param) from None
        return np.concatenate(pcm)
