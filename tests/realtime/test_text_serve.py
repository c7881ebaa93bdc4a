"""Text through `duplex serve` on the real engine (tiny model, CPU): the official openai SDK's
audio.transcriptions.create (json and streamed) and audio.speech (streamed), served by the engine's
one-shot ASR and TTS (engine/oneshot.py); its realtime client's input transcription, text-only
answers and a typed turn. The gateway's own logic is tested on the fake engine
(test_audio_api.py); here it is the whole path, with a real tokenizer, vLLM and codec."""

from __future__ import annotations

import asyncio
import base64
import io
import wave

import av
import numpy as np
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from engine.codec.synth import speech_like
from realtime.soak.server_process import ServerProcess
from rt_helpers import sdk_until

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


def _pcm24(seconds: float, seed: int) -> str:
    """Speech-like audio as the realtime API takes it: base64 PCM16 at 24 kHz."""
    from realtime.audio import StreamResampler

    pcm = (speech_like(seconds, seed=seed) * 20000).astype(np.int16)
    up = StreamResampler(16000, 24000)
    return base64.b64encode(np.concatenate([up.process(pcm), up.flush()]).astype(np.int16).tobytes()).decode()




def test_realtime_transcription_text_answers_and_a_typed_turn(server) -> None:
    async def main():
        client = AsyncOpenAI(api_key=TOKEN, websocket_base_url=server.base.replace("http", "ws", 1) + "/v1")
        seen: list = []
        async with client.realtime.connect(model="opuslm") as conn:
            await sdk_until(conn, "session.created", seen)
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"], "audio": {"input": {
                "transcription": {"model": "opuslm"}, "turn_detection": None}}})
            await sdk_until(conn, "session.updated", seen)
            await conn.input_audio_buffer.append(audio=_pcm24(0.8, seed=3))
            await conn.input_audio_buffer.commit()
            committed = await sdk_until(conn, "input_audio_buffer.committed", seen)
            await conn.response.create()
            first = await sdk_until(conn, "response.done", seen)
            if not any(ev.type == "conversation.item.input_audio_transcription.completed" for ev in seen):
                await sdk_until(conn, "conversation.item.input_audio_transcription.completed", seen)
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "And what about tomorrow?"}]})
            await conn.response.create()
            second = await sdk_until(conn, "response.done", seen)
        return seen, committed, first, second

    seen, committed, first, second = asyncio.run(asyncio.wait_for(main(), 180))
    assert [ev for ev in seen if ev.type == "error"] == []
    deltas = [ev for ev in seen if ev.type == "conversation.item.input_audio_transcription.delta"]
    completed = [ev for ev in seen if ev.type == "conversation.item.input_audio_transcription.completed"]
    assert len(completed) == 1 and completed[0].item_id == committed.item_id and completed[0].transcript
    assert "".join(d.delta for d in deltas) == completed[0].transcript
    for done in (first, second):  # text-only answers from the model, no audio
        assert done.response.status == "completed" and done.response.output[0].content[0].type == "output_text"
        text = "".join(ev.delta for ev in seen if ev.type == "response.output_text.delta" and ev.response_id == done.response.id)
        assert text and text == done.response.output[0].content[0].text
    assert not any(ev.type.startswith("response.output_audio") for ev in seen)
