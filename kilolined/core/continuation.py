"""Streams that survive their node: the pure part (docs/API.md "Streams that survive their node").

When an OpenAI stream's node fails after the client got bytes, the gateway asks another node to
continue the answer. Three pieces, no I/O:

- ``Transcript.read``: what the client got so far (its SSE bytes): the stream's ``id``,
  ``model`` and ``created``, the text, how many tokens made it, whether it already finished.
- ``continuation_body``: the request that continues it: a chat with the text so far as a final
  assistant message to be continued (``continue_final_message: true, add_generation_prompt:
  false``, which vLLM, SGLang and llama.cpp read), a completion with the text appended to its
  prompt, ``max_tokens`` (and ``max_completion_tokens``) less what was generated.
- ``Seam``: the continuing node's events as the client's stream goes on: whole events only, under
  the first node's ``id``, ``model`` and ``created``, without the role-only opener (the client had
  it), ``usage`` summed with what came before; an SSE comment names the seam first.

``StreamKeeper`` holds what went out (whole events only, so that a seam never falls inside an
event) and passes the continuing node's events through its seam.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

#: what the body asks of the node so that it continues the last message instead of answering it
CONTINUE_FIELDS = {"continue_final_message": True, "add_generation_prompt": False}
_USAGE_COUNTS = ("prompt_tokens", "completion_tokens")


def _event_end(data: bytes) -> int:
    """The end of the last whole event in ``data`` (0: none); an event ends with a blank line."""
    return max(data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0,
               data.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in data else 0)


def events(data: bytes) -> list[bytes]:
    """The events of whole SSE bytes, each with its blank line."""
    out, start = [], 0
    text = data.replace(b"\r\n", b"\n")
    while (end := text.find(b"\n\n", start)) >= 0:
        out.append(text[start:end + 2])
        start = end + 2
    return out


def payload(event: bytes) -> Any:
    """The JSON of an event's ``data:`` lines, or None (a comment, ``[DONE]``, not JSON)."""
    lines = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    if not lines:
        return None
    try:
        return orjson.loads(b"\n".join(lines))
    except orjson.JSONDecodeError:
        return None


@dataclass(slots=True)
class Transcript:
    """What a client got of an OpenAI stream, read from its bytes."""

    id: str | None = None
    model: str | None = None
    created: int | None = None
    text: str = ""
    #: content events that reached the client: the tokens generated so far (servers send one token
    #: per event by default: llama.cpp, vLLM, SGLang)
    tokens: int = 0
    #: a ``finish_reason`` came: the answer is complete, only its tail (usage, ``[DONE]``) is missing
    finished: bool = False
    done: bool = False  # ``data: [DONE]`` came
    #: something that text cannot carry on: tool calls, reasoning, several choices, an error
    opaque: bool = False
    usage: dict[str, Any] | None = None

    @classmethod
    def read(cls, sent: bytes) -> Transcript:
        t = cls()
        for event in events(sent):
            if b"[DONE]" in event and payload(event) is None:
                t.done = True
                continue
            t._take(payload(event))
        return t

    def _take(self, ev: Any) -> None:
        if not isinstance(ev, dict):
            return
        if "error" in ev:
            self.opaque = True
        if self.id is None and isinstance(ev.get("id"), str):
            self.id = ev["id"]
        if self.model is None and isinstance(ev.get("model"), str):
            self.model = ev["model"]
        if self.created is None and isinstance(ev.get("created"), int):
            self.created = ev["created"]
        if isinstance(ev.get("usage"), dict):
            self.usage = ev["usage"]
        choices = ev.get("choices")
        if not isinstance(choices, list):
            return
        for c in choices:
            if not isinstance(c, dict):
                continue
            if c.get("index", 0) != 0:
                self.opaque = True  # n > 1: one text cannot stand for several answers
                continue
            delta = c.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else c.get("text")
            if isinstance(delta, dict) and (delta.get("tool_calls") or delta.get("reasoning_content")
                                            or delta.get("function_call")):
                self.opaque = True
            if isinstance(piece, str) and piece:
                self.text += piece
                self.tokens += 1
            if c.get("finish_reason") is not None:
                self.finished = True


def tokens_left(limit: Any, used: int) -> int | None:
    """A token limit less what was generated; None when it leaves nothing (or is not a limit)."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        return None
    left = limit - used
    return left if left >= 1 else None


def continuation_body(data: dict[str, Any], t: Transcript, chat: bool) -> dict[str, Any] | None:
    """The request that continues ``data``'s answer after ``t``; None when it cannot be continued
    (not a stream, several choices, tool calls or reasoning, a prompt of token ids, no budget left,
    a trailing assistant message the client did not ask to continue). Before any text there is
    nothing to continue: the request is sent again as it came (the seam keeps the stream one)."""
    if data.get("stream") is not True or t.opaque or t.finished:
        return None
    if data.get("n", 1) not in (1, None) or data.get("best_of", 1) not in (1, None) or data.get("echo") is True:
        return None
    body = dict(data)
    for name in ("max_tokens", "max_completion_tokens"):
        if data.get(name) is not None:
            left = tokens_left(data[name], t.tokens)
            if left is None:
                return None
            body[name] = left
    # Every continuation reports its usage: the seam sums it (and strips it again for a client
    # that did not ask, as for the first node).
    opts = data.get("stream_options")
    body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    if not t.text:
        return body
    if not chat:
        prompt = data.get("prompt")
        if isinstance(prompt, str):
            body["prompt"] = prompt + t.text
        elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            body["prompt"] = [prompt[0] + t.text]
        else:
            return None
        return body
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if isinstance(last, dict) and last.get("role") == "assistant":
        # The client prefilled the answer itself: it goes on in that same message.
        if not data.get("continue_final_message") or not isinstance(last.get("content"), str):
            return None
        body["messages"] = [*messages[:-1], {**last, "content": last["content"] + t.text}]
    else:
        body["messages"] = [*messages, {"role": "assistant", "content": t.text}]
    body.update(CONTINUE_FIELDS)
    return body


@dataclass(slots=True)
class Seam:
    """Rewrites a continuing node's events into the client's stream (see the module doc)."""

    before: Transcript
    #: the node that goes on (set when the continuation is dispatched)
    node: str = ""
    _opened: bool = False

    @property
    def note(self) -> bytes:
        """The SSE comment that names the seam (SDKs skip comments)."""
        return b": continued on " + (self.node or "-").encode("utf-8", "replace") + b"\n\n"

    def rewrite(self, whole: bytes) -> bytes:
        """Whole events of the continuing node, as the client gets them."""
        out = bytearray()
        for event in events(whole):
            ev = payload(event)
            if not isinstance(ev, dict):
                out += event  # comments, [DONE]
                continue
            kept = self._event(ev)
            if kept is not None:
                out += b"data: " + orjson.dumps(kept) + b"\n\n"
        return bytes(out)

    def _event(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        b = self.before
        for name, value in (("id", b.id), ("model", b.model), ("created", b.created)):
            if value is not None and name in ev:
                ev[name] = value
        usage = ev.get("usage")
        if isinstance(usage, dict):
            ev["usage"] = self._summed(usage)
        choices = ev.get("choices")
        if isinstance(choices, list) and not self._opened and b.id is not None:  # the client had an event
            for c in choices:
                delta = c.get("delta") if isinstance(c, dict) else None
                if isinstance(delta, dict):
                    delta.pop("role", None)  # the client got its role at the start of the stream
            if not isinstance(usage, dict) and all(_empty(c) for c in choices):
                return None  # the opener that carried only the role
            self._opened = True
        return ev

    def _summed(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The continuation's usage plus what the first node(s) did: tokens generated before the
        seam (the content events the client got), and their prompt — reported when the node sent
        usage before it failed, else the continuation's prompt less the text it was given."""
        b = self.before
        prompt, completion = (token_count(usage.get(k)) for k in _USAGE_COUNTS)
        before = b.usage or {}
        done_completion = token_count(before.get("completion_tokens")) or b.tokens
        done_prompt = (token_count(before.get("prompt_tokens")) if b.usage is not None
                       else max(0, prompt - b.tokens))
        out = dict(usage)
        out["prompt_tokens"] = prompt + done_prompt
        out["completion_tokens"] = completion + done_completion
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
        return out


def token_count(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


def _empty(choice: Any) -> bool:
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return not any(v for v in delta.values())
    return not choice.get("text")


class Told(Protocol):
    """What a client got of a stream before its seam, whatever its API's shape."""

    tokens: int


class Seamed(Protocol):
    """A seam of either shape (``Seam``; Anthropic's ``messages_continuation.MessagesSeam``)."""

    node: str

    @property
    def before(self) -> Told: ...

    @property
    def note(self) -> bytes: ...

    def rewrite(self, whole: bytes) -> bytes: ...


@dataclass(slots=True)
class StreamKeeper:
    """What went out of a stream that may be continued: whole events only (a node's piece that
    ends inside an event waits for the rest), and, after a seam, the continuing node's events
    as ``seam`` rewrites them."""

    sent: bytearray = field(default_factory=bytearray)
    part: bytes = b""
    seam: Seamed | None = None
    noted: bool = True  # the seam's note went out (it goes before the continuation's first bytes)

    def feed(self, data: bytes) -> bytes:
        """What the client gets of ``data`` now (the per-token path: one whole event in, out as it came)."""
        if self.part:
            data, self.part = self.part + data, b""
        if data[-2:] != b"\n\n":  # a piece that ends inside an event (or CRLF-framed): cut at the last end
            end = _event_end(data)
            data, self.part = data[:end], data[end:]
        if self.seam is not None:
            data = self.seam.rewrite(data) if data else data
            if not self.noted:
                self.noted = True
                data = self.seam.note + data
        self.sent += data
        return data

    def flush(self) -> bytes:
        """The stream ended: what waited for the rest of its event goes as it is."""
        rest, self.part = self.part, b""
        self.sent += rest
        return rest

    def cut(self) -> bytes:
        """The node failed: what the client has (a partial event the node never finished is
        dropped: the client never got it), for its shape's transcript to read."""
        self.part = b""
        return bytes(self.sent)

    def continue_through(self, seam: Seamed) -> None:
        """The next node's events go through ``seam``, its note first."""
        self.seam, self.noted, self.part = seam, False, b""
