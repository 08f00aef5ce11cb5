"""Anthropic Messages (``POST /v1/messages``) on an ``openai`` route, as llama.cpp, vLLM and
llama-swap serve it beside OpenAI's API (docs/API.md "Anthropic Messages").

The same life as a chat completion (``OpenAIAdapter``), read in Anthropic's shapes: the token
budget's reservation estimates the prompt with ``system`` first (``anthropic_body.chat_view``),
and ``usage`` is read from the answer (``usage.input_tokens``/``output_tokens``) or the stream
(``message_start``'s message, then ``message_delta``), in OpenAI's names, so that budgets,
``kiloline_tokens_total``, time to first token, node speeds and the prefix index's correction
count it as they count OpenAI usage. A content chunk is a ``content_block_delta``.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kilolined.adapters.base import Tee
from kilolined.adapters.openai import (
    OpenAIAdapter,
    StreamParser,
    UsageObserver,
    estimate_tokens,
    progress_reporter,
    request_json,
    usage_count,
)
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.anthropic_body import chat_view, is_messages_path
from kilolined.scheduling.lease import LeaseScope, Sink
from kilolined.scheduling.queue import Rejected
from kilolined.wire.proxy import Exchange, Observer

# A ``data:`` line's payload (the blanks before the field name and around the JSON are allowed).
_DATA_LINE = re.compile(rb"^[ \t\r\x0b\x0c]*data:(.*)$", re.M)
# A delta event's JSON with its type first (a serializer's order; a delta carries no usage): counted
# as a content chunk without parsing it, on the per-token path.
_DELTA = b'{"type":"content_block_delta"'
_USAGE_KEYS = ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def is_messages(ex: Exchange) -> bool:
    return ex.method == "POST" and is_messages_path(ex.tail.split("?", 1)[0])


def openai_usage(usage: dict[str, Any]) -> dict[str, Any] | None:
    """Anthropic's ``usage`` in OpenAI's names; None when it counts nothing. ``input_tokens`` are
    the prompt's tokens not read from a cache (Anthropic's meaning; llama.cpp counts them all
    there and sends no cache fields): the prompt is their sum with ``cache_read_input_tokens`` and
    ``cache_creation_input_tokens``, and the cache's reads are its ``cached_tokens``."""
    got = {k: usage_count(usage.get(k)) for k in _USAGE_KEYS}
    if all(v is None for v in got.values()):
        return None
    prompt = sum(v or 0 for k, v in got.items() if k != "output_tokens")
    out = got["output_tokens"] or 0
    res: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
    cached = got["cache_read_input_tokens"]
    if cached is not None:
        res["prompt_tokens_details"] = {"cached_tokens": cached}
    return res


class MessagesParser(StreamParser):
    """``StreamParser`` for Anthropic's shapes: usage in OpenAI's names, one chunk per
    ``content_block_delta``. A stream's usage is the last count of each field (``message_start``
    tells the input, ``message_delta`` the output so far, as Anthropic's are cumulative)."""

    stream_starts = (b"event:", b"data:", b":")  # Anthropic's streams have no `error:` lines

    def __init__(self, on_chunk: Any = None):
        super().__init__(on_chunk)
        self.counted: dict[str, Any] = {}

    def pass_on(self, chunk: bytes) -> bytes:
        self._feed(chunk)
        return chunk

    def _feed(self, chunk: bytes) -> None:
        chunk, end = self._whole_lines(chunk)
        for payload in _DATA_LINE.findall(chunk, 0, end):
            if payload.lstrip().startswith(_DELTA):
                self._count_content()  # a token, as llama.cpp and Anthropic write it: nothing else to read
                continue
            try:
                ev = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(ev, dict):
                self._event(ev)

    def _event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "content_block_delta":
            self._count_content()
            return
        message = ev.get("message")
        usage = message.get("usage") if kind == "message_start" and isinstance(message, dict) else \
            ev.get("usage") if kind == "message_delta" else None
        if isinstance(usage, dict):
            self.counted.update((k, usage[k]) for k in _USAGE_KEYS if usage.get(k) is not None)
            self.usage = openai_usage(self.counted)

    def done(self, ok: bool) -> None:
        body = self._answer_body()
        if body is not None and isinstance(body.get("usage"), dict):
            self.usage = openai_usage(body["usage"])


class MessagesUsage(UsageObserver, MessagesParser):
    """``UsageObserver`` (budgets, metrics, speeds, the prefix index's correction) over
    ``MessagesParser``'s reading."""


class MessagesAdapter(OpenAIAdapter):
    """An ``openai`` route's adapter for a request to its Messages endpoint (registry.py)."""

    def prepare(self, ex: Exchange) -> None:
        if not is_messages(ex):
            return
        data = request_json(ex)
        if data is None:
            raise Rejected(400, "bad_request", "body must be a JSON object")
        # As on the OpenAI paths: a lax server reads "true" as true and streams what the gateway
        # would not read as a stream (its usage, so the token budget, would be missed).
        if data.get("stream") not in (None, True, False) or data.get("stream").__class__ is int:
            raise Rejected(400, "bad_request", '"stream" must be true or false')

    def estimate(self, ex: Exchange) -> int:
        data = request_json(ex) if is_messages(ex) else None
        return estimate_tokens(chat_view(data)) if data is not None else 0

    def observer(self, rt: Runtime, ex: Exchange, scope: LeaseScope, sink: Sink) -> Observer | None:
        if not is_messages(ex):
            return None
        usage = MessagesUsage(rt, rt.route_label(scope.route), scope.key, scope.dispatched_at, scope)
        return Tee(usage, self._progress(ex, sink)) if sink.reports_progress else usage

    @staticmethod
    def _progress(ex: Exchange, sink: Sink) -> Observer | None:
        """step_progress of a streamed job: content deltas against max_tokens."""
        data = request_json(ex) or {}
        total = data.get("max_tokens")
        if not isinstance(total, int) or isinstance(total, bool) or total <= 0 or data.get("stream") is not True:
            return None
        return MessagesParser(progress_reporter(sink, total))
