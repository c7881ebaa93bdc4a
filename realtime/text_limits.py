"""What one session's client may make the server hold in text, and how much of it the model can read.

A hostile client once made one session hold 10 001 items, 1.2 GB of system messages, and 1.9 MB of
instructions tokenized on the event loop at every `session.update` (issue 39). So every text a client
sends into a session is bounded twice, and refused with an `error` naming the limit (the session goes on):

- in bytes (config `limits.text`), checked before anything is tokenized or copied: the items the
  conversation holds, one item's text, all the text of the items the client added, the instructions,
  and the system text (instructions and system messages, which the model reads together);
- in the model's tokens (`engine.service_api.TextBudget`): the system text and a typed user turn must
  fit the model's context, so text the model could not read is refused rather than cut or failed later.

The byte bounds are what make the token counts cheap: the tokenizer runs only on text already below
them (16 KiB of text is 2 to 5 ms of tokenizing, on the event loop), each piece once (`TokenMeter`
remembers the counts), and new text at most `tokenize_bytes_per_s` a session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.service_api import TextBudget
from realtime.input_budget import TokenBucket
from realtime.wire_fields import ClientError

KIB = 1024


@dataclass(frozen=True)
class TextLimits:
    """`limits.text` in the server config. The defaults follow from the models' contexts: 4096 positions
    today (the tiny model, OpusLM 7B as served), of which the system text gets a quarter (1024 tokens)
    and a typed turn about 2300; at 2.5 to 4 bytes a token in English (and at least 1), no text beyond
    ~16 KB could be read whole, so 16 KiB bounds each text the model reads. Items held only here
    (assistant text, function calls and outputs) are bounded by the same 16 KiB each and by
    `max_conversation_text_bytes` together: 16 full items, or about a thousand short ones."""

    max_items: int = 1024  # items the conversation holds at once (conversation.item.create beyond: refused)
    max_item_text_bytes: int = 16 * KIB  # one item's text (all its parts; a function call's fields), UTF-8
    max_conversation_text_bytes: int = 256 * KIB  # the text of every item the client added, together
    max_instructions_bytes: int = 16 * KIB  # session.instructions, a response's instructions
    max_system_text_bytes: int = 16 * KIB  # the instructions and the system messages' text together
    # Text the model reads is tokenized on the event loop, by the gateway (to count it) and the engine (its
    # system text), ~0.3 ms a KiB each: new text beyond this rate is refused (input_rate_exceeded), so one
    # session sending distinct 16 KiB instructions as fast as it may takes ~40 ms of the loop a second,
    # not the ~650 ms that 64 such updates a second (the message byte budget's 1 MiB) would.
    tokenize_bytes_per_s: int = 64 * KIB
    tokenize_bytes_burst: int = 64 * KIB  # at least the longest text counted (an item's, the instructions)

    def problems(self) -> list[tuple[str, str]]:
        """The out-of-range fields, as (field, why): the config names them under `limits.text`."""
        names = ("max_items", "max_item_text_bytes", "max_conversation_text_bytes", "max_instructions_bytes",
                 "max_system_text_bytes", "tokenize_bytes_per_s")
        wrong = [(name, "must be >= 1") for name in names if not getattr(self, name) >= 1]
        if self.tokenize_bytes_burst < max(self.max_item_text_bytes, self.max_instructions_bytes):
            wrong.append(("tokenize_bytes_burst", "must be at least max_item_text_bytes and max_instructions_bytes"))
        return wrong


def utf8_size(text: str, limit: int) -> int:
    """`text`'s UTF-8 size, or its length in characters when that alone is beyond `limit` (a character
    is at least one byte): a 2 MB string is refused without being encoded."""
    if len(text) > limit:
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def too_long(param: str, size: int, limit: int, key: str) -> ClientError:
    """One string beyond its byte bound: OpenAI's code, and its wording (in bytes here)."""
    return ClientError("string_above_max_length", f"Invalid '{param}': string too long. Expected a string with maximum length "
                                                  f"{limit} bytes (limits.text.{key}), but got a string of {size} or more bytes "
                                                  "instead.", param)


def check_string(text: str, param: str, limits: TextLimits, key: str) -> int:
    """`text`'s UTF-8 size; `string_above_max_length` beyond `limits.<key>`."""
    limit = getattr(limits, key)
    if (size := utf8_size(text, limit)) > limit:
        raise too_long(param, size, limit, key)
    return size


def over_total(param: str, what: str, size: int, limit: int, key: str) -> ClientError:
    """A session's total beyond its bound (ours: OpenAI has no such limit)."""
    return ClientError("conversation_limit_exceeded", f"{what} would be {size} bytes, more than a session may hold "
                                                      f"({limit}, limits.text.{key}); delete items first", param)


def context_exceeded(param: str, what: str, tokens: int, limit: int, budget: TextBudget) -> ClientError:
    """Text beyond what the model's context holds for it: OpenAI's code for a prompt beyond the context."""
    return ClientError("context_length_exceeded", f"{what} is {tokens} tokens of this model; at most {limit} fit "
                                                  f"(of its context of {budget.context} positions)", param)


class TokenMeter:
    """The model's token counts of a session's texts (`EngineLike.count_text_tokens`), each text counted
    once: a system text made of several pieces is the sum of its pieces' counts, and an unchanged
    instructions text is not counted again. New text is taken from a bucket of `tokenize_bytes_per_s`."""

    CACHE = 16  # texts remembered (instructions going back and forth, a response's own)

    def __init__(self, count: Callable[[str], int], budget: TextBudget, limits: TextLimits = TextLimits()) -> None:
        self._count = count
        self.budget = budget
        self._known: OrderedDict[str, int] = OrderedDict()
        self._bucket = TokenBucket(limits.tokenize_bytes_per_s, limits.tokenize_bytes_burst, 0.0)  # (full, whenever it is first used)

    def tokens(self, text: str, now: float | None = None, param: str | None = None) -> int:
        """`text`'s tokens. `now`: a client's text, taken from the bucket when it is new (None: the server's
        own, e.g. its configured instructions); beyond it `input_rate_exceeded` naming `param`."""
        if not text:
            return 0
        if (n := self._known.get(text)) is not None:
            self._known.move_to_end(text)
            return n
        if now is not None and not self._bucket.take(size := len(text.encode("utf-8", "surrogatepass")), now):
            raise ClientError("input_rate_exceeded", f"new text to read beyond this session's budget ({self._bucket.rate:g} bytes a "
                                                     "second, limits.text.tokenize_bytes_per_s): try again in "
                                                     f"{self._bucket.wait_s(size):.1f} s", param)
        n = self._count(text)
        self._known[text] = n
        while len(self._known) > self.CACHE:
            self._known.popitem(last=False)
        return n
