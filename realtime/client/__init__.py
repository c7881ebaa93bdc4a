"""Python client SDK for the gateway's `WS /v1/realtime` (docs/protocol.md): typed events, audio in and
out, playback acknowledgements, reconnect and resume.

    async with DuplexClient("ws://127.0.0.1:8000/v1/realtime", token) as c:
        await c.update_session(instructions="Be brief.")
        mic = asyncio.create_task(c.stream_audio(pcm, 16_000))   # or `await c.send_audio(pcm, rate_hz)` as audio comes
        async for ev in c.play(SimulatedSpeaker()):              # events(); each answer played into the sink, acknowledged
            if isinstance(ev, ResponseDone):
                print(ev.status, ev.ttfa_ms)

- Audio in: int16 or float mono at any rate, resampled and cut into 20 ms frames: pcm16 24 kHz in JSON
  appends, or (`input_format="opus"`) one Opus packet per binary frame.
- Audio out: pcm16 or (`output_format="opus"`) binary Opus on the wire, decoded to int16 at
  `output_rate_hz`; `AudioChunk`s carry their response id and epoch, and audio of a response that was
  cleared (barge-in, cancel) is dropped.
- Text (a model with a text tokenizer: `session["duplex"]["text"]`): `update_session(transcribe=True)` brings
  `UserTranscriptDelta` / `UserTranscript` for each answered turn; `output_modalities=["text"]` (per session,
  or `create_response(output_modalities=...)`) text-only answers as `TextDelta`; `send_text()` a typed turn.
- Errors are exceptions carrying the server's code and message (`DuplexError` and its subclasses).
- Reconnect and resume: a connection that dies without a close frame is reopened with exponential
  backoff and jitter (`Reconnect`), resuming the same server session with the resume token from
  `session.created` and the count of messages received; the server replays what this client missed.
  `Reconnecting` and `Resumed` events report it; a session that cannot be resumed ends `events()` with
  `SessionLost`. Audio sent while disconnected is held (the newest `max_buffered_audio_ms`, the rest
  dropped and counted in `stats`) and sent after the resume; other events wait for the resume.

Modules: `connection` (DuplexClient, Reconnect), `events` (errors and event dataclasses, no I/O),
`playback` (the AudioSink interface, SimulatedSpeaker, Player).
"""

from realtime.client.connection import (
    ClientStats,
    ConnState,
    DuplexClient,
    Reconnect,
    realtime_url,
)
from realtime.client.events import (
    AudioChunk,
    ConnectError,
    DuplexError,
    ErrorEvent,
    Event,
    FirstAudio,
    InputCommitted,
    OutputCleared,
    ProtocolError,
    Reconnecting,
    ResponseCreated,
    ResponseDone,
    Resumed,
    ServerAtCapacity,
    SessionCreated,
    SessionEnded,
    SessionLost,
    SessionUpdated,
    SpeechStarted,
    SpeechStopped,
    TextDelta,
    TranscriptDelta,
    Unauthorized,
    UserTranscript,
    UserTranscriptDelta,
    UserTranscriptFailed,
)
from realtime.client.playback import AudioSink, Player, SimulatedSpeaker

__all__ = [
    "DuplexClient",
    "Reconnect",
    "ConnState",
    "ClientStats",
    "realtime_url",
    "DuplexError",
    "ConnectError",
    "Unauthorized",
    "ServerAtCapacity",
    "ProtocolError",
    "SessionEnded",
    "SessionLost",
    "SessionCreated",
    "SessionUpdated",
    "SpeechStarted",
    "SpeechStopped",
    "InputCommitted",
    "ResponseCreated",
    "FirstAudio",
    "AudioChunk",
    "TranscriptDelta",
    "TextDelta",
    "UserTranscriptDelta",
    "UserTranscript",
    "UserTranscriptFailed",
    "OutputCleared",
    "ResponseDone",
    "ErrorEvent",
    "Reconnecting",
    "Resumed",
    "Event",
    "AudioSink",
    "SimulatedSpeaker",
    "Player",
]
