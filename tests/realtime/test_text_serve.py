"""Text through `duplex serve` on the real engine (tiny model, CPU): the official openai SDK's
audio.transcriptions.create (json and streamed) and audio.speech (streamed), served by the engine's
one-shot ASR and TTS (engine/oneshot.py). The gateway's own logic is tested on the fake engine
(test_audio_api.py); here it is the whole path, with a real tokenizer, vLLM and codec."""

from __future__ import annotations

import io
import wave

import av
import numpy as np
import openai
import pytest
from openai import OpenAI

from engine.codec.synth import speech_like
from realtime.soak.server_process import ServerProcess

pytestmark = pytest.mark.vllm

TOKEN = "text-serve-token"


@pytest.fixture(scope="module")
def server(tiny_model):
    srv = ServerProcess({"session": {"temperature": 0.0}}, TOKEN)
    yield srv
    assert srv.stop() == 0, srv.log_tail()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(api_key=TOKEN, base_url=f"{server.base}/v1", max_retries=0, timeout=120)


def wav_bytes(seconds: float, seed: int) -> bytes:
    pcm = (speech_like(seconds, seed=seed) * 20000).astype(np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    return buf.getvalue()


def test_transcription_json_and_streamed_agree(client) -> None:
    audio = wav_bytes(1.5, seed=1)
    whole = client.audio.transcriptions.create(model="opuslm", file=("clip.wav", audio, "audio/wav"))
    assert isinstance(whole.text, str) and whole.text
    events = list(client.audio.transcriptions.create(model="opuslm", file=("clip.wav", audio, "audio/wav"), stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    done = [e for e in events if e.type == "transcript.text.done"]
    assert len(deltas) > 1 and len(done) == 1
    assert "".join(deltas) == done[0].text == whole.text  # greedy by default: the same transcript


def test_speech_streams_audio_and_bad_uploads_are_refused(client) -> None:
    with client.audio.speech.with_streaming_response.create(model="opuslm", voice="alloy", input="Hello there.",
                                                            response_format="wav") as resp:
        data = b"".join(resp.iter_bytes())
    container = av.open(io.BytesIO(data))
    samples = sum(f.samples for f in container.decode(audio=0))
    assert container.streams.audio[0].rate == 24000 and 0 < samples <= 30 * 24000
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.transcriptions.create(model="opuslm", file=("notes.wav", b"not audio at all", "audio/wav"))
    assert e.value.status_code == 400
    assert client.audio.transcriptions.create(model="opuslm", file=("clip.wav", wav_bytes(0.5, 2), "audio/wav")).text
