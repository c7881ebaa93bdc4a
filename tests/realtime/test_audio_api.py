"""OpenAI's audio endpoints on a real Gateway (127.0.0.1, fake engine), driven by the official openai SDK
and raw HTTP: uploads in every container a client sends decoded to what the engine gets, the
transcript as json, text, verbose_json and SSE; speech in every format decoded back; replies that
stream before the engine has finished and stop it when the client leaves; every refusal an OpenAI
error; a live realtime session unaffected by a burst of bad requests."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import wave

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile
import websockets
from fake_engine import FakeEngine, fake_transcript, speech_hz, speech_ms, speech_pcm
from openai import AsyncOpenAI
from rt_helpers import fake_gateway

from realtime.audio import StreamResampler
from realtime.audio_upload import UploadError, UploadLimits, decode_upload
from realtime.config import config_from_dict
from realtime.server import Gateway
from realtime.speech_formats import UNKNOWN_SIZE

TOKEN = "audio-token"
TEXT = "Hello there, how are you?"  # 25 characters: 1.5 s of the fake's speech at 350 Hz


def gateway(engine: FakeEngine | None = None, config: dict | None = None, voices: dict | None = None):
    return fake_gateway(engine or FakeEngine(), config, TOKEN, voices)


def sdk(gw: Gateway, token: str = TOKEN) -> AsyncOpenAI:
    return AsyncOpenAI(api_key=token, base_url=f"http://127.0.0.1:{gw.port}/v1", max_retries=0)


def run(main, timeout_s: float = 60) -> None:
    asyncio.run(asyncio.wait_for(main(), timeout_s))


def tone(hz: float, seconds: float, rate_hz: int, channels: int = 1) -> np.ndarray:
    """int16, shape (samples,) or (samples, channels)."""
    x = np.round(6000 * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate_hz)) / rate_hz)).astype(np.int16)
    return x if channels == 1 else np.repeat(x[:, None], channels, axis=1)


def wav_file(pcm: np.ndarray, rate_hz: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1 if pcm.ndim == 1 else pcm.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate_hz)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


class Pipe:
    """A sink that cannot seek, as a browser's MediaRecorder blob is written: live WebM (unknown sizes, no cues)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b) -> int:
        self.data += bytes(b)
        return len(b)


def encoded(muxer: str, codec: str, pcm: np.ndarray, rate_hz: int, seekable: bool = True) -> bytes:
    """`pcm` (int16, mono or (n, 2)) encoded by PyAV into `muxer` with `codec`."""
    out = io.BytesIO() if seekable else Pipe()
    layout = "mono" if pcm.ndim == 1 else "stereo"
    with av.open(out, mode="w", format=muxer) as c:
        stream = c.add_stream(codec, rate=rate_hz, layout=layout)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout=layout)
        frame.sample_rate, frame.pts = rate_hz, 0
        for packet in stream.encode(frame):
            c.mux(packet)
        for packet in stream.encode(None):
            c.mux(packet)
    return out.getvalue() if seekable else bytes(out.data)


def peak_hz(pcm: np.ndarray, rate_hz: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64) * np.hanning(pcm.size)))
    return float(np.argmax(spectrum) * rate_hz / pcm.size)


def heard_ms(transcript: str) -> int:
    """The audio length the fake engine reports in its transcript."""
    words = transcript.split()
    assert words[:2] == ["i", "heard"] and words[3:] == ["milliseconds", "of", "audio"], transcript
    return int(words[2])


def decode_all(data: bytes) -> tuple[np.ndarray, int, str]:
    """A reply decoded by PyAV: (mono int16 at its own rate, rate, demuxer)."""
    with av.open(io.BytesIO(data)) as c:
        parts, rate = [], None
        for frame in c.decode(c.streams.audio[0]):
            parts.append(frame.to_ndarray().reshape(-1) if frame.format.name == "s16" else
                         np.round(frame.to_ndarray().reshape(-1) * 32767).astype(np.int16))
            rate = frame.sample_rate
        return np.concatenate(parts), rate, c.format.name


async def refusal(call) -> tuple[int, dict, httpx.Headers]:
    """(status, the OpenAI error object, headers) of a call the server refuses."""
    try:
        await call
    except openai.APIStatusError as e:
        body = e.response.json()
        assert set(body) == {"error"} and {"type", "code", "message"} <= set(body["error"]), body
        return e.status_code, body["error"], e.response.headers
    raise AssertionError("the request was accepted")


# ---- transcriptions ----

def test_a_wav_transcribed_as_json_text_verbose_json_and_a_stream():
    async def main():
        engine = FakeEngine(oneshot_step_s=0.002)
        async with gateway(engine) as gw:
            client = sdk(gw)
            pcm = tone(440, 1.5, 16_000)
            upload = ("speech.wav", wav_file(pcm, 16_000), "audio/wav")
            expected = fake_transcript(pcm)
            r = await client.audio.transcriptions.create(model="whisper-1", file=upload)
            assert r.text == expected and r.usage.type == "duration" and r.usage.seconds == 1.5
            assert np.array_equal(engine.transcriptions[-1].pcm, pcm)  # 16 kHz mono: the samples themselves
            assert await client.audio.transcriptions.create(model="x", file=upload, response_format="text") == expected + "\n"
            v = await client.audio.transcriptions.create(model="x", file=upload, response_format="verbose_json", temperature=0.3)
            assert (v.text, v.duration, v.segments, v.language, v.model_extra["task"]) == (expected, 1.5, [], None, "transcribe")
            assert engine.transcriptions[-1].options.temperature == 0.3 and engine.transcriptions[0].options.temperature == 0.0
            events = [ev async for ev in await client.audio.transcriptions.create(model="x", file=upload, stream=True)]
            deltas = [ev.delta for ev in events[:-1]]
            assert all(ev.type == "transcript.text.delta" for ev in events[:-1]) and len(deltas) == len(expected.split())
            assert "".join(deltas) == expected and events[-1].type == "transcript.text.done" and events[-1].text == expected
            assert all(t.status == "completed" for t in engine.transcriptions) and len(engine.transcriptions) == 4
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": "ok"}) == 4
            assert m("duplex_audio_api_audio_seconds_total", {"endpoint": "transcriptions"}) == 6.0
            assert m("duplex_audio_api_requests_running") == 0

    run(main)


UPLOADS = {  # name: (muxer, codec, rate, channels, seekable) -- what clients send
    "flac": ("flac", "flac", 44_100, 1, True),
    "ogg-opus": ("ogg", "libopus", 48_000, 1, True),
    "webm-opus-mediarecorder": ("webm", "libopus", 48_000, 1, False),
    "mp3-stereo": ("mp3", "libmp3lame", 44_100, 2, True),
    "m4a-aac": ("ipod", "aac", 22_050, 1, True),
    "wav-stereo-48k": ("wav", "pcm_s16le", 48_000, 2, True),
}


@pytest.mark.parametrize("name", list(UPLOADS))
def test_every_container_a_client_sends_reaches_the_engine_as_16k_mono(name):
    muxer, codec, rate, channels, seekable = UPLOADS[name]
    data = encoded(muxer, codec, tone(440, 1.5, rate, channels), rate, seekable)

    async def main():
        engine = FakeEngine(oneshot_step_s=0)
        async with gateway(engine) as gw:
            r = await sdk(gw).audio.transcriptions.create(model="x", file=(f"speech.{muxer}", data))
            got = engine.transcriptions[-1].pcm
            assert got.dtype == np.int16 and got.ndim == 1
            assert abs(heard_ms(r.text) - 1500) <= 60 and heard_ms(r.text) == round(got.size / 16)  # codec padding at most
            assert abs(peak_hz(got, 16_000) - 440) < 5  # decoded and resampled, not just counted

    run(main)


def test_decoding_stops_once_the_upload_is_too_long(monkeypatch):
    """A 10-minute FLAC with a 2 s limit: refused after about 2 s of it has been decoded, not 10 minutes
    (written to a pipe, so it does not declare its length; one that does is refused before decoding)."""
    import realtime.audio_upload as audio_upload

    data = encoded("flac", "flac", np.zeros(600 * 8_000, np.int16), 8_000, seekable=False)
    resampled = []

    real = av.AudioResampler

    class Counting:
        def __init__(self, **kwargs) -> None:
            self.inner = real(**kwargs)

        def resample(self, frame):
            resampled.append(0 if frame is None else frame.samples)
            return self.inner.resample(frame)

    monkeypatch.setattr(audio_upload.av, "AudioResampler", Counting)
    with pytest.raises(UploadError) as e:
        decode_upload(data, UploadLimits(len(data), max_duration_s=2.0))
    assert e.value.code == "audio_too_long" and e.value.status == 400 and "2 s" in e.value.message
    assert 2 * 8_000 <= sum(resampled) <= 3 * 8_000
    resampled.clear()
    with pytest.raises(UploadError) as e:
        decode_upload(encoded("flac", "flac", np.zeros(600 * 8_000, np.int16), 8_000), UploadLimits(1 << 20, max_duration_s=2.0))
    assert e.value.code == "audio_too_long" and "declares 600 s" in e.value.message and resampled == []
    audio = decode_upload(encoded("flac", "flac", np.zeros(3 * 8_000, np.int16), 8_000), UploadLimits(1 << 20, 5.0))
    assert audio.pcm.size == 3 * 16_000 and audio.container == "flac"


def test_an_upload_may_not_make_ffmpeg_open_other_files():
    for playlist in (b"ffconcat version 1.0\nfile '/etc/hostname'\n",
                     b"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\nfile:///etc/hostname\n#EXT-X-ENDLIST\n"):
        with pytest.raises(UploadError) as e:
            decode_upload(playlist, UploadLimits(1 << 20, 60.0))
        assert e.value.code == "invalid_file_format"


# ---- speech ----

def _reference_24k(text: str, chunk_samples: int = 1280) -> np.ndarray:
    """The fake's speech for `text` resampled to 24 kHz in the chunks the server gets (soxr's stream is chunk-exact)."""
    pcm = speech_pcm(text, 0, round(speech_ms(text) * 16))
    r = StreamResampler(16_000, 24_000)
    return np.concatenate([r.process(pcm[i:i + chunk_samples]) for i in range(0, pcm.size, chunk_samples)] + [r.flush()])


@pytest.mark.parametrize("fmt", ["wav", "pcm", "opus", "flac", "mp3", "aac"])
def test_speech_in_every_format_decodes_back_to_the_engines_audio(fmt):
    async def main():
        engine = FakeEngine(oneshot_step_s=0)
        async with gateway(engine) as gw:
            async with sdk(gw).audio.speech.with_streaming_response.create(model="tts-1", input=TEXT, voice="alloy",
                                                                          response_format=fmt) as resp:
                assert resp.status_code == 200 and resp.headers["transfer-encoding"] == "chunked"
                ctype = resp.headers["content-type"]
                data = b"".join([piece async for piece in resp.iter_bytes()])
        assert engine.syntheses[-1].status == "completed" and engine.syntheses[-1].options.speaker_prompt_pcm is None
        seconds = speech_ms(TEXT) / 1000
        reference = _reference_24k(TEXT)
        if fmt == "pcm":  # raw s16le at 24 kHz, no header
            assert ctype == "audio/pcm" and np.array_equal(np.frombuffer(data, "<i2"), reference)
            return
        if fmt == "wav":
            assert data[:4] == b"RIFF" and data[36:40] == b"data" and int.from_bytes(data[4:8], "little") == UNKNOWN_SIZE
            assert int.from_bytes(data[40:44], "little") == UNKNOWN_SIZE and np.array_equal(np.frombuffer(data[44:], "<i2"), reference)
            sf_pcm, sf_rate = soundfile.read(io.BytesIO(data), dtype="int16")
            assert sf_rate == 24_000 and np.array_equal(sf_pcm, reference)  # libsndfile reads the unknown sizes to the end
        pcm, rate, demuxer = decode_all(data)
        assert demuxer == {"wav": "wav", "opus": "ogg", "flac": "flac", "mp3": "mp3", "aac": "aac"}[fmt]
        assert ctype == {"wav": "audio/wav", "opus": "audio/ogg", "flac": "audio/flac", "mp3": "audio/mpeg", "aac": "audio/aac"}[fmt]
        assert rate == (48_000 if fmt == "opus" else 24_000)  # Ogg Opus always decodes at 48 kHz
        assert abs(pcm.size / rate - seconds) <= 0.08  # mp3/aac add their encoder delay
        assert abs(peak_hz(pcm, rate) - speech_hz(TEXT)) < 5
        if fmt in ("wav", "flac"):  # lossless
            assert np.array_equal(pcm, reference)

    run(main)


def _dominant_hz(pcm: np.ndarray, rate_hz: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm.astype(np.float64) * np.hanning(pcm.size)))
    return float(np.argmax(spectrum)) * rate_hz / pcm.size


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 4.0])
def test_speech_speed_is_a_time_stretch_that_keeps_the_pitch_and_instructions_are_a_hint(speed):
    async def main():
        engine = FakeEngine(oneshot_step_s=0)
        async with gateway(engine) as gw:
            async with sdk(gw).audio.speech.with_streaming_response.create(
                    model="gpt-4o-mini-tts", input=TEXT, voice="alloy", response_format="pcm", speed=speed,
                    instructions="Speak in a cheerful and positive tone.") as resp:
                assert resp.status_code == 200
                data = b"".join([piece async for piece in resp.iter_bytes()])
        assert engine.syntheses[-1].status == "completed"
        out, reference = np.frombuffer(data, "<i2"), _reference_24k(TEXT)
        expected = reference.size / speed
        assert abs(out.size - expected) <= max(0.03 * expected, 0.05 * 24_000)  # atempo's last window: within 50 ms
        assert abs(_dominant_hz(out, 24_000) - speech_hz(TEXT)) < 5.0  # the pitch is the model's (a resampler would move it)

    run(main)


def test_speech_streams_its_first_bytes_before_the_engine_has_finished_and_a_client_that_leaves_stops_it():
    async def main():
        engine = FakeEngine(oneshot_step_s=0.05)  # 1.5 s of speech in 19 chunks over ~1 s
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with gateway(engine) as gw:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10) as http:
                req = {"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "pcm"}
                async with http.stream("POST", "/v1/audio/speech", json=req, headers=auth) as resp:
                    assert resp.status_code == 200
                    pieces = resp.aiter_raw()
                    got = len(await anext(pieces))
                    shot = engine.syntheses[-1]
                    assert shot.status == "running" and 1 <= shot.delivered < shot.total  # generation is still going
                    while shot.delivered < 4:
                        got += len(await anext(pieces))
                # the client left in the middle: the server closes the engine's iterator, the engine cancels
                for _ in range(100):
                    if shot.status != "running":
                        break
                    await asyncio.sleep(0.02)
                assert shot.status == "cancelled" and shot.delivered < shot.total and 0 < got < 2 * 24_000 * 1.5
                # a transcript stream: its first event leaves while the engine still transcribes
                pcm = tone(440, 1.5, 16_000)
                files = {"file": ("a.wav", wav_file(pcm, 16_000), "audio/wav")}
                async with http.stream("POST", "/v1/audio/transcriptions", data={"model": "x", "stream": "true"}, files=files,
                                       headers=auth) as resp:
                    assert resp.headers["content-type"] == "text/event-stream"
                    events = [json.loads(ln[6:]) async for ln in _first_then_rest(resp.aiter_lines(), engine) if ln.startswith("data: ")]
                assert events[0]["type"] == "transcript.text.delta"
                assert events[-1] == {"type": "transcript.text.done", "text": fake_transcript(pcm)}
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_audio_api_requests_total", {"endpoint": "speech", "outcome": "client_gone"}) == 1
            assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": "ok"}) == 1
            assert m("duplex_audio_api_requests_running") == 0 and engine.oneshots_running == 0

    run(main)


async def _first_then_rest(lines, engine: FakeEngine):
    """The SSE lines; when the first event arrives, the engine is still transcribing."""
    first = True
    async for line in lines:
        if first and line.startswith("data: "):
            assert engine.transcriptions[-1].status == "running" and engine.transcriptions[-1].delivered < engine.transcriptions[-1].total
            first = False
        yield line


def test_named_voices_as_in_sessions(tmp_path):
    narrator = tone(220, 0.5, 16_000)

    async def main():
        engine = FakeEngine(oneshot_step_s=0)
        async with gateway(engine, voices={"narrator": narrator}) as gw:
            client = sdk(gw)
            for voice, expected in (("narrator", narrator), ({"id": "narrator"}, narrator), ("alloy", None), ("default", None)):
                async with client.audio.speech.with_streaming_response.create(model="x", input="Hi.", voice=voice,
                                                                              response_format="pcm") as resp:
                    await resp.read()
                got = engine.syntheses[-1].options.speaker_prompt_pcm
                assert (got is None) if expected is None else np.array_equal(got, expected)
            status, err, _ = await refusal(client.audio.speech.create(model="x", input="Hi.", voice={"id": "voice_1234"}))
            assert status == 400 and err["param"] == "voice" and "narrator" in err["message"]

    run(main)


# ---- refusals ----

def test_engine_refusals_and_the_concurrency_bound():
    async def main():
        engine = FakeEngine(oneshot_step_s=0.05)
        upload = ("a.wav", wav_file(tone(440, 1.0, 16_000), 16_000))
        config = {"audio_api": {"max_concurrent": 1}, "limits": {"retry_after_s": 7}}
        async with gateway(engine, config) as gw:
            client = sdk(gw)
            async with client.audio.speech.with_streaming_response.create(model="x", input=TEXT, voice="alloy") as busy:
                status, err, headers = await refusal(client.audio.transcriptions.create(model="x", file=upload))
                assert (status, err["code"], headers["retry-after"]) == (429, "rate_limit_exceeded", "7")
                assert "audio_api.max_concurrent" in err["message"]
                mp3, rate, _ = decode_all(await busy.read())  # the running request went on (mp3: OpenAI's default format)
                assert abs(mp3.size / rate - speech_ms(TEXT) / 1000) <= 0.08
            engine.oneshot_capacity = 0  # the engine itself is full
            status, err, headers = await refusal(client.audio.transcriptions.create(model="x", file=upload))
            assert (status, err["code"], headers["retry-after"]) == (503, "server_at_capacity", "7")
            assert "try again in 7 s" in err["message"] and engine.transcriptions[-1].status == "refused"
            engine.oneshot_capacity, engine.text_model = None, False
            for call in (client.audio.transcriptions.create(model="x", file=upload),
                         client.audio.speech.create(model="x", input=TEXT, voice="alloy")):
                status, err, _ = await refusal(call)
                assert (status, err["code"]) == (400, "model_has_no_text")
            engine.text_model, engine.oneshot_fail_after = True, 0  # fails before its first delta: still a status code
            status, err, _ = await refusal(client.audio.transcriptions.create(model="x", file=upload))
            assert (status, err["code"], err["type"]) == (500, "engine_error", "server_error")
            m = gw.metrics.registry.get_sample_value
            for outcome, n in (("busy", 1), ("at_capacity", 1), ("no_text_model", 1), ("engine_error", 1)):
                assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": outcome}) == n, outcome
            assert gw.transports["audio_api"].running == 0

    run(main)


def test_an_engine_failure_midway_ends_the_stream():
    async def main():
        engine = FakeEngine(oneshot_step_s=0, oneshot_fail_after=3)
        async with gateway(engine) as gw:
            client = sdk(gw)
            upload = ("a.wav", wav_file(tone(440, 1.0, 16_000), 16_000))
            seen = []
            with pytest.raises(openai.APIError) as e:  # SSE: an error event after the deltas sent
                async for ev in await client.audio.transcriptions.create(model="x", file=upload, stream=True):
                    seen.append(ev.delta)
            assert seen == ["i", " heard", " 1000"] and e.value.body["code"] == "engine_error"
            status, err, _ = await refusal(client.audio.transcriptions.create(model="x", file=upload))  # not streamed: a 500
            assert (status, err["code"]) == (500, "engine_error")
            # audio: the reply is cut, without the last chunk, so the client knows it is incomplete
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10) as http:
                req = {"model": "x", "input": TEXT, "voice": "alloy", "response_format": "pcm"}
                with pytest.raises(httpx.RemoteProtocolError):
                    await http.post("/v1/audio/speech", json=req, headers={"Authorization": f"Bearer {TOKEN}"})
            assert engine.syntheses[-1].status == "failed" and engine.syntheses[-1].delivered == 3
            assert gw.metrics.registry.get_sample_value("duplex_audio_api_requests_total",
                                                        {"endpoint": "speech", "outcome": "engine_error"}) == 1

    run(main)


async def _bad_requests(gw: Gateway) -> dict[str, tuple[int, dict]]:
    """Every refusal the endpoints make for a bad request: name -> (status, error object)."""
    client, out = sdk(gw), {}
    good = wav_file(tone(440, 1.0, 16_000), 16_000)

    async def sdk_call(name, call):
        status, err, _ = await refusal(call)
        out[name] = (status, err)

    t, s = client.audio.transcriptions, client.audio.speech
    await sdk_call("not audio", t.create(model="x", file=("notes.txt", b"these are my meeting notes, not audio\n" * 20)))
    await sdk_call("empty file", t.create(model="x", file=("a.wav", b"")))
    await sdk_call("no samples", t.create(model="x", file=("a.wav", wav_file(np.zeros(0, np.int16), 16_000))))
    await sdk_call("too long", t.create(model="x", file=("a.wav", wav_file(tone(440, 3.0, 16_000), 16_000))))
    await sdk_call("too big", t.create(model="x", file=("a.wav", wav_file(tone(440, 40.0, 16_000), 16_000))))  # 1.28 MB
    await sdk_call("srt", t.create(model="x", file=("a.wav", good), response_format="srt"))
    await sdk_call("unknown format", t.create(model="x", file=("a.wav", good), response_format="yaml"))  # type: ignore[arg-type]
    await sdk_call("timestamps", t.create(model="x", file=("a.wav", good), response_format="verbose_json",
                                          timestamp_granularities=["word", "segment"]))
    await sdk_call("temperature", t.create(model="x", file=("a.wav", good), temperature=1.5))
    await sdk_call("unauthorized", sdk(gw, "wrong-token").audio.transcriptions.create(model="x", file=("a.wav", good)))
    await sdk_call("speech unauthorized", sdk(gw, "wrong-token").audio.speech.create(model="x", input="Hi.", voice="alloy"))
    await sdk_call("speed", s.create(model="x", input="Hi.", voice="alloy", speed=5.0))
    await sdk_call("sse", s.create(model="x", input="Hi.", voice="alloy", stream_format="sse"))
    await sdk_call("instructions", s.create(model="x", input="Hi.", voice="alloy", instructions=["Whisper."]))  # type: ignore[arg-type]
    await sdk_call("input too long", s.create(model="x", input="a" * 101, voice="alloy"))
    await sdk_call("empty input", s.create(model="x", input="", voice="alloy"))
    await sdk_call("speech format", s.create(model="x", input="Hi.", voice="alloy", response_format="ogg"))  # type: ignore[arg-type]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10,
                                 headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for name, path, kwargs in (
            ("transcription as json", "/v1/audio/transcriptions", {"json": {"model": "x", "file": "a.wav"}}),
            ("missing file", "/v1/audio/transcriptions", {"files": {"model": (None, "x"), "response_format": (None, "json")}}),
            ("speech as a form", "/v1/audio/speech", {"data": {"model": "x", "input": "Hi.", "voice": "alloy"}}),
            ("speech not json", "/v1/audio/speech", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}),
            ("speech with a lone surrogate", "/v1/audio/speech",  # valid JSON, not valid Unicode
             {"content": b'{"model": "x", "input": "Hi \\ud800", "voice": "alloy"}', "headers": {"Content-Type": "application/json"}}),
        ):
            r = await http.post(path, **kwargs)
            out[name] = (r.status_code, r.json()["error"])
    return out


EXPECTED_REFUSALS = {  # name: (status, code, param)
    "not audio": (400, "invalid_file_format", "file"),
    "empty file": (400, "empty_file", "file"),
    "no samples": (400, "audio_too_short", "file"),
    "too long": (400, "audio_too_long", "file"),
    "too big": (413, "request_too_large", None),
    "srt": (400, "unsupported_value", "response_format"),
    "unknown format": (400, "invalid_value", "response_format"),
    "timestamps": (400, "unsupported_parameter", "timestamp_granularities[]"),
    "temperature": (400, "invalid_value", "temperature"),
    "unauthorized": (401, "invalid_api_key", None),
    "speech unauthorized": (401, "invalid_api_key", None),
    "speed": (400, "invalid_value", "speed"),
    "sse": (400, "unsupported_value", "stream_format"),
    "instructions": (400, "invalid_type", "instructions"),
    "input too long": (400, "string_above_max_length", "input"),
    "empty input": (400, "invalid_value", "input"),
    "speech format": (400, "invalid_value", "response_format"),
    "transcription as json": (415, "unsupported_media_type", None),
    "missing file": (400, "missing_required_parameter", "file"),
    "speech as a form": (415, "unsupported_media_type", None),
    "speech not json": (400, "invalid_json", None),
    "speech with a lone surrogate": (400, "invalid_json", None),
}


def test_bad_requests_are_openai_errors_while_a_live_session_keeps_its_audio():
    async def main():
        engine = FakeEngine(answer_ms=3000, chunk_ms=80)
        config = {"vad": {"enabled": False}, "audio_api": {"max_upload_mb": 1, "max_duration_s": 2, "max_input_chars": 100}}
        async with gateway(engine, config) as gw:
            ws = await websockets.connect(f"ws://127.0.0.1:{gw.port}/v1/realtime", additional_headers={"Authorization": f"Bearer {TOKEN}"})
            assert json.loads(await ws.recv())["type"] == "session.created"
            audio = base64.b64encode(np.zeros(4800, "<i2").tobytes()).decode()
            for event in ({"type": "input_audio_buffer.append", "audio": audio}, {"type": "input_audio_buffer.commit"},
                          {"type": "response.create"}):
                await ws.send(json.dumps(event))
            deltas: list[tuple[float, int]] = []  # (time received, audio bytes)
            first_delta = asyncio.Event()

            async def listen() -> str:
                async for message in ws:
                    ev = json.loads(message)
                    if ev["type"] == "response.output_audio.delta":
                        deltas.append((time.monotonic(), len(base64.b64decode(ev["delta"]))))
                        first_delta.set()
                    elif ev["type"] == "response.done":
                        return ev["response"]["status"]
                return "closed"

            listener = asyncio.create_task(listen())
            await first_delta.wait()
            started = time.monotonic()
            refusals = await _bad_requests(gw)
            ended = time.monotonic()
            status = await listener
            await ws.close()
            for name, (code_status, code, param) in EXPECTED_REFUSALS.items():
                got_status, err = refusals[name]
                assert (got_status, err["code"], err.get("param")) == (code_status, code, param), (name, err)
                assert err["message"] and err["type"] == ("invalid_request_error" if got_status < 500 else "server_error")
            # the session was answered in full, its audio flowing while the bad requests were refused
            assert status == "completed" and sum(n for _, n in deltas) == 3 * 24_000 * 2
            assert any(started < t < ended for t, _ in deltas) and deltas[-1][0] > started
            assert gw.transports["audio_api"].running == 0 and engine.transcriptions == [] and engine.syntheses == []
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": "too_large"}) == 1
            assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": "unauthorized"}) == 1
            assert m("duplex_auth_failures_total", {"endpoint": "/v1/audio/speech"}) == 1

    run(main)


def test_the_upload_limit_is_the_transcription_routes_only_and_needs_the_token():
    async def raw(port: int, head: str, body: bytes = b"", expect_continue: bool = False) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head.encode() + b"\r\n")
        if expect_continue:  # Expect: 100-continue: the body goes once the server says it fits
            line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert line == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return data

    def head(path: str, n: int, *extra: str, token: str = TOKEN) -> str:
        lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Authorization: Bearer {token}", f"Content-Length: {n}", *extra]
        return "".join(f"{ln}\r\n" for ln in lines)

    def error(reply: bytes) -> tuple[bytes, str]:
        status_line, _, rest = reply.partition(b"\r\n")
        return status_line, json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"]

    form = "Content-Type: multipart/form-data; boundary=b"
    pcm = tone(440, 40.0, 16_000)  # 1.28 MB of WAV: over the 256 KiB of any other route, under 2 MiB
    body = b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n\r\n' + wav_file(pcm, 16_000) + b"\r\n--b--\r\n"

    async def main():
        async with gateway(FakeEngine(oneshot_step_s=0), {"audio_api": {"max_upload_mb": 2}}) as gw:
            reply = await raw(gw.port, head("/v1/realtime/calls", len(body), "Content-Type: application/sdp"), body)
            assert error(reply) == (b"HTTP/1.1 413 Request Entity Too Large", "request_too_large")
            reply = await raw(gw.port, head("/v1/audio/transcriptions", len(body), form, token="nope"), body)
            assert error(reply) == (b"HTTP/1.1 401 Unauthorized", "invalid_api_key")  # refused before the body is read
            reply = await raw(gw.port, head("/v1/audio/transcriptions", 3 << 20, form), b"x" * (3 << 20))
            assert error(reply) == (b"HTTP/1.1 413 Request Entity Too Large", "request_too_large")
            reply = await raw(gw.port, head("/v1/audio/transcriptions", len(body), form, "Expect: 100-continue", "Connection: close"), body, True)
            assert reply.startswith(b"HTTP/1.1 200 OK") and json.loads(reply.partition(b"\r\n\r\n")[2])["text"] == fake_transcript(pcm)
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": "too_large"}) == 1
            assert m("duplex_auth_failures_total", {"endpoint": "/v1/audio/transcriptions"}) == 1

    run(main)


def test_the_endpoints_can_be_switched_off_and_their_config_is_checked():
    async def main():
        async with gateway(config={"audio_api": {"enabled": False}}) as gw:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10) as http:
                r = await http.post("/v1/audio/speech", json={"input": "Hi.", "voice": "alloy"}, headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 404 and gw.transports["audio_api"] is None

    run(main)
    for key, value in (("max_concurrent", 0), ("max_upload_mb", 0), ("max_duration_s", -1), ("enabled", "yes")):
        with pytest.raises(ValueError, match=f"'audio_api.{key}'"):
            config_from_dict({"audio_api": {key: value}})


# ---- the streamed reply's writer (realtime/web_shell.py), on a route of the test's own ----

def test_the_stream_writer_frames_chunks_and_ends_a_failed_or_stalled_body_without_the_last_chunk():
    from http import HTTPStatus

    from realtime.http import HttpRoute, HttpStream, Scope

    closed: list[str] = []

    async def body(name: str, pieces: list[bytes], fail: bool = False):
        try:
            for p in pieces:
                yield p
            if fail:
                raise RuntimeError("the engine died")
        finally:
            closed.append(name)

    big = b"z" * (1 << 20)
    streams = {"ok": lambda: HttpStream(HTTPStatus.OK, body("ok", [b"abc", b"", b"0123456789abcdef"]), "audio/wav", {"X-A": "1"}),
               "fail": lambda: HttpStream(HTTPStatus.OK, body("fail", [b"abc"], fail=True), "audio/wav"),
               "stall": lambda: HttpStream(HTTPStatus.OK, body("stall", [big] * 64), "audio/wav", stall_timeout_s=0.3)}

    async def reply_of(port: int, name: str, read: bool = True) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET /test/{name} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        if not read:  # a client that reads nothing: the server's buffers fill, the writer stalls
            await asyncio.sleep(2.0)
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return data

    async def main():
        async with gateway(FakeEngine()) as gw:
            for name, make in streams.items():
                async def handler(req, make=make):
                    return make()
                gw.routes.http[f"/test/{name}"] = HttpRoute(handler, methods=("GET",), scope=Scope.PUBLIC, bounded=False)
            head, _, rest = (await reply_of(gw.port, "ok")).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nX-A: 1" in head
            assert b"Transfer-Encoding: chunked" in head and b"Content-Type: audio/wav" in head
            assert rest == b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"
            head, _, rest = (await reply_of(gw.port, "fail")).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and rest == b"3\r\nabc\r\n"  # cut: no last chunk
            data = await reply_of(gw.port, "stall", read=False)
            assert not data.endswith(b"0\r\n\r\n") and len(data) < 64 * len(big)  # dropped before the body was pulled whole
            await asyncio.sleep(0.1)
            assert sorted(closed) == ["fail", "ok", "stall"]  # each body's iterator closed, however its reply ended

    run(main)


def test_a_stop_cuts_the_streams_in_progress_and_their_engine_requests():
    async def main():
        engine = FakeEngine(oneshot_step_s=0.05)
        gw = Gateway(engine, config_from_dict({"server": {"port": 0}}), token=TOKEN)
        await gw.start()
        stopped = False
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gw.port}", timeout=10) as http:
                req = {"model": "x", "input": TEXT, "voice": "alloy", "response_format": "pcm"}
                async with http.stream("POST", "/v1/audio/speech", json=req, headers={"Authorization": f"Bearer {TOKEN}"}) as resp:
                    pieces = resp.aiter_raw()
                    await anext(pieces)
                    await gw.stop()
                    stopped = True
                    with pytest.raises(httpx.RemoteProtocolError):  # cut: no last chunk
                        async for _ in pieces:
                            pass
            assert engine.syntheses[-1].status == "cancelled" and engine.oneshots_running == 0
        finally:
            if not stopped:
                await gw.stop()

    run(main)


def test_a_slow_request_head_is_cut_and_a_slow_upload_refused():
    """A head must arrive within limits.open_timeout_s (else the connection is closed, counted as an
    incomplete handshake); an upload's body by its route's own, longer deadline (else 408)."""
    async def reply_after(port: int, parts: list[bytes], pause_s: float) -> tuple[bytes, float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        t0 = time.monotonic()
        for part in parts:
            writer.write(part)
            await asyncio.sleep(pause_s)
            if reader.at_eof() or reader._buffer:  # (peeking: the server answered or closed)
                break
        data = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        return data, time.monotonic() - t0

    async def main():
        config = {"limits": {"open_timeout_s": 0.5}, "audio_api": {"upload_timeout_s": 1.5}}
        async with gateway(FakeEngine(), config) as gw:
            slow_head = [b"GET /v1/realtime HTTP/1.1\r\n"] + [b"X-Slow: 1\r\n"] * 40
            data, took_s = await reply_after(gw.port, slow_head, 0.1)
            assert data == b"" and 0.5 <= took_s < 4  # closed, no reply
            upload = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                      "Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 100000\r\n\r\n").encode()
            data, took_s = await reply_after(gw.port, [upload] + [b"x" * 1000] * 40, 0.1)
            assert data.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in data and 1.5 <= took_s < 5  # its own deadline
            assert gw.metrics.registry.get_sample_value("duplex_handshakes_incomplete_total") == 1
            m = gw.metrics.registry.get_sample_value
            assert m("duplex_audio_api_requests_total", {"endpoint": "transcriptions", "outcome": "too_slow"}) == 1

    run(main)
