"""``AnthropicStreamSink``: a ``"stream": true`` request to an Anthropic Messages path
(docs/API.md "Anthropic Messages").

A ``StreamSink`` that speaks Anthropic's event stream where the gateway itself writes to it: the
keep-alive while the request waits is Anthropic's own ``event: ping`` (the queue position stays
in a comment beside it), and an error after the 200 went out (queue timeout, budget, node lost
mid-answer, the node's own refusal) is ``event: error`` with Anthropic's error object, which the
official ``anthropic`` SDK raises; an OpenAI-shaped ``data:`` frame it would skip, returning an
empty answer.
"""

from __future__ import annotations

import orjson

from kilolined.core.errors import anthropic_error_body
from kilolined.modes.sinks import StreamSink

PING = b'event: ping\ndata: {"type": "ping"}\n\n'


class AnthropicStreamSink(StreamSink):
    __slots__ = ()

    def keepalive(self, note: bytes) -> bytes:
        return b": " + note + b"\n" + PING

    def error_frame(self, type_: str, message: str, status: int) -> bytes:
        body = anthropic_error_body(status, type_, message, self.call.request_id, None)
        return b"event: error\ndata: " + orjson.dumps(body) + b"\n\n"
