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

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from realtime.audio import WireFormat
from realtime.item_audio import ItemAudio
from realtime.text_limits import TextLimits, check_string, too_long, utf8_size
from realtime.wire_fields import ClientError, get_field, unsupported

# Items remembered for retrieve/delete, whoever made them; beyond, the oldest are forgotten first. A
# client's own items are refused earlier (`TextLimits.max_items`); the server's (turns, answers) leave
# as the engine drops them from its context, so this only bounds a conversation that never gets there.
MAX_ITEMS = 4096

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
    text_bytes: int = 0  # the client's text it holds (UTF-8), counted against the session's bounds; 0: the server's item
    system_tokens: int = 0  # a system message's text in the model's tokens (0: unknown, no text model)

    def wire(self) -> dict:
        if self.type != "message":
            return {"id": self.id, "object": "realtime.item", "type": self.type, "status": self.status, **self.fields}
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status, "role": self.role,
                "content": [dict(c) for c in self.content]}

    def text(self) -> str:
        return "\n".join(c.get("text") or "" for c in self.content if c.get("type") in ("input_text", "output_text", "text"))


@dataclass
class NewItem:
    """A parsed conversation.item.create: the item, and its user audio (still encoded: the input budget
    costs it before it is decoded) and text if it has any."""

    item: Item
    audio: ItemAudio | None
    previous_item_id: str | None
    user_text: str = ""  # a user message's input_text parts, for the model to read (after its audio)

    @property
    def user_turn(self) -> bool:
        return self.audio is not None or bool(self.user_text)


class ConversationItems:
    """The items, with the totals the session's text bounds are checked against (realtime/text_limits.py),
    kept as items come and go so that no check walks the conversation."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Item] = OrderedDict()
        self.text_bytes = 0  # the client's items' text
        self.system_bytes = 0  # the system messages' text, with the line breaks that join them
        self.system_tokens = 0  # ... in the model's tokens, with the line breaks

    def __len__(self) -> int:
        return len(self._items)

    def put(self, item: Item) -> None:
        self._pop(item.id)
        self._items[item.id] = item
        self.text_bytes += item.text_bytes
        if item.role == "system":
            self.system_bytes += item.text_bytes + 1
            self.system_tokens += item.system_tokens + 1
        while len(self._items) > MAX_ITEMS:
            self._pop(next(iter(self._items)))

    def _pop(self, item_id: str) -> Item | None:
        item = self._items.pop(item_id, None)
        if item is not None:
            self.text_bytes -= item.text_bytes
            if item.role == "system":
                self.system_bytes -= item.text_bytes + 1
                self.system_tokens -= item.system_tokens + 1
        return item

    def __contains__(self, item_id: str) -> bool:
        return item_id in self._items

    def get(self, item_id: str, code: str = "item_retrieve_invalid_item_id") -> Item:
        """`code`: OpenAI's for the event that asked (item_retrieve_invalid_item_id, item_delete_invalid_item_id)."""
        if item_id not in self._items:
            raise ClientError(code, f"no item {item_id!r} in this conversation", "item_id")
        return self._items[item_id]

    def delete(self, item_id: str) -> Item:
        """An item held only here (text, system, function items): gone at once. (`in_engine` items: the session's.)"""
        item = self.get(item_id, "item_delete_invalid_item_id")
        self._pop(item_id)
        return item

    def forget(self, item_id: str) -> None:
        """The engine dropped the item's turn (context management): it is gone, whatever it held."""
        self._pop(item_id)

    def system_text(self) -> str:
        """The system messages' text, in order: appended to the session's instructions."""
        return "\n".join(t for i in self._items.values() if i.role == "system" and (t := i.text()))


def parse_new_item(ev: dict, input_format: WireFormat, new_id: Callable[[str], str], text: bool = False,
                   limits: TextLimits = TextLimits()) -> NewItem:
    """conversation.item.create -> NewItem, or ClientError naming the field refused. `text`: the model reads
    text (a user's input_text is a typed turn; without it, refused). `limits.max_item_text_bytes` bounds
    the item's text, all its parts together, before anything else is done with it."""
    p = "item."
    raw = get_field(ev, "item", dict, required=True)
    kind = get_field(raw, "type", str, prefix=p) or "message"
    if kind not in ("message", *_FUNCTION_FIELDS):
        raise ClientError("invalid_value", f"'item.type' must be message, {', '.join(_FUNCTION_FIELDS)}; got {kind!r}", "item.type")
    item_id = get_field(raw, "id", str, prefix=p) or new_id("item")
    if not 1 <= len(item_id) <= 64:
        raise ClientError("invalid_value", "'item.id' must be 1 to 64 characters", "item.id")
    if kind != "message":
        return NewItem(_function_item(raw, kind, item_id, limits), None, get_field(ev, "previous_item_id", str))
    role = get_field(raw, "role", str, required=True, prefix=p)
    if role not in _PARTS:
        raise ClientError("invalid_value", "'item.role' must be user, assistant or system", "item.role")
    content = get_field(raw, "content", list, required=True, prefix=p)
    text_bytes = _text_bytes(content, limits)
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
            if b64 := get_field(part, "audio", str, prefix=cp):
                if input_format is WireFormat.OPUS:
                    raise unsupported(cp + "audio", "audio items must be pcm16, G.711 μ-law or A-law (set the session's input format)")
                audio.append((b64, cp + "audio"))
            parts.append({"type": "input_audio", "transcript": get_field(part, "transcript", str, prefix=cp)})
        else:
            value = get_field(part, "text", str, required=True, prefix=cp)
            if role == "user":
                if not text:
                    raise unsupported(cp + "type", "'input_text' content: the model has no text tokenizer, it hears audio only")
                if not value.strip():
                    raise ClientError("invalid_value", f"'{cp}text' is empty: a typed user turn needs words", cp + "text")
                typed.append(value)
            parts.append({"type": ptype, "text": value})
    item_audio = ItemAudio(tuple(audio), input_format) if audio else None  # decoded once the input budget has taken it
    prev = get_field(ev, "previous_item_id", str)
    user_text = "\n".join(typed)
    return NewItem(Item(item_id, role, parts, in_engine=item_audio is not None or bool(user_text), text_bytes=text_bytes), item_audio,
                   prev, user_text)


def _text_bytes(content: list, limits: TextLimits) -> int:
    """The UTF-8 size of a message's text parts together; `string_above_max_length` naming the part that
    takes it beyond `limits.max_item_text_bytes` (a 2 MB part is refused without being encoded)."""
    limit, total = limits.max_item_text_bytes, 0
    for i, part in enumerate(content):
        if isinstance(part, dict) and isinstance(value := part.get("text"), str):
            total += utf8_size(value, limit)
            if total > limit:
                raise too_long(f"item.content[{i}].text", total, limit, "max_item_text_bytes")
    return total


# a function item's fields as OpenAI echoes them: (name, required)
_FUNCTION_FIELDS = {"function_call": (("call_id", False), ("name", True), ("arguments", True)),
                    "function_call_output": (("call_id", True), ("output", True))}


def _function_item(raw: dict, kind: str, item_id: str, limits: TextLimits) -> Item:
    """A function_call / function_call_output item: kept and echoed, never given to the model."""
    fields, size = {}, 0
    for name, required in _FUNCTION_FIELDS[kind]:
        value = get_field(raw, name, str, required=required, prefix="item.")
        if value is not None:
            size += check_string(value, f"item.{name}", limits, "max_item_text_bytes")
            if size > limits.max_item_text_bytes:
                raise too_long(f"item.{name}", size, limits.max_item_text_bytes, "max_item_text_bytes")
        fields[name] = value
    return Item(item_id, "", type=kind, fields=fields, text_bytes=size)
