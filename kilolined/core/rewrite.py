"""Rewriting a request for its route and node, and the answer back to the client's names
(docs/CONFIG.md#rewriting-requests).

Pure: a body and a ``RewriteConfig`` in, a body (or None: nothing to change) out. A JSON object
body gets all four rules (``model`` map, ``default``, ``set``, ``strip``); a multipart form only
its ``model`` field renamed (the audio endpoints' form; the file is never parsed). An answer
carries the name the client asked for: ``ModelRename`` puts it back in every ``"model"`` member
of a JSON body or of the events of a stream, with a byte search per piece and a regex only
where a ``"model"`` member is in sight.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson

from kilolined.core.config import PriceConfig, RewriteConfig
from kilolined.core.forms import is_multipart, replace_field

#: the most of a JSON answer held back to rename its model: beyond it, it passes as it came
MAX_HELD = 8 * 1024 * 1024


def aliased(rw: RewriteConfig | None, model: str | None) -> str | None:
    """The name ``model`` is sent under (itself when the map does not name it)."""
    if rw is None or model is None or not rw.model:
        return model
    return rw.model.get(model, model)


def rewrite_doc(doc: dict[str, Any], rw: RewriteConfig) -> dict[str, Any] | None:
    """The body with ``rw`` applied; None when it changes nothing (the client's bytes go on)."""
    out: dict[str, Any] | None = None
    model = doc.get("model")
    if isinstance(model, str) and rw.model.get(model, model) != model:
        out = {**doc, "model": rw.model[model]}
    for k, v in rw.default.items():
        if k not in doc:
            out = out if out is not None else dict(doc)
            out[k] = v
    for k, v in rw.set.items():
        if k not in doc or doc[k] != v:
            out = out if out is not None else dict(doc)
            out[k] = v
    for k in rw.strip:
        if k in doc:
            out = out if out is not None else dict(doc)
            del out[k]
    return out


def rewrite_body(body: bytes, doc: Any, content_type: str | None, rw: RewriteConfig) -> bytes | None:
    """The bytes to send instead of ``body`` (``doc``: its JSON parse, None when it is not JSON);
    None when ``rw`` changes nothing. FormError: a multipart body that is no form."""
    if isinstance(doc, dict):
        new = rewrite_doc(doc, rw)
        return None if new is None else orjson.dumps(new)
    if doc is None and body and rw.model and is_multipart(content_type):
        assert content_type is not None
        return replace_field(body, content_type, "model", rw.model)
    return None


def cost_of(tokens: tuple[int, int], price: PriceConfig | None) -> float | None:
    """What an answer of ``tokens`` (prompt, completion) costs on a node priced per million
    tokens (``nodes.<n>.price_per_mtok``); None: the node has no price."""
    if price is None:
        return None
    return (tokens[0] * price.input + tokens[1] * price.output) / 1_000_000


# A ``"model"`` member: found after an object's ``{`` or a ``,`` (a quote inside a JSON string is
# escaped, so text that merely says "model" never matches), with the blanks JSON allows.
_MEMBER = re.compile(rb'([{,]\s*"model"\s*:\s*)"(?:[^"\\]|\\.)*"')


class ModelRename:
    """Puts the client's name in every ``"model"`` member of an answer, piece by piece.

    A stream (SSE) is renamed per ended line, the rest of a line held until it ends (a node
    writes whole events, so nothing is held in practice); a JSON body is held whole (up to
    MAX_HELD) and renamed at its end. Once a member is seen, its exact spelling (``"model":"x"``,
    the node's name as the node writes it) is replaced by one C call per piece: outside a JSON
    string such bytes can only be that member, as every quote inside a string is escaped."""

    __slots__ = ("held", "member", "name", "repl", "sse", "to")

    def __init__(self, client_model: str, sse: bool):
        self.name = orjson.dumps(client_model)
        self.repl = b"\\1" + self.name.replace(b"\\", b"\\\\")  # a literal for re.sub
        self.sse = sse
        self.held = b""
        self.member: bytes | None = None  # the member as the node spells it, once seen
        self.to = b""

    def rename(self, data: bytes) -> bytes:
        member = self.member
        if member is not None and (n := data.count(member)) and n == data.count(b'"model"'):
            return data.replace(member, self.to)  # every member spelled as before (the per-token case)
        if data.find(b'"model"') < 0:
            return data
        m = _MEMBER.search(data)
        if m is None:
            return data
        head = m.group(1)[1:]
        self.member, self.to = m.group(0)[1:], head + self.name
        return _MEMBER.sub(self.repl, data)

    def feed(self, chunk: bytes) -> bytes:
        if self.held:
            chunk, self.held = self.held + chunk, b""
        if not self.sse:
            if len(chunk) > MAX_HELD:
                return chunk  # not an answer that names a model: pass it on
            self.held = chunk
            return b""
        if chunk and chunk[-1] != 10:  # a line not ended yet: held until it is
            end = chunk.rfind(b"\n") + 1
            chunk, self.held = chunk[:end], chunk[end:]
        return self.rename(chunk)

    def after(self, tap: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
        """``tap``, then ``feed``, as one call: the relay's per-token path (a whole line whose
        members are spelled as before takes one C replace, no other call)."""
        feed, rename = self.feed, self.rename

        def renamed(chunk: bytes) -> bytes:
            out = tap(chunk)
            if self.held or not out or out[-1] != 10:
                return feed(out)
            member = self.member
            if member is not None and (n := out.count(member)) and n == out.count(b'"model"'):
                return out.replace(member, self.to)
            return rename(out)

        return renamed

    def flush(self) -> bytes:
        rest, self.held = self.held, b""
        return self.rename(rest)
