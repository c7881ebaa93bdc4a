"""Gateway configuration: `configs/server.yaml` loaded into frozen dataclasses.

Every `duplex serve` flag has a key here (flag -> key: --host server.host, --port server.port,
--token server.token, --model engine.model). Unknown keys and wrong types raise ValueError naming
the key (`duplex serve` turns that into exit code 2). The `engine` section is
`engine.service_config.EngineServiceConfig` (torch-free), whose fields carry their own bounds; everything
else is checked here.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import types
import typing
from dataclasses import dataclass, field, fields
import re
from pathlib import Path

from engine.service_api import DEFAULT_OPTIONS as ENGINE_DEFAULTS
from engine.service_api import DEFAULT_RETENTION_RATIO, ConversationOptions
from engine.service_config import EngineServiceConfig
from realtime.input_budget import InputLimits
from realtime.noise_suppression import NOISE_REDUCTION_TYPES
from realtime.request_rate import HttpRateLimits
from realtime.text_limits import TextLimits
from realtime.vad import VadParams


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None  # None: a random token is generated at start and printed
    public_url: str | None = None  # how clients reach us (printed URLs); default http://host:port
    # This replica's name behind a load balancer (a DNS label: the pod name of a StatefulSet). It is
    # written into resume tokens and Twilio stream URLs, so the balancer routes them back here
    # (deploy/haproxy.cfg, docs/scaling.md). None: one server, tokens name nothing.
    replica_id: str | None = None
    # Ephemeral client secrets (`ek_...`, realtime/client_secrets.py) are signed with a key derived from
    # this secret, so every replica sharing it honours the others' keys with no shared store. None: from
    # the token (replicas sharing the token interoperate too); set, a new token leaves the keys valid.
    client_secret_key: str | None = None
    client_secret_ttl_s: float = 600.0  # a key's life when the request names none (OpenAI's default)
    client_secret_max_ttl_s: float = 7200.0  # the longest a request may ask for (OpenAI's bound)
    # TLS: https:// and wss:// on the same port (PEM files; the key unencrypted). Both or neither.
    tls_cert: str | None = None
    tls_key: str | None = None
    # Origins whose pages may call the API endpoints (CORS, realtime/cors.py). None: any origin (the
    # endpoints take bearer tokens, never cookies); a list narrows it.
    cors_origins: list | None = None  # of str: origins as browsers send them (scheme://host[:port])


@dataclass(frozen=True)
class OverloadLimits:
    """`limits.overload` in the server config: slow start of admissions and degradation of admitted calls
    (realtime/overload.py)."""

    slow_start: bool = True
    first_step: int = 4  # sessions admitted before live data confirms anything (and at most the priors' capacity)
    max_step: int = 8  # the most new sessions one confirmation window lets in
    confirm_s: float = 5.0  # a confirmation window
    confirm_chunks: int = 50  # audio chunks a window needs before it confirms anything (silence proves nothing)
    on_time_share: float = 0.995  # chunks not late beyond the client's lead, for a window to confirm
    degrade: bool = True
    window_s: float = 3.0  # lateness is judged over this much of the recent past
    late_share: float = 0.05  # chunks past the engine's deadline (inside the client's lead) that mean "falling behind"
    min_late: int = 3  # ... and at least this many
    escalate_s: float = 2.0  # at most one degradation step this often
    shed_after_s: float = 5.0  # at the last step and still late this long: the newest session is ended
    shed_gaps: int = 2  # ... "late": at least this many chunks heard late (beyond the lead, or underruns) in the window
    recover_s: float = 10.0  # on time this long: one step undone
    short_response_ms: float = 2000.0  # the answers' cap at the second step
    tick_s: float = 0.5

    def __post_init__(self) -> None:
        checks = (("first_step", self.first_step >= 1), ("max_step", self.max_step >= 1),
                  ("confirm_s", self.confirm_s > 0), ("confirm_chunks", self.confirm_chunks >= 0),
                  ("on_time_share", 0.0 <= self.on_time_share <= 1.0), ("window_s", self.window_s > 0),
                  ("late_share", 0.0 <= self.late_share <= 1.0), ("min_late", self.min_late >= 1),
                  ("escalate_s", self.escalate_s >= 0), ("shed_after_s", self.shed_after_s >= 0), ("shed_gaps", self.shed_gaps >= 1),
                  ("recover_s", self.recover_s >= 0), ("short_response_ms", self.short_response_ms >= 100),
                  ("tick_s", self.tick_s > 0))
        for name, ok in checks:
            if not ok:
                raise ValueError(f"limits.overload.{name}: out of range ({getattr(self, name)!r})")


@dataclass(frozen=True)
class LimitsSection:
    max_message_bytes: int = 1 << 21  # one WebSocket message; larger ones close the socket with 1009
    max_append_bytes: int = 1 << 20  # decoded audio in one input_audio_buffer.append
    max_sessions: int | None = None  # gateway cap; None: the engine's admission control decides
    drain_timeout_s: float = 300.0  # SIGTERM: running sessions may go on this long before they are closed
    retry_after_s: float = 5.0  # what a caller refused at capacity is told: try again after this long (and /healthz)
    inbound_queue: int = 256  # client messages + engine chunks waiting for the session task
    outbound_queue: int = 512  # messages waiting for the socket; full => slow client, disconnected
    idle_timeout_s: float = 300.0  # no client message (and no response running) for this long => closed
    open_timeout_s: float = 10.0
    close_timeout_s: float = 5.0
    ping_interval_s: float | None = 20.0
    ping_timeout_s: float | None = 20.0
    max_turn_ms: float = 60_000.0  # client-committed turns (turn_detection null)
    resume_grace_s: float = 30.0  # a /v1/realtime session whose connection dropped is kept this long for a resume; 0: never
    resume_buffer_bytes: int = 1 << 20  # sent messages kept per session for replay on resume (newest first)
    input: InputLimits = InputLimits()  # what one client may send per second (a nested section: limits.input.audio_rate ...)
    overload: OverloadLimits = OverloadLimits()  # slow start of admissions, degradation of admitted calls (realtime/overload.py)
    text: TextLimits = TextLimits()  # what text one session may make the server hold (realtime/text_limits.py: limits.text.max_items ...)
    http_rate: HttpRateLimits = HttpRateLimits()  # one client's HTTP requests per second (realtime/request_rate.py: limits.http_rate.burst ...)


@dataclass(frozen=True)
class AudioSection:
    lead_ms: float = 150.0  # output audio sent ahead of real time (bounds barge-in latency)
    output_frame_ms: int = 40  # pcm16/G.711 delta size (Opus is always 20 ms)
    opus_bitrate: int = 24_000
    opus_complexity: int = 5
    vad_batch_ms: float = 30.0  # Silero windows of all sessions run as one batch, waiting at most this long; 0: each packet at once


@dataclass(frozen=True)
class VadSection(VadParams):
    """The default turn detection of a new session (clients change it with session.update)."""

    enabled: bool = True

    def params(self) -> VadParams | None:
        """The turn detection a new session starts with; None: the client commits its turns."""
        return VadParams(**{f.name: getattr(self, f.name) for f in dataclasses.fields(VadParams)}) if self.enabled else None


REPLICA_ID = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")  # a DNS label (RFC 1123), as Kubernetes names pods
MAX_SEED = 2**63 - 1
MAX_TOP_K = 1_000_000  # beyond any vocabulary: the same as no top-k
MIN_SECRET_TTL_S, MAX_SECRET_TTL_S = 10.0, 86_400.0  # a client secret's life: OpenAI's floor; a day at most (it cannot be revoked)
MIN_SECRET_KEY_CHARS = 16


TRUNCATION_MODES = ("auto", "disabled", "retention_ratio")


@dataclass(frozen=True)
class SessionSection:
    """Defaults of a new session's settings: the base of `realtime.protocol.SessionSettings`, which
    session.update changes per session."""

    instructions: str = ""
    voice: str = "default"  # "default" (the model's own) or a name in `voices`
    voices: dict = field(default_factory=dict)  # name -> WAV file: speaker prompts clients pick with `voice`
    # the engine's defaults, so the three layers cannot drift apart
    temperature: float = ENGINE_DEFAULTS.temperature
    top_k: int = ENGINE_DEFAULTS.top_k
    top_p: float = ENGINE_DEFAULTS.top_p
    seed: int | None = ENGINE_DEFAULTS.seed
    cfg_scale: float = ENGINE_DEFAULTS.cfg_scale
    max_response_ms: float = ENGINE_DEFAULTS.max_response_ms
    # context management (OpenAI's `truncation`): "auto" drops the oldest exchanges when the next
    # answer would not fit the model's context, down to `retention_ratio` of it; "disabled" fails
    # that answer instead (conversation_too_long); "retention_ratio": "auto" with a ratio the client
    # chose (session.update's {"type": "retention_ratio", ...}, echoed back in that shape)
    truncation: str = "auto"
    retention_ratio: float = ENGINE_DEFAULTS.retention_ratio or DEFAULT_RETENTION_RATIO
    # Audio answers write their text first and speak it (the model's text on
    # response.output_audio_transcript.*), as the dialogue model was trained; the text's steps come
    # before the first audio, so every answer starts later: off by default. Text-only answers
    # (output_modalities ["text"]) write their text whatever this says. Needs a model with a text
    # tokenizer (ignored, with a warning at start, without one).
    assistant_text: bool = ENGINE_DEFAULTS.assistant_text
    # OpenAI's audio.input.noise_reduction type: the user's audio passes a noise suppressor before the
    # VAD and the model ("near_field", "far_field": realtime/noise_suppression.py); None: off
    noise_reduction: str | None = None

    def problems(self) -> list[tuple[str, str]]:
        """The settings the engine would refuse, as (field, why): session.update and the config refuse
        them up front, so no response fails later for a value the server accepted. The bounds are
        vLLM's (temperature <= 2; seed and top_k travel as 64-bit integers to the engine core)."""
        checks = (
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be within [0, 2]"),
            ("top_k", 0 <= self.top_k <= MAX_TOP_K, f"must be within [0, {MAX_TOP_K}] (0: no top-k)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be within (0, 1]"),
            ("seed", self.seed is None or 0 <= self.seed <= MAX_SEED, f"must be within [0, {MAX_SEED}] or null"),
            ("cfg_scale", 0.0 <= self.cfg_scale <= 20.0, "must be within [0, 20]"),
            ("max_response_ms", 0.0 < self.max_response_ms <= 600_000.0, "must be within (0, 600000]"),
            ("truncation", self.truncation in TRUNCATION_MODES, f"must be one of {', '.join(TRUNCATION_MODES)}"),
            ("retention_ratio", 0.0 < self.retention_ratio <= 1.0, "must be within (0, 1]"),
            ("noise_reduction", self.noise_reduction in (None, *NOISE_REDUCTION_TYPES), f"must be {' or '.join(NOISE_REDUCTION_TYPES)} or null"),
        )
        return [(name, why) for name, ok, why in checks if not ok]

    def engine_options(self, voice_pcm: dict) -> ConversationOptions:
        """The engine's options for these settings; `voice_pcm`: the server's voices, loaded (name -> 16 kHz PCM)."""
        return ConversationOptions(system_prompt=self.instructions or None, speaker_prompt_pcm=voice_pcm.get(self.voice),
                                   temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
                                   cfg_scale=self.cfg_scale, max_response_ms=self.max_response_ms,
                                   retention_ratio=None if self.truncation == "disabled" else self.retention_ratio,
                                   assistant_text=self.assistant_text)


# The session settings the engine's options are made of (all but the server's voice table and the
# gateway's own noise suppression): a change to any of them must reach the conversation.
ENGINE_KEYS = tuple(f.name for f in fields(SessionSection) if f.name not in ("voices", "noise_reduction"))


# Phone calls (8 kHz mu-law, line noise, the caller's speakerphone echoing us): a stricter threshold
# and 160 ms of speech before a barge-in; a longer pause ends a turn.
TELEPHONY_VAD = VadParams(threshold=0.6, prefix_padding_ms=300, silence_duration_ms=600, min_speech_ms=160)


@dataclass(frozen=True)
class TelephonySection:
    """The Twilio Media Streams bridge (`WS /v1/telephony/twilio`, `POST|GET /v1/telephony/twiml`)."""

    public_url: str | None = None  # how Twilio reaches us (https://voice.example.com); null: server.public_url
    allowed_hosts: list = field(default_factory=list)  # no public URL set: Host headers TwiML may name (loopback always)
    twilio_auth_token: str | None = None  # set: the TwiML webhook must carry a valid X-Twilio-Signature (or the gateway token)
    end_call_digit: str | None = "#"  # DTMF digit that ends the call; null: none does
    start_timeout_s: float = 10.0  # connected stream without a `start` for this long => closed
    ticket_ttl_s: float = 60.0  # the one-time stream token in the TwiML is valid this long
    max_message_bytes: int = 16 * 1024  # one Twilio message (theirs are < 1 KiB); larger closes the stream (1009)
    # A call's text in the log at INFO (there is no client to send it to): the caller's turns as the
    # model transcribes them (engine work beside each answer, no added latency) and the assistant's
    # text when session.assistant_text is on. Needs a model with a text tokenizer. false: a call's
    # words stay out of the logs.
    transcripts: bool = True
    vad: VadParams = TELEPHONY_VAD  # turn detection of phone calls (a nested section: telephony.vad.threshold ...)


@dataclass(frozen=True)
class WebRtcSection:
    # The address browsers reach this replica's media on, when it is not the one its interfaces hold
    # (a 1:1 NAT: a cloud VM's public IP, a Kubernetes node's address with hostNetwork): the answer's
    # host candidates and c= lines carry it instead. The offer/answer may pass a load balancer; the
    # media goes straight here (docs/scaling.md). None: the interfaces' own addresses.
    public_host: str | None = None


@dataclass(frozen=True)
class AudioApiSection:
    """OpenAI's one-shot audio endpoints (`POST /v1/audio/transcriptions`, `POST /v1/audio/speech`;
    realtime/transports/audio_api.py), served by the same engine as the conversations."""

    enabled: bool = True
    max_upload_mb: float = 25.0  # a transcription request's body (MiB; OpenAI's file limit); larger: 413 before it is read
    upload_timeout_s: float = 120.0  # such a request must have arrived within this (a slow upload holds a connection no longer)
    # Decoded audio of one upload; longer: 400 audio_too_long, found while decoding (decoding stops
    # there). The real OpusLM checkpoints hold 8192 positions (164 s of audio, prompt included).
    max_duration_s: float = 120.0
    # Memory one upload's decoding may hold (MiB: its PCM so far and the frame in hand); beyond: 400
    # audio_too_complex. None: 4x the 16 kHz mono PCM of max_duration_s (15 MB at 120 s).
    max_decode_mb: float | None = None
    decode_timeout_s: float = 10.0  # wall clock of one upload's decoding (a 120 s MP3 takes ~0.3 s); beyond: 400 decode_timeout
    max_input_chars: int = 4096  # speech `input` (OpenAI's limit); longer: 400
    max_speech_s: float = 30.0  # audio of one speech reply (the engine's SpeechOptions.max_ms): the reply ends there
    max_concurrent: int = 4  # one-shot requests running at once (both endpoints), so they cannot starve the sessions; beyond: 429
    send_timeout_s: float = 30.0  # a streamed reply whose client takes nothing for this long is dropped (its generation ends)

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 2**20)


@dataclass(frozen=True)
class ServerConfig:
    server: ServerSection = field(default_factory=ServerSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    audio: AudioSection = field(default_factory=AudioSection)
    vad: VadSection = field(default_factory=VadSection)
    session: SessionSection = field(default_factory=SessionSection)
    telephony: TelephonySection = field(default_factory=TelephonySection)
    webrtc: WebRtcSection = field(default_factory=WebRtcSection)
    audio_api: AudioApiSection = field(default_factory=AudioApiSection)
    engine: EngineServiceConfig = field(default_factory=EngineServiceConfig)  # model: null = the tiny model


def _check(value, annotation, key: str):
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for opt in options:
            if opt is type(None):
                continue
            try:
                return _check(value, opt, key)
            except ValueError as e:
                errors.append(e)
        raise errors[0]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is dict and isinstance(value, dict):
        return dict(value)
    if not isinstance(value, annotation) or (isinstance(value, bool) and annotation is not bool):
        raise ValueError(f"config key '{key}': expected {annotation.__name__}, got {value!r}")
    return value


def _section(cls, data, key: str, base=None):
    """`data` checked against the dataclass `cls`; keys it leaves out keep `base`'s values (default: cls's).
    A field whose type is a dataclass is a nested section (telephony.vad)."""
    base = cls() if base is None else base
    if data is None:
        return base
    if not isinstance(data, dict):
        raise ValueError(f"config key '{key}': expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for k, v in data.items():
        if k not in names:
            raise ValueError(f"config key '{key}.{k}': unknown key (known: {', '.join(sorted(names))})")
        if isinstance(hints[k], type) and dataclasses.is_dataclass(hints[k]):
            values[k] = _section(hints[k], v, f"{key}.{k}", getattr(base, k))
        else:
            values[k] = _check(v, hints[k], f"{key}.{k}")
    return dataclasses.replace(base, **values)


def config_from_dict(data: dict | None) -> ServerConfig:
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError("config: the top level must be a mapping")
    sections = {"server": ServerSection, "limits": LimitsSection, "audio": AudioSection, "vad": VadSection, "session": SessionSection,
                "telephony": TelephonySection, "webrtc": WebRtcSection, "audio_api": AudioApiSection,
                "engine": EngineServiceConfig}  # (its bounds: checked by the dataclass itself, naming the key)
    for k in data:
        if k not in sections:
            raise ValueError(f"config key '{k}': unknown section (known: {', '.join(sorted(sections))})")
    cfg = ServerConfig(**{k: _section(cls, data.get(k), k) for k, cls in sections.items()})
    validate(cfg)
    return cfg


def validate(cfg: ServerConfig) -> None:
    checks = [
        ("server.port", 0 <= cfg.server.port <= 65535),
        ("server.client_secret_max_ttl_s", MIN_SECRET_TTL_S <= cfg.server.client_secret_max_ttl_s <= MAX_SECRET_TTL_S),
        ("server.client_secret_ttl_s", MIN_SECRET_TTL_S <= cfg.server.client_secret_ttl_s <= cfg.server.client_secret_max_ttl_s),
        ("limits.drain_timeout_s", 0 <= cfg.limits.drain_timeout_s <= 86_400),
        ("limits.max_message_bytes", cfg.limits.max_message_bytes >= 1024),
        ("limits.max_append_bytes", cfg.limits.max_append_bytes >= 1),
        ("limits.max_sessions", cfg.limits.max_sessions is None or cfg.limits.max_sessions >= 0),
        ("limits.inbound_queue", cfg.limits.inbound_queue >= 1),
        ("limits.outbound_queue", cfg.limits.outbound_queue >= 8),
        ("limits.idle_timeout_s", cfg.limits.idle_timeout_s > 0),
        ("limits.resume_grace_s", 0 <= cfg.limits.resume_grace_s <= 3600),
        ("limits.resume_buffer_bytes", cfg.limits.resume_buffer_bytes >= 0),
        ("audio.lead_ms", 0 <= cfg.audio.lead_ms <= 2000),
        ("audio.output_frame_ms", cfg.audio.output_frame_ms in (10, 20, 40, 60, 80, 100)),
        ("audio.opus_complexity", 0 <= cfg.audio.opus_complexity <= 10),
        ("audio.vad_batch_ms", 0 <= cfg.audio.vad_batch_ms <= 200),
        ("telephony.public_url", cfg.telephony.public_url is None or cfg.telephony.public_url.split("://")[0] in ("http", "https", "ws", "wss")),
        ("telephony.end_call_digit", cfg.telephony.end_call_digit is None or (len(cfg.telephony.end_call_digit) == 1
                                                                              and cfg.telephony.end_call_digit in "0123456789*#ABCD")),
        ("telephony.start_timeout_s", cfg.telephony.start_timeout_s > 0),
        ("telephony.ticket_ttl_s", cfg.telephony.ticket_ttl_s > 0),
        ("telephony.max_message_bytes", cfg.telephony.max_message_bytes >= 1024),
        ("audio_api.max_upload_mb", 0 < cfg.audio_api.max_upload_mb <= 1024),
        ("audio_api.upload_timeout_s", cfg.audio_api.upload_timeout_s > 0),
        ("audio_api.max_duration_s", 0 < cfg.audio_api.max_duration_s <= 3600),
        # room for the PCM of the longest upload accepted (16 kHz mono int16), or every long one is refused
        ("audio_api.max_decode_mb", cfg.audio_api.max_decode_mb is None
         or cfg.audio_api.max_decode_mb * 2**20 >= cfg.audio_api.max_duration_s * 32000 + 2**20),
        ("audio_api.decode_timeout_s", cfg.audio_api.decode_timeout_s > 0),
        ("audio_api.max_input_chars", cfg.audio_api.max_input_chars >= 1),
        ("audio_api.max_speech_s", 0 < cfg.audio_api.max_speech_s <= 600),
        ("audio_api.max_concurrent", cfg.audio_api.max_concurrent >= 1),
        ("audio_api.send_timeout_s", cfg.audio_api.send_timeout_s > 0),
    ]
    for key, ok in checks:
        if not ok:
            raise ValueError(f"config key '{key}': value out of range")
    if cfg.webrtc.public_host is not None:
        try:
            ipaddress.ip_address(cfg.webrtc.public_host)
        except ValueError:
            raise ValueError(f"config key 'webrtc.public_host': {cfg.webrtc.public_host!r} is not an IP address "
                             "(ICE candidates carry addresses, not names)") from None
    if cfg.server.client_secret_key is not None and len(cfg.server.client_secret_key) < MIN_SECRET_KEY_CHARS:
        raise ValueError(f"config key 'server.client_secret_key': at least {MIN_SECRET_KEY_CHARS} characters (it signs every "
                         "client secret: a short one can be guessed), or null to derive it from the token")
    if cfg.server.replica_id is not None and not REPLICA_ID.fullmatch(cfg.server.replica_id):
        raise ValueError(f"config key 'server.replica_id': {cfg.server.replica_id!r} is not a DNS label (1-63 of a-z, 0-9 "
                         "and '-', not starting or ending with '-'): it goes into URLs and load balancer backend names")
    for name, why in cfg.session.problems():
        raise ValueError(f"config key 'session.{name}': value out of range ({why})")
    for key, params in (("vad", cfg.vad), ("telephony.vad", cfg.telephony.vad), ("limits.input", cfg.limits.input),
                        ("limits.text", cfg.limits.text), ("limits.http_rate", cfg.limits.http_rate)):
        for name, why in params.problems():  # the same rules as session.update's turn_detection
            raise ValueError(f"config key '{key}.{name}': value out of range ({why})")
    if cfg.server.cors_origins is not None and not all(isinstance(o, str) and o for o in cfg.server.cors_origins):
        raise ValueError("config key 'server.cors_origins': a list of origins (scheme://host[:port]), or unset for any")
    if not all(isinstance(h, str) and h for h in cfg.telephony.allowed_hosts):
        raise ValueError("config key 'telephony.allowed_hosts': a list of host names (host or host:port)")
    for name, path in cfg.session.voices.items():
        if not isinstance(name, str) or not name or name == "default" or not isinstance(path, str):
            raise ValueError(f"config key 'session.voices.{name}': a voice is a name (not 'default') and a WAV file path")
    if cfg.session.voice != "default" and cfg.session.voice not in cfg.session.voices:
        raise ValueError(f"config key 'session.voice': {cfg.session.voice!r} is not 'default' or a name in session.voices")


def with_overrides(cfg: ServerConfig, **keys) -> ServerConfig:
    """Apply dotted-key overrides (from CLI flags), e.g. with_overrides(cfg, **{"server.port": 9000}); None = keep."""
    data = {s: dataclasses.asdict(getattr(cfg, s)) for s in ("server", "limits", "audio", "vad", "session", "telephony", "webrtc",
                                                             "audio_api", "engine")}
    for dotted, value in keys.items():
        if value is None:
            continue
        section, name = dotted.split(".", 1)
        data[section][name] = value
    return config_from_dict(data)


def load_config(path: str | Path | None) -> ServerConfig:
    if path is None:
        return ServerConfig()
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"config file not found: {path}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"config {path}: invalid YAML: {e}") from None
    return config_from_dict(data)
