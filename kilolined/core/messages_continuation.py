"""Anthropic Messages streams that survive their node: the pure part (docs/API.md "Streams that
survive their node"), beside continuation.py's OpenAI one.

A ``/v1/messages`` stream on an ``openai`` route (llama.cpp, vLLM and llama-swap serve Anthropic's
API beside OpenAI's) goes on on another node as a chat completion does:

- ``MessagesTranscript.read``: what the client got (``message_start``'s id, model and
  ``input_tokens``, the text of its text block, one token per ``text_delta``, whether the answer
  ended or holds something text cannot carry on: tool use, thinking, an error).
- ``messages_continuation_body``: the request again with the text so far as a final assistant
  message, which the Messages API continues (Anthropic's "prefill"), ``max_tokens`` less what was
  generated. No flag is needed, and none is sent: llama.cpp's Messages endpoint takes none.
- ``MessagesSeam``: the continuing node's events as the client's stream goes on: its
  ``message_start`` and the start of its text block dropped (the client had them), its text in
  the client's open block, ``output_tokens`` summed with what came before. llama.cpp's first
  delta repeats the prefilled text before the new token (it did, asked directly: "Hello there" →
  "Hello there Street"): a first delta that begins with the whole text so far loses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kilolined.core.continuation import events, payload, token_count, tokens_left

#: content blocks and deltas whose meaning text alone cannot carry on to another node
_TEXT_BLOCK, _TEXT_DELTA = "text", "text_delta"


@dataclass(slots=True)
class MessagesTranscript:
    """What a client got of an Anthropic Messages stream, read from its bytes."""

    id: str | None = None
    model: str | None = None
    input_tokens: int | None = None
    text: str = ""
    tokens: int = 0  # text deltas that reached the client: the tokens generated so far
    #: the index of the text block the client is reading (None: none open)
    block: int | None = None
    #: the answer ended (``stop_reason``, ``message_stop``) or a block closed: nothing to continue
    finished: bool = False
    #: something text cannot carry on: tool use, thinking, a second block, an error
    opaque: bool = False

    @classmethod
    def read(cls, sent: bytes) -> MessagesTranscript:
        t = cls()
        for event in events(sent):
            ev = payload(event)
            if isinstance(ev, dict):
                t._take(ev)
            elif event.startswith(b"event: error"):
                t.opaque = True
        return t

    def _take(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        if kind == "message_start" and isinstance(ev.get("message"), dict):
            msg = ev["message"]
            self.id = msg.get("id") if isinstance(msg.get("id"), str) else None
            self.model = msg.get("model") if isinstance(msg.get("model"), str) else None
            usage = msg.get("usage")
            if isinstance(usage, dict):
                self.input_tokens = token_count(usage.get("input_tokens"))
        elif kind == "content_block_start":
            block = ev.get("content_block")
            if self.block is not None or self.text or not isinstance(block, dict) or block.get("type") != _TEXT_BLOCK:
                self.opaque = True
            else:
                self.block = _index_of(ev)
        elif kind == "content_block_delta":
            delta = ev.get("delta")
            text = delta.get("text") if isinstance(delta, dict) and delta.get("type") == _TEXT_DELTA else None
            if not isinstance(text, str):
                self.opaque = True
            elif text:
                self.text += text
                self.tokens += 1
        elif kind == "content_block_stop":
            self.block, self.finished = None, True
        elif kind == "message_delta":
            delta = ev.get("delta")
            if isinstance(delta, dict) and delta.get("stop_reason") is not None:
                self.finished = True
        elif kind == "message_stop":
            self.finished = True
        elif kind == "error" or "error" in ev:
            self.opaque = True


def messages_continuation_body(data: dict[str, Any], t: MessagesTranscript) -> dict[str, Any] | None:
    """The request that continues ``data``'s answer after ``t``; None when it cannot be continued
    (not a stream, no ``max_tokens`` left, tool use or thinking, an answer that ended, a final
    assistant message of blocks). Before any text it is sent again as it came."""
    if data.get("stream") is not True or t.opaque or t.finished:
        return None
    left = tokens_left(data.get("max_tokens"), t.tokens)
    if left is None:
        return None
    body = {**data, "max_tokens": left}
    if not t.text:
        return body
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        # The client prefilled the answer itself: it goes on in that same message.
        if not isinstance(last.get("content"), str):
            return None
        body["messages"] = [*messages[:-1], {**last, "content": last["content"] + t.text}]
    else:
        body["messages"] = [*messages, {"role": "assistant", "content": t.text}]
    return body


@dataclass(slots=True)
class MessagesSeam:
    """Rewrites a continuing node's Anthropic events into the client's stream (see the module doc)."""

    before: MessagesTranscript
    #: the node that goes on (set when the continuation is dispatched)
    node: str = ""
    #: the continuing node's text block index -> the client's
    _blocks: dict[int, int] | None = None
    _echo_checked: bool = False

    @property
    def note(self) -> bytes:
        """The SSE comment that names the seam (SDKs skip comments)."""
        return b": continued on " + (self.node or "-").encode("utf-8", "replace") + b"\n\n"

    def rewrite(self, whole: bytes) -> bytes:
        """Whole events of the continuing node, as the client gets them."""
        out = bytearray()
        for event in events(whole):
            ev = payload(event)
            if not isinstance(ev, dict) or not isinstance(ev.get("type"), str):
                out += event  # comments, pings without data, a node's own error frame
                continue
            kept = self._event(ev)
            if kept is not None:
                out += b"event: " + kept["type"].encode() + b"\ndata: " + orjson.dumps(kept) + b"\n\n"
        return bytes(out)

    def _event(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        b, kind = self.before, ev["type"]
        if b.id is None:  # the client had no message yet: this node's is its first
            return ev
        if kind == "message_start":
            return None
        index = _index_of(ev)
        if kind == "content_block_start":
            if self._blocks is None and b.block is not None:
                self._blocks = {index: b.block}  # the client's block goes on
                return None
            ev["index"] = self._index(index)
            return ev
        if kind in ("content_block_delta", "content_block_stop"):
            ev["index"] = self._index(index)
            if kind == "content_block_delta":
                return self._unechoed(ev)
            return ev
        if kind == "message_delta" and isinstance(ev.get("usage"), dict):
            usage = dict(ev["usage"])
            usage["output_tokens"] = token_count(usage.get("output_tokens")) + b.tokens
            ev["usage"] = usage
        return ev

    def _index(self, index: int) -> int:
        blocks = self._blocks or {}
        return blocks.get(index, index)

    def _unechoed(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        """The first text delta without the text so far, if the node repeated it (llama.cpp)."""
        if self._echo_checked:
            return ev
        delta = ev.get("delta")
        if not isinstance(delta, dict) or not isinstance(delta.get("text"), str):
            return ev
        self._echo_checked = True
        said = self.before.text
        if said and delta["text"].startswith(said):
            rest = delta["text"][len(said):]
            if not rest:
                return None
            ev["delta"] = {**delta, "text": rest}
        return ev


def _index_of(ev: dict[str, Any]) -> int:
    index = ev.get("index")
    return index if isinstance(index, int) and not isinstance(index, bool) else 0
