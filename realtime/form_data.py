"""`multipart/form-data` bodies (RFC 7578), parsed with the standard library's MIME parser: the
official openai SDK's `client.realtime.calls.create(sdp=..., session=...)` posts its SDP offer and
session config this way."""

from __future__ import annotations

from email.parser import BytesParser
from email.policy import HTTP


class FormDataError(ValueError):
    pass


def parse_form_data(content_type: str, body: bytes, max_fields: int = 8) -> dict[str, bytes]:
    """Field name -> its bytes. Raises FormDataError when the body is not a form of at most `max_fields`
    parts with unique names, except that a name ending in "[]" (an array, as the openai SDK sends
    `include[]`) may repeat: its first value is kept."""
    if "boundary=" not in content_type:
        raise FormDataError("multipart/form-data without a boundary")
    msg = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body)
    if not msg.is_multipart():
        raise FormDataError("the body is not multipart")
    fields: dict[str, bytes] = {}
    for k, part in enumerate(msg.iter_parts()):
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or (name in fields and not name.endswith("[]")) or k >= max_fields:
            raise FormDataError("each form field must have a unique name (at most %d fields)" % max_fields)
        payload = part.get_payload(decode=True)  # bytes, or None for a part that is itself multipart
        fields.setdefault(name, payload if isinstance(payload, bytes) else b"")
    return fields
