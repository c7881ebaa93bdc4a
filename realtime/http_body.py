"""A request body read on demand, within its route's limits (`realtime.http.BodySource`), on aiohttp.

Nothing is read until the handler asks, so a refusal (capacity, content type) costs no body. Then:
a declared `Content-Length` over the limit is refused before a byte is read (413); otherwise bytes
are counted as they arrive (chunked bodies too) and refused past the limit; the whole body must have
arrived by the route's deadline (408). `Expect: 100-continue` is answered only here, once the body
is wanted and known to fit. Forms go through aiohttp's multipart parser, which bounds each part's
headers (count and line length); here: the number of parts, their total bytes, and no nesting.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from aiohttp import BodyPartReader, MultipartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from realtime.http import HttpError

_READ = 1 << 16


class RequestBody:
    def __init__(self, request: web.BaseRequest, max_bytes: int, deadline: float) -> None:
        """`deadline`: the loop time by which the whole body must have arrived."""
        self._request, self._max, self._deadline = request, max_bytes, deadline
        self._taken = False

    async def read(self) -> bytes:
        await self._start()
        data = bytearray()
        try:
            async with asyncio.timeout_at(self._deadline):
                while chunk := await self._request.content.read(_READ):
                    data += chunk
                    self._check(len(data))
        except TimeoutError:
            raise self._too_slow() from None
        return bytes(data)

    async def form(self, max_fields: int) -> dict[str, bytes]:
        ctype = self._request.headers.get("Content-Type", "")
        if ctype.split(";")[0].strip().lower() != "multipart/form-data" or "boundary=" not in ctype:
            raise HttpError(HTTPStatus.BAD_REQUEST, "invalid_request", "the body must be multipart/form-data with a boundary")
        await self._start()
        fields: dict[str, bytes] = {}
        total = 0
        try:
            async with asyncio.timeout_at(self._deadline):
                reader = MultipartReader(self._request.headers, self._request.content)
                count = 0
                while (part := await reader.next()) is not None:
                    if not isinstance(part, BodyPartReader):
                        raise HttpError(HTTPStatus.BAD_REQUEST, "invalid_request", "a form field may not itself be multipart")
                    count += 1
                    name = part.name
                    if count > max_fields or not name or (name in fields and not name.endswith("[]")):
                        raise HttpError(HTTPStatus.BAD_REQUEST, "invalid_request",
                                        f"each form field must have a unique name (at most {max_fields} fields)")
                    data = bytearray()
                    while chunk := await part.read_chunk(_READ):
                        total += len(chunk)
                        self._check(total)
                        data += chunk
                    fields.setdefault(name, bytes(data))
        except TimeoutError:
            raise self._too_slow() from None
        except HttpError:
            raise
        except (ValueError, AssertionError, RuntimeError, HttpProcessingError, web.HTTPException) as e:
            # how aiohttp's parser refuses a malformed form (a part's headers too many or too long: HttpProcessingError)
            raise HttpError(HTTPStatus.BAD_REQUEST, "invalid_request", f"the form could not be read: {e}") from None
        return fields

    async def _start(self) -> None:
        if self._taken:
            raise RuntimeError("a request body is read once")
        self._taken = True
        length = self._request.content_length
        if length is not None and length > self._max:
            raise self._too_large(length)
        if self._request.headers.get("Expect", "").lower() == "100-continue":
            await self._request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # wanted, and may fit: send it now

    def _check(self, size: int) -> None:
        if size > self._max:
            raise self._too_large(size)

    def _too_large(self, size: int) -> HttpError:
        return HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "request_too_large",
                         f"the request body is {size} bytes or more; this endpoint takes at most {self._max}")

    def _too_slow(self) -> HttpError:
        return HttpError(HTTPStatus.REQUEST_TIMEOUT, "request_timeout", "the request body did not arrive in time")
