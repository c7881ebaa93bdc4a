"""The tiny model's text tokenizer: a byte-level BPE trained, deterministically, on the repository's
own `tiny_corpus.txt` (self-written English) when the tiny model is built, and written as
`MODEL_DIR/tokenizer/tokenizer.json`, the file converted real checkpoints carry (engine/text.py). Every
text path (system prompts, text segments, transcripts) then runs end to end on the tiny model with
nothing downloaded. Its ids fit the tiny model's text range (`vocab_size` = the range: 256 byte symbols
and the merges learnt on the corpus, in the corpus's order).
"""

from __future__ import annotations

from pathlib import Path

from engine.text import TOKENIZER_FILE, TOKENIZER_SUBDIR

CORPUS = Path(__file__).resolve().parent / "tiny_corpus.txt"


def train_tiny_text_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer`: byte-level BPE of at most `vocab_size` ids, the same on every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ValueError(f"a byte-level BPE needs at least 256 ids (every byte), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    # One sequence (no parallel word counting across threads): the merge order, and so the ids, can only
    # depend on the corpus.
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def make_tiny_text_tokenizer(out_dir: str | Path, vocab_size: int) -> Path:
    """Write `out_dir/tokenizer/tokenizer.json`; its path."""
    path = Path(out_dir) / TOKENIZER_SUBDIR / TOKENIZER_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    train_tiny_text_tokenizer(vocab_size).save(str(path), pretty=False)
    return path
