"""A text field of a ``multipart/form-data`` body (RFC 7578), read without parsing the files.

OpenAI's audio endpoints (``/v1/audio/transcriptions``, ``/v1/audio/translations``, as vLLM,
whisper.cpp's server, Speaches and LocalAI serve them) take a form: the audio file and text
fields, ``model`` among them. The gateway reads that one field to match a route, route to a node
that serves the model and keep its warm model (docs/API.md "Audio"); the form passes to the node
untouched.

Pure: bytes in, a string or None out. A field is found by its part's ``Content-Disposition:
form-data; name="…"`` header; its value is the part's body as UTF-8. The file's bytes are skipped
with ``bytes.find`` (C speed), never copied.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

#: OpenAI's audio paths whose form names its model (``model`` is required there)
AUDIO_FORM_PATHS = ("/audio/transcriptions", "/audio/translations")
#: a field value longer than this is not a model name: read as absent
MAX_FIELD_BYTES = 4096

_BOUNDARY = re.compile(r'boundary=(?:"([^"]{1,200})"|([^\s;,"]{1,200}))', re.I)
_NAME = re.compile(rb'(?:^|;)\s*name="([^"]*)"', re.I)


class FormError(ValueError):
    """The body is not the multipart form its Content-Type says (answered 400)."""


def is_multipart(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "multipart/form-data"


def boundary(content_type: str) -> bytes:
    """The boundary of a ``multipart/form-data`` Content-Type; FormError when it has none."""
    m = _BOUNDARY.search(content_type)
    if m is None:
        raise FormError("multipart/form-data without a boundary")
    # aiohttp decodes header bytes as UTF-8 with surrogate escapes: this gives the bytes back
    return (m.group(1) or m.group(2)).encode("utf-8", "surrogateescape")


def form_field(body: bytes, content_type: str, name: str) -> str | None:
    """The first text field ``name`` of the form; None when the form has none (or its value is
    not UTF-8 text of at most MAX_FIELD_BYTES). FormError when the body is no such form."""
    at = _first_part(body, content_type, name)
    return _text(body[at[0]:at[1]]) if at is not None else None


def replace_field(body: bytes, content_type: str, name: str, values: dict[str, str]) -> bytes | None:
    """The form with its first text field ``name`` replaced by ``values[its value]``; None when
    the form has no such field or ``values`` does not name its value. FormError: no such form."""
    at = _first_part(body, content_type, name)
    old = _text(body[at[0]:at[1]]) if at is not None else None
    new = values.get(old) if old is not None else None
    if new is None or at is None:
        return None
    return body[:at[0]] + new.encode() + body[at[1]:]


def form_parts(body: bytes, content_type: str) -> dict[str, tuple[bytes, str | None]]:
    """Every part of the form by name (the first of a name): its bytes and its Content-Type
    (None for a text field that gives none). ``image[]`` is read as ``image`` (the SDKs' name for
    a list of files). FormError when the body is no such form."""
    parts: dict[str, tuple[bytes, str | None]] = {}
    for head, begin, end in _parts(body, content_type):
        name = _part_name(head)
        if name is not None:
            key = name.decode("utf-8", "replace").removesuffix("[]")
            parts.setdefault(key, (body[begin:end], _part_type(head)))
    return parts


def _parts(body: bytes, content_type: str) -> Iterator[tuple[bytes, int, int]]:
    """Each part of the form in turn, as far as it is read: its headers, and where its value
    begins and ends in ``body``. FormError (when reached) where the body is no such form."""
    delim = b"--" + boundary(content_type)
    at = body.find(delim)
    if at < 0:
        raise FormError("multipart body without its boundary")
    while True:
        start = at + len(delim)
        if body.startswith(b"--", start):
            return  # the closing delimiter
        head_end = body.find(b"\r\n\r\n", start)
        if head_end < 0:
            raise FormError("multipart part without the blank line after its headers")
        nxt = body.find(b"\r\n" + delim, head_end + 4)
        if nxt < 0:
            raise FormError("multipart body without its closing boundary")
        yield body[start:head_end], head_end + 4, nxt
        at = nxt + 2


def _first_part(body: bytes, content_type: str, name: str) -> tuple[int, int] | None:
    """Where the value of the first part named ``name`` begins and ends; None: no such part."""
    want = name.encode()
    return next(((begin, end) for head, begin, end in _parts(body, content_type) if _part_name(head) == want), None)


def _text(value: bytes) -> str | None:
    """A field's value as text; None when it is too long for a model name or not UTF-8."""
    if len(value) > MAX_FIELD_BYTES:
        return None
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _header(head: bytes, name: bytes) -> bytes | None:
    """The value of a part's header ``name`` (lower case), the first of that name; None: none."""
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            return value
    return None


def _part_name(head: bytes) -> bytes | None:
    disposition = _header(head, b"content-disposition")
    m = _NAME.search(disposition) if disposition is not None else None
    return m.group(1) if m is not None else None


def _part_type(head: bytes) -> str | None:
    value = _header(head, b"content-type")
    return value.strip().decode("latin-1") if value is not None else None
