import asyncio

import numpy as np
import pytest

from engine.codec.dac import DAC
from engine.codec.stage import AsyncChunkQueue, CodecStage, PcmChunk
from engine.codec.streaming import StreamConfig, decode_streamed, snr_db
from engine.vocab import CODEBOOK_SIZE, NUM_CODEBOOKS, frames_to_global


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def _frames(codes: np.ndarray) -> np.ndarray:
    return frames_to_global(np.zeros(len(codes), dtype=np.int64), codes)


def test_earliest_deadlines_go_first(dac: DAC, speech_codes: np.ndarray) -> None:
    clock = FakeClock()
    stage = CodecStage(dac, StreamConfig(), max_batch=2, clock=clock)
    got: list[PcmChunk] = []
    # five sessions, opened in an order unrelated to their deadlines
    deadlines = {"a": 100.30, "b": 100.05, "c": 100.20, "d": 100.10, "e": 100.50}
    for sid, deadline in deadlines.items():
        stage.open(sid, got.append, first_deadline_s=deadline)
        stage.push(sid, _frames(speech_codes[:40]))
    clock.now_s = 100.15
    first = stage.tick()
    assert [c.session_id for c in first] == ["b", "d"]
    assert [round(c.lateness_s, 3) for c in first] == [0.10, 0.05]
    # playback of b and d started when their first chunks arrived (100.15), so their second
    # chunks (4 frames, 80 ms later) are due at 100.23: after c's first (100.20), b before d
    assert [c.session_id for c in stage.tick()] == ["c", "b"]
    # c's second is due at 100.23 too (its first went out at 100.15), b's third (after 8 frames
    # of audio) at 100.31, a's first at 100.30
    assert [c.session_id for c in stage.tick()] == ["c", "d"]
    assert stage.stats.late_chunks == 2 and stage.stats.batch_sizes[2] == 3
    assert len(got) == 6


def test_playback_starts_when_the_first_chunk_is_delivered(dac: DAC, speech_codes: np.ndarray) -> None:
    clock = FakeClock()
    stage = CodecStage(dac, StreamConfig(), max_batch=1, clock=clock)
    got: list[PcmChunk] = []
    stage.open("early", got.append, first_deadline_s=100.50)
    stage.push("early", _frames(speech_codes[:40]))
    clock.now_s = 100.10
    (first,) = stage.tick()  # decoded 400 ms inside its budget: the client starts playing now
    assert first.session_id == "early" and first.lateness_s == pytest.approx(-0.40)
    stage.open("other", got.append, first_deadline_s=100.20)
    stage.push("other", _frames(speech_codes[:40]))
    # early's next chunk is due when its 80 ms first chunk has played (100.18), not at 100.58
    (second,) = stage.tick()
    assert second.session_id == "early" and second.deadline_s == pytest.approx(100.18)
    assert [c.session_id for c in stage.tick()] == ["other"]


def test_push_rejects_bad_frames(dac: DAC) -> None:
    stage = CodecStage(dac)
    stage.open("s", lambda c: None)
    with pytest.raises(ValueError, match="range"):
        stage.push("s", frames_to_global(np.zeros(2, np.int64), np.full((2, NUM_CODEBOOKS), CODEBOOK_SIZE)))
    with pytest.raises(ValueError, match=r"\[T, 9\]"):
        stage.push("s", np.zeros((3, 8), np.int64))
    with pytest.raises(ValueError, match="unknown session"):
        stage.push("nope", _frames(np.zeros((1, NUM_CODEBOOKS), np.int64)))


def test_threaded_stage_feeds_asyncio(dac: DAC, speech_codes: np.ndarray) -> None:
    stage = CodecStage(dac, StreamConfig(), max_batch=4)

    async def main() -> dict[str, np.ndarray]:
        stage.start()
        try:
            queues = {sid: AsyncChunkQueue() for sid in ("x", "y")}
            for sid, q in queues.items():
                stage.open(sid, q)
            for t in range(0, len(speech_codes), 5):  # frames arrive as the LM makes them
                for sid in queues:
                    stage.push(sid, _frames(speech_codes[t : t + 5]))
                await asyncio.sleep(0)
            for sid in queues:
                stage.finish(sid)
            out = {}
            for sid, q in queues.items():
                chunks = [c async for c in q]
                assert chunks[-1].is_last and chunks[0].start_sample == 0
                out[sid] = np.concatenate([c.pcm for c in chunks])
            return out
        finally:
            stage.stop()

    out = asyncio.run(asyncio.wait_for(main(), timeout=60))
    expected = decode_streamed(dac, speech_codes)
    for pcm in out.values():
        assert pcm.shape == expected.shape
        assert snr_db(expected, pcm) >= 60.0  # frames arrive in other bursts than in `expected`
