"""The text tokenizer: the backbone's HF tokenizer with every id shifted by `vocab.TEXT_OFFSET`.

OpusLM keeps text in stream 0 at global ids `TEXT_OFFSET + tokenizer id` (ESPnet's
`token_bias.text_bpe`). The converter copies the tokenizer files into `MODEL_DIR/tokenizer/`
(engine/convert/espnet.py); the tiny model has a byte-level BPE trained on a small text in the repository
(engine/tiny_text.py). Text is encoded without the tokenizer's own
special tokens (no BOS/EOS): OpusLM's segment markers are its own ids (engine/vocab.py), added by
whoever lays out the prompt. Used for system prompts, user/assistant text segments and
transcript deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine import checkpoint, vocab

TOKENIZER_SUBDIR = "tokenizer"
TOKENIZER_FILE = "tokenizer.json"
_RELEASE_GIL_CHARS = 4096  # longer text is tokenized with the GIL released (about 1.5 ms of work from here on)


class NoTextTokenizerError(FileNotFoundError):
    """The checkpoint carries no text tokenizer (e.g. one converted without its tokenizer files)."""


class TextTokenizer:
    def __init__(self, tokenizer, text_size: int) -> None:
        """`tokenizer`: a `tokenizers.Tokenizer`; `text_size`: the model's text range."""
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        if size > text_size:
            raise ValueError(f"tokenizer has {size} ids, the model's text range only {text_size}")
        self._tok = tokenizer
        self.text_size = text_size

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "TextTokenizer":
        """Load `model_dir/tokenizer/tokenizer.json`; the text range comes from config.json."""
        from tokenizers import Tokenizer

        path = Path(model_dir) / TOKENIZER_SUBDIR / TOKENIZER_FILE
        if not path.is_file():
            raise NoTextTokenizerError(
                f"this model has no text tokenizer ({path} does not exist); convert a real "
                "checkpoint with its tokenizer available (`duplex convert espnet`)"
            )
        cfg = checkpoint.load_config(model_dir)
        return cls(Tokenizer.from_file(str(path)), cfg.text_size)

    @property
    def text_end(self) -> int:
        return vocab.TEXT_OFFSET + self.text_size

    def encode(self, text: str) -> np.ndarray:
        """Text -> global ids (int64), no special tokens added. Safe to run in a thread beside the event
        loop (`_ids`)."""
        return np.asarray(self._ids(text), dtype=np.int64) + vocab.TEXT_OFFSET

    def count(self, text: str) -> int:
        """`len(encode(text))`."""
        return len(self._ids(text))

    def _ids(self, text: str) -> list[int]:
        # `Tokenizer.encode` holds the GIL throughout (1.2 s for 1.9 MB of text: the event loop stalls even
        # when it runs in a worker thread); `encode_batch` releases it while it works, with the same ids.
        # Short text takes `encode`: encode_batch marks the tokenizer's thread pool used, and a process that
        # forks after that gets the tokenizers library's warning in every child.
        if len(text) < _RELEASE_GIL_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Global text ids -> text. An id outside the text range raises ValueError."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = arr[(arr < vocab.TEXT_OFFSET) | (arr >= self.text_end)]
        if len(bad):
            raise ValueError(f"id {int(bad[0])} is not a text id [{vocab.TEXT_OFFSET}, {self.text_end})")
        return self._tok.decode((arr - vocab.TEXT_OFFSET).tolist(), skip_special_tokens=skip_special_tokens)

    def is_text(self, ids: np.ndarray) -> np.ndarray:
        """Boolean mask: which global ids are text ids."""
        ids = np.asarray(ids)
        return (ids >= vocab.TEXT_OFFSET) & (ids < self.text_end)


class TextDeltas:
    """Text ids arriving one by one -> the text they add, as it becomes final.

    A byte-level BPE token may hold part of a UTF-8 character, which decodes to U+FFFD until the
    rest arrives; such a tail is held back, so the deltas concatenate to `decode(all ids)`.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self.text = ""  # emitted so far

    def push(self, ids: Sequence[int]) -> str:
        if not len(ids):
            return ""
        self.ids.extend(int(i) for i in ids)
        full = self._tok.decode(self.ids)
        stable = full.rstrip("\ufffd")
        return self._take(stable)

    def flush(self) -> str:
        return self._take(self._tok.decode(self.ids) if self.ids else "")

    def _take(self, upto: str) -> str:
        if not upto.startswith(self.text):  # a merge changed earlier text (not for byte-level BPE): emit nothing
            return ""
        delta, self.text = upto[len(self.text):], upto
        return delta
