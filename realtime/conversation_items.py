"""The conversation's items as the client sees them (conversation.item.*), and parsing the items a
client creates.

An item here is either in the engine's history (a user's turn, in audio or typed text with a model
that reads text; an assistant's answer: `in_engine`; deleting one goes through the session to the
engine, and the engine drops the oldest to fit its context: `forget` either way) or held only here
(system messages, assistant text a client adds, function calls and their outputs). System messages'
text becomes part of the session's instructions. Assistant text a client adds is kept and shown back,
but not given to the model: the engine takes user turns only (docs/protocol.md documents this
limitation). So are `function_call` / `function_call_output` items: an agent framework that answers
a call (or replays its history) gets them back as OpenAI's server echoes them; OpusLM, which calls no
tool (realtime/tools.py), never reads them.
"""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from realtime.audio import AudioFormatError, InputDecoder, WireFormat
from realtime.wire_fields import ClientError, get_field, unsupported

MAX_ITEMS = 1024  # items remembered for retrieve/delete; the oldest are forgotten first
MAX_TEXT_CHARS = 64 * 1024

# content part types each role may carry (GA names; "text" is the beta spelling of assistant text)
_PARTS = {
    "system": {"input_text"},
    "user": {"input_text", "input_audio"},
    "assistant": {"output_text", "text"},
}


@dataclass
class Item:
    id: str
    role: str  # a message's; "" for function_call / function_call_output items
    content: list = field(default_factory=list)
    in_engine: bool = False  # its audio is in the engine's history (deleted through the session)
    status: str = "completed"
    type: str = "message"  # or "function_call" / "function_call_output" (held here only)
    fields: dict = field(default_factory=dict)  # a function item's own: call_id, name, arguments / call_id, output

    def wire(self) -> dict:
        if self.type != "message":
            return {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status, **self.fields}
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status, "role": self.role,
                "content": [dict(c) for c in self.content]}

    def text(self) -> str:
        return "\n".join(c.get("text") or "" for c in self.content if c.get("type") in ("input_text", "output_text", "text"))


@dataclass
class NewItem:
    """A parsed conversation.item.create: the item, and its user audio (16 kHz) and text if it has any."""

    item: Item
    pcm: np.ndarray | None
    previous_item_id: str | None
    user_text: str = ""  # a user message's input_text parts, for the model to read (after its audio)

    @property
    def user_turn(self) -> bool:
        return self.pcm is not None or bool(self.user_text)


class ConversationItems:
    def __init__(self) -> None:
        self._items: OrderedDict[str, Item] = OrderedDict()

    def put(self, item: Item) -> None:
        self._items[item.id] = item
        self._items.move_to_end(item.id)
        while len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    def get(self, item_id: str, code: str = "item_retrieve_invalid_item_id") -> Item:
        """`code`: OpenAI's for the event that asked (item_retrieve_invalid_item_id, item_delete_invalid_item_id)."""
        if item_id not in self._items:
            raise ClientError(code, f"no item {item_id!r} in this conversation", "item_id")
        return self._items[item_id]

    def delete(self, item_id: str) -> Item:
        """An item held only here (text, system, function items): gone at once. (`in_engine` items: the session's.)"""
        self.get(item_id, "item_delete_invalid_item_id")
        return self._items.pop(item_id)

    def forget(self, item_id: str) -> None:
        """The engine dropped the item's turn (context management): it is gone, whatever it held."""
        self._items.pop(item_id, None)

    def system_text(self) -> str:
        """The system messages' text, in order: appended to the session's instructions."""
        return "\n".join(t for i in self._items.values() if i.role == "system" and (t := i.text()))


def parse_new_item(ev: dict, input_format: WireFormat, new_id: Callable[[str], str], text: bool = False) -> NewItem:
    """conversation.item.create -> NewItem, or ClientError naming the field refused. `text`: the model reads
    text (a user's input_text is a typed turn; without it, refused)."""
    p = "item."
    raw = get_field(ev, "item", dict, required=True)
    kind = get_field(raw, "type", str, prefix=p) or "message"
    if kind not in ("message", *_FUNCTION_FIELDS):
        raise ClientError("invalid_value", f"'item.type' must be message, {', '.join(_FUNCTION_FIELDS)}; got {kind!r}", "item.type")
    item_id = get_field(raw, "id", str, prefix=p) or new_id("item")
    if not 1 <= len(item_id) <= 64:
        raise ClientError("invalid_value", "'item.id' must be 1 to 64 characters", "item.id")
    if kind != "message":
        return NewItem(_function_item(raw, kind, item_id), None, get_field(ev, "previous_item_id", str))
    role = get_field(raw, "role", str, required=True, prefix=p)
    if role not in _PARTS:
        raise ClientError("invalid_value", "'item.role' must be user, assistant or system", "item.role")
    content = get_field(raw, "content", list, required=True, prefix=p)
    parts, audio, typed = [], [], []
    for i, part in enumerate(content):
        cp = f"item.content[{i}]."
        if not isinstance(part, dict):
            raise ClientError("invalid_type", f"'item.content[{i}]' must be an object", f"item.content[{i}]")
        ptype = get_field(part, "type", str, required=True, prefix=cp)
        if ptype not in _PARTS[role]:
            why = "the model takes no assistant audio from the client" if ptype == "output_audio" else \
                f"a {role} message may hold {', '.join(sorted(_PARTS[role]))}"
            raise unsupported(cp + "type", f"{ptype!r} content: {why}")
        if ptype == "input_audio":
            pcm = _decode_audio(get_field(part, "audio", str, prefix=cp), input_format, cp + "audio")
            if pcm is not None:
                audio.append(pcm)
            parts.append({"type": "input_audio", "transcript": get_field(part, "transcript", str, prefix=cp)})
        else:
            value = get_field(part, "text", str, required=True, prefix=cp)
            if len(value) > MAX_TEXT_CHARS:
                raise ClientError("invalid_value", f"'{cp}text' is longer than {MAX_TEXT_CHARS} characters", cp + "text")
            if role == "user":
                if not text:
                    raise unsupported(cp + "type", "'input_text' content: the model has no text tokenizer, it hears audio only")
                if not value.strip():
                    raise ClientError("invalid_value", f"'{cp}text' is empty: a typed user turn needs words", cp + "text")
                typed.append(value)
            parts.append({"type": ptype, "text": value})
    pcm = np.concatenate(audio) if audio else None
    prev = get_field(ev, "previous_item_id", str)
    user_text = "\n".join(typed)
    return NewItem(Item(item_id, role, parts, in_engine=pcm is not None or bool(user_text)), pcm, prev, user_text)


# a function item's fields as OpenAI echoes them: (name, required)
_FUNCTION_FIELDS = {"function_call": (("call_id", False), ("name", True), ("arguments", True)),
                    "function_call_output": (("call_id", True), ("output", True))}


def _function_item(raw: dict, kind: str, item_id: str) -> Item:
    """A function_call / function_call_output item: kept and echoed, never given to the model."""
    fields = {}
    for name, required in _FUNCTION_FIELDS[kind]:
        value = get_field(raw, name, str, required=required, prefix="item.")
        if value is not None and len(value) > MAX_TEXT_CHARS:
            raise ClientError("invalid_value", f"'item.{name}' is longer than {MAX_TEXT_CHARS} characters", f"item.{name}")
        fields[name] = value
    return Item(item_id, "", type=kind, fields=fields)


def _decode_audio(b64: str | None, fmt: WireFormat, param: str) -> np.ndarray | None:
    if not b64:
        return None
    if fmt is WireFormat.OPUS:
        raise unsupported(param, "audio items must be pcm16, G.711 μ-law or A-law (set the session's input format)")
    try:
        payload = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise ClientError("invalid_base64", f"'{param}' is not valid base64", param) from None
    decoder = InputDecoder(fmt)  # its own: the item is whole, not part of the input stream
    try:
        pcm = decoder.decode(payload)
        tail = decoder.flush()
    except AudioFormatError as e:
        raise ClientError("invalid_audio", f"{e} (input format {fmt.value})", param) from None
    return np.concatenate([pcm, tail]) if tail.size else pcm
