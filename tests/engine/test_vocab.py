from __future__ import annotations

import numpy as np
import pytest

from engine import vocab


def test_layout_offsets() -> None:
    assert vocab.stream_range(0) == (256, 5256)
    assert vocab.stream_range(1) == (5256, 6280)
    assert vocab.stream_range(8) == (5256 + 7 * 1024, 13448)
    assert vocab.TEXT_OFFSET == 13448
    with pytest.raises(ValueError):
        vocab.stream_range(9)


def test_code_roundtrip() -> None:
    rng = np.random.default_rng(0)
    ssl = rng.integers(0, vocab.SSL_SIZE, 50)
    dac = rng.integers(0, vocab.CODEBOOK_SIZE, (50, 8))
    frames = vocab.frames_to_global(ssl, dac)
    assert vocab.in_stream_range(frames).all()
    np.testing.assert_array_equal(vocab.global_to_ssl(frames[:, 0]), ssl)
    np.testing.assert_array_equal(vocab.global_to_dac(frames[:, 1:]), dac)
    # a code of codebook 0 placed on stream 2 is out of range
    bad = frames.copy()
    bad[0, 2] = frames[0, 1]
    assert not vocab.in_stream_range(bad)[0, 2]


def test_layout_validation() -> None:
    vocab.VocabLayout(text_size=10, vocab_size=vocab.TEXT_OFFSET + 80)
    with pytest.raises(ValueError):
        vocab.VocabLayout(text_size=100, vocab_size=vocab.TEXT_OFFSET + 10)
