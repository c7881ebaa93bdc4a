"""Ephemeral client secrets (realtime/client_secrets.py): minting, verifying, replicas, bad requests."""

from __future__ import annotations

import base64
import json
import random
import zlib

import pytest

from realtime.client_secrets import (
    MAX_KEY_CHARS, ClientSecrets, Grant, SecretRequestError, derive_signing_key, session_validator,
)
from realtime.config import ServerSection, config_from_dict
from realtime.protocol import SessionSettings

T0 = 1_800_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def cs(clock) -> ClientSecrets:
    return ClientSecrets(derive_signing_key("the-server-token"), clock=clock)


SESSION = {"type": "realtime", "model": "gpt-realtime", "instructions": "Speak like a pirate.",
           "audio": {"output": {"voice": "marin"}, "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "low"}}}}


def test_round_trip_keeps_the_session(cs, clock):
    minted = cs.mint({"expires_after": {"anchor": "created_at", "seconds": 120}, "session": SESSION})
    assert set(minted) == {"value", "expires_at", "session"}
    assert minted["value"].startswith("ek_") and minted["expires_at"] == int(T0) + 120
    assert minted["session"] == {**SESSION, "object": "realtime.session"}
    grant = cs.verify(minted["value"])
    assert isinstance(grant, Grant)
    assert grant.session == SESSION and grant.expires_at == minted["expires_at"]
    assert grant.key_id and grant.key_id not in minted["value"]
    clock.now += 119.5
    assert cs.verify(minted["value"]) == grant


def test_defaults_and_response_session(cs):
    minted = cs.mint({})
    assert minted["expires_at"] == int(T0) + 600  # OpenAI's default: 10 minutes
    assert minted["session"] == {"type": "realtime", "object": "realtime.session"}
    assert cs.verify(minted["value"]).session == {}
    assert cs.mint(None)["expires_at"] == int(T0) + 600  # no body at all
    assert cs.mint({"expires_after": {"seconds": 30}})["expires_at"] == int(T0) + 30  # anchor omitted: created_at
    assert cs.mint({"expires_after": None, "session": None})["expires_at"] == int(T0) + 600


def test_each_key_has_its_own_id(cs):
    a, b = (cs.verify(cs.mint({})["value"]) for _ in range(2))
    assert a is not None and b is not None and a.key_id != b.key_id


def test_expires_at_exactly_expires_at(cs, clock):
    value = cs.mint({"expires_after": {"seconds": 10}})["value"]
    clock.now = T0 + 9.999
    assert cs.verify(value) is not None
    clock.now = T0 + 10
    assert cs.verify(value) is None
    clock.now = T0 + 10_000
    assert cs.verify(value) is None


def test_key_is_token_characters_only(cs):
    value = cs.mint({"session": SESSION})["value"]
    assert all(c.isascii() and (c.isalnum() or c in "_-.") for c in value)
    assert "=" not in value and len(value) <= MAX_KEY_CHARS


def _tampered(value: str) -> list[object]:
    body, mac = value[3:].split(".")
    flip = {"A": "B"}.get(body[5], "A")
    payload = json.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))
    payload["exp"] += 3600  # a longer life, re-encoded, old signature
    forged = base64.urlsafe_b64encode(zlib.compress(json.dumps(payload).encode())).rstrip(b"=").decode()
    return [
        "ek_" + body[:5] + flip + body[6:] + "." + mac,  # one payload character
        f"ek_{forged}.{mac}",
        "ek_" + body + "." + mac[:-1] + {"A": "B"}.get(mac[-1], "A"),  # signature
        "ek_" + body + "." + mac[:-2],  # truncated signature
        "ek_" + body + ".",
        "ek_" + body,
        value[:-1], value[: len(value) // 2],  # truncated
        "ek-" + value[3:], "sk_" + value[3:], value[3:], "EK_" + value[3:], " " + value, value + " ",  # prefix
        value + ".x", value.replace(".", ".."),
        value[:-1] + "é", value[:10] + "\u00e9" + value[11:], value + "\ud800",  # non-ASCII, a lone surrogate
        "ek_" + "A" * (MAX_KEY_CHARS + 10) + "." + mac,  # absurd length
        value + "A" * MAX_KEY_CHARS,
        "ek_" + "!!!!" + "." + mac, "ek_" + body + ".%%%%",  # not base64url
        "ek_.", "ek_", "", ".", "Bearer " + value, None, 42, b"ek_abc.def", ["ek_"],
    ]


def test_tampered_and_garbage_keys_are_refused_without_raising(cs):
    value = cs.mint({"session": SESSION})["value"]
    assert cs.verify(value) is not None
    for bad in _tampered(value):
        assert cs.verify(bad) is None, bad


def test_signed_garbage_is_refused(cs):
    """A payload our key signed that is not our format (it cannot happen unless the key is shared with a
    stranger): still None, never an exception."""
    def signed(raw: bytes) -> str:
        body = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
        return f"ek_{body}.{cs._sign(body)}"

    for raw in (b"not zlib", zlib.compress(b"not json"), zlib.compress(b"[1, 2]"), zlib.compress(b'{"exp": "soon"}'),
                zlib.compress(json.dumps({"iat": 1, "exp": 2**40, "kid": "k", "session": []}).encode()),
                zlib.compress(b" " * (1 << 20) + b"{}"),  # a decompression bomb
                zlib.compress(b"{}")[:-3], b""):
        assert cs.verify(signed(raw)) is None, raw
    good = zlib.compress(json.dumps({"iat": 1, "exp": 2**40, "kid": "k", "session": {}}).encode())
    assert cs.verify(signed(good)) == Grant({}, 2**40, "k")  # (the helper itself makes valid keys)


def test_another_signing_key_refuses(cs, clock):
    value = cs.mint({})["value"]
    assert ClientSecrets(derive_signing_key("another-token"), clock=clock).verify(value) is None
    assert ClientSecrets(b"the-server-token", clock=clock).verify(value) is None  # the raw token is not the key


def test_replicas_sharing_the_token_honour_each_others_keys(clock):
    server = ServerSection()
    a, b = (ClientSecrets.for_server(server, "shared-token", clock) for _ in range(2))
    other = ClientSecrets.for_server(server, "other-token", clock)
    value = a.mint({"session": SESSION})["value"]
    assert (grant := b.verify(value)) is not None and grant.session == SESSION
    assert a.verify(b.mint({})["value"]) is not None
    assert other.verify(value) is None


def test_replicas_sharing_the_client_secret_key(clock):
    a = ClientSecrets.for_server(ServerSection(client_secret_key="k" * 32), "token-a", clock)
    b = ClientSecrets.for_server(ServerSection(client_secret_key="k" * 32), "token-b", clock)
    c = ClientSecrets.for_server(ServerSection(client_secret_key="j" * 32), "token-a", clock)
    by_token = ClientSecrets.for_server(ServerSection(), "token-a", clock)
    value = a.mint({})["value"]
    assert b.verify(value) is not None
    assert c.verify(value) is None and by_token.verify(value) is None


def test_no_token_signs_with_a_key_of_this_process(clock):
    for token in (None, ""):
        a, b = ClientSecrets.for_server(ServerSection(), token, clock), ClientSecrets.for_server(ServerSection(), token, clock)
        value = a.mint({})["value"]
        assert a.verify(value) is not None and b.verify(value) is None
        assert ClientSecrets.for_server(ServerSection(), "", clock).verify(value) is None


def test_for_server_takes_the_configured_lives(clock):
    cs = ClientSecrets.for_server(ServerSection(client_secret_ttl_s=60.0, client_secret_max_ttl_s=300.0), "t", clock)
    assert cs.mint({})["expires_at"] == int(T0) + 60
    assert cs.mint({"expires_after": {"seconds": 300}})["expires_at"] == int(T0) + 300
    with pytest.raises(SecretRequestError) as e:
        cs.mint({"expires_after": {"seconds": 301}})
    assert e.value.param == "expires_after.seconds" and "[10, 300]" in e.value.message


@pytest.mark.parametrize("body, param, code", [
    ([], None, "invalid_type"),
    ("{}", None, "invalid_type"),
    ({"expires_after": {"seconds": 60}, "model": "gpt-realtime"}, "model", "unknown_parameter"),
    ({"expires_after": 60}, "expires_after", "invalid_type"),
    ({"expires_after": {"anchor": "now", "seconds": 60}}, "expires_after.anchor", "invalid_value"),
    ({"expires_after": {"anchor": None}}, "expires_after.anchor", "invalid_value"),
    ({"expires_after": {"seconds": 9}}, "expires_after.seconds", "invalid_value"),
    ({"expires_after": {"seconds": 7201}}, "expires_after.seconds", "invalid_value"),
    ({"expires_after": {"seconds": -5}}, "expires_after.seconds", "invalid_value"),
    ({"expires_after": {"seconds": 60.0}}, "expires_after.seconds", "invalid_type"),
    ({"expires_after": {"seconds": "60"}}, "expires_after.seconds", "invalid_type"),
    ({"expires_after": {"seconds": True}}, "expires_after.seconds", "invalid_type"),
    ({"expires_after": {"seconds": 60, "unit": "s"}}, "expires_after.unit", "unknown_parameter"),
    ({"session": "realtime"}, "session", "invalid_type"),
    ({"session": ["x"]}, "session", "invalid_type"),
    ({"session": {"type": "transcription"}}, "session.type", "invalid_value"),
    ({"session": {"instructions": float("nan")}}, "session", "invalid_type"),  # (never from a JSON parser)
])
def test_bad_request_bodies_name_the_param(cs, body, param, code):
    with pytest.raises(SecretRequestError) as e:
        cs.mint(body)
    assert isinstance(e.value, ValueError)
    assert (e.value.param, e.value.code) == (param, code)
    assert e.value.message and str(e.value) == e.value.message


def test_bounds_of_seconds_are_accepted(cs):
    assert cs.mint({"expires_after": {"anchor": "created_at", "seconds": 10}})["expires_at"] == int(T0) + 10
    assert cs.mint({"expires_after": {"anchor": "created_at", "seconds": 7200}})["expires_at"] == int(T0) + 7200


def test_oversize_session_is_refused(cs):
    # incompressible instructions: the key would be longer than a header should carry
    noise = base64.b64encode(random.Random(0).randbytes(4000)).decode()  # 5.3 KB of text, within max_instructions_bytes
    with pytest.raises(SecretRequestError, match="too large for a client secret") as e:
        cs.mint({"session": {"instructions": noise}})
    assert e.value.param == "session"
    # compressible but huge: refused before compression can make it small
    with pytest.raises(SecretRequestError, match=r"too large for a client secret \(\d+ bytes") as e:
        cs.mint({"session": {"instructions": "a" * 100_000}})
    assert e.value.param == "session"
    # a config of ordinary size fits
    assert len(cs.mint({"session": {**SESSION, "instructions": "Be brief. " * 300}})["value"]) <= MAX_KEY_CHARS


def test_validator_refuses_what_session_update_refuses(cs):
    validate = session_validator(SessionSettings(), text_model=False)
    ok = cs.mint({"session": SESSION}, validate)
    assert cs.verify(ok["value"]).session == SESSION
    for session, param in (
        ({"audio": {"output": {"voice": 7}}}, "session.audio.output.voice"),
        ({"audio": {"input": {"turn_detection": {"type": "push_to_talk"}}}}, "session.audio.input.turn_detection.type"),
        ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 3.0}}}},
         "session.audio.input.turn_detection.threshold"),
        ({"temperature": 9.0}, "session.temperature"),
        ({"voices": ["x"]}, "session.voices"),  # unknown field
        ({"audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
        ({"output_modalities": ["text"]}, "session.output_modalities"),  # needs a text model
        ({"audio": {"input": {"format": {"type": "audio/flac"}}}}, "session.audio.input.format"),
        ({"instructions": "x" * (20 * 1024)}, "session.instructions"),  # limits.text.max_instructions_bytes
    ):
        with pytest.raises(SecretRequestError) as e:
            cs.mint({"session": session}, validate)
        assert e.value.param == param, (session, e.value.message)
    with_text = session_validator(SessionSettings(), text_model=True)
    assert cs.mint({"session": {"output_modalities": ["text"]}}, with_text)["session"]["output_modalities"] == ["text"]


def test_validator_reports_the_first_refused_field(cs):
    validate = session_validator(SessionSettings(), text_model=False)
    with pytest.raises(SecretRequestError) as e:
        cs.mint({"session": {"bogus": 1, "temperature": 9.0}}, validate)
    assert e.value.param == "session.bogus" and e.value.code == "unknown_parameter"


def test_constructor_bounds():
    with pytest.raises(ValueError):
        ClientSecrets(b"k", default_ttl_s=5)
    with pytest.raises(ValueError):
        ClientSecrets(b"k", default_ttl_s=700, max_ttl_s=600)
    with pytest.raises(ValueError):
        ClientSecrets(b"")


@pytest.mark.parametrize("server, key", [
    ({"client_secret_ttl_s": 5}, "server.client_secret_ttl_s"),
    ({"client_secret_ttl_s": 8000}, "server.client_secret_ttl_s"),  # above the max
    ({"client_secret_max_ttl_s": 9}, "server.client_secret_max_ttl_s"),
    ({"client_secret_max_ttl_s": 100_000}, "server.client_secret_max_ttl_s"),
    ({"client_secret_key": "short"}, "server.client_secret_key"),
    ({"client_secret_key": 12345678901234567890}, "server.client_secret_key"),
])
def test_config_bounds(server, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        config_from_dict({"server": server})


def test_config_accepts_its_range():
    cfg = config_from_dict({"server": {"client_secret_key": "s" * 16, "client_secret_ttl_s": 10,
                                       "client_secret_max_ttl_s": 86400}})
    assert cfg.server.client_secret_ttl_s == 10.0 and cfg.server.client_secret_max_ttl_s == 86400.0
