"""Parsing a client's JSON message without letting it cost more than its size or break the reader.

`json.loads` alone accepts what later code cannot use: NaN and Infinity, integers of thousands of
digits (or raises ValueError past Python's 4300-digit limit, which is no JSONDecodeError), and
nesting so deep that the parser, or any later `repr` of the value, hits the recursion limit. Each
of those ended a session without an error event (issue 23). So did a string holding a lone UTF-16
surrogate (`"\\ud800"`: valid JSON, not valid Unicode), once the session tried to encode it back (an
echo, the tokenizer). Here every such message is one `BadJson` with a reason, and what comes back is
plain data of bounded depth with finite numbers and valid Unicode strings.
"""

from __future__ import annotations

import json
import math
import re

MAX_DEPTH = 32  # the deepest client event (session.update's turn_detection) is 4 levels
MAX_INT_DIGITS = 20  # int64 and uint64 fit; anything longer is no count, id or setting of ours

# In a str (a WebSocket text frame, valid UTF-8) a surrogate can only come from a \\uD800-\\uDFFF escape,
# and a pair of them becomes one code point: so only a message with such an escape is walked, and any
# surrogate left in its strings is a lone one. Bytes (an HTTP body) are always walked: json decodes
# them with "surrogatepass", so an encoded surrogate gets through with no escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class BadJson(ValueError):
    """The message is not JSON this server takes; `str()` says why (for an `invalid_json` error)."""


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BadJson(f"an integer of {len(text)} digits is out of range")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJson(f"the number {text[:40]} is out of range")
    return value


def _constant(name: str) -> float:
    raise BadJson(f"{name} is not a JSON number")


def loads(text: str | bytes) -> object:
    """Parse one client message; raises BadJson (never anything else) when it is not usable JSON."""
    try:
        value = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
    except BadJson:
        raise
    except json.JSONDecodeError as e:
        raise BadJson(f"{e.msg} at position {e.pos}") from None
    except RecursionError:
        raise BadJson(f"nested more than {MAX_DEPTH} levels deep") from None
    except (ValueError, TypeError) as e:  # undecodable bytes, or what the parser refuses otherwise
        raise BadJson(str(e)[:200]) from None
    _check_depth(value)
    if isinstance(text, bytes) or _SURROGATE_ESCAPE.search(text):
        _check_unicode(value)
    return value


def _check_unicode(value: object) -> None:
    """Every string (keys too) is valid Unicode: no lone surrogate (the depth is already bounded)."""
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, str) and (m := _SURROGATE.search(node)):
            raise BadJson(f"a string holds a lone UTF-16 surrogate (\\u{ord(m.group()):04x} at character {m.start()}): "
                          "not valid Unicode")


def _check_depth(value: object) -> None:
    """Iteratively, so the check itself cannot recurse too deep."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                if depth >= MAX_DEPTH:
                    raise BadJson(f"nested more than {MAX_DEPTH} levels deep")
                stack.append((child, depth + 1))
