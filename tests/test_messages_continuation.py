"""The pure part of continuing an Anthropic Messages stream (kilolined/core/messages_continuation.py):
what the client got, the request that continues it, and the seam. llama-server (asked directly)
prefills a final assistant message on its Messages endpoint and repeats it in the first delta,
whatever the flags; a server that does not repeat it (Anthropic's own API) goes through as it is."""

from __future__ import annotations

from typing import Any

import orjson

from kilolined.core.messages_continuation import MessagesSeam, MessagesTranscript, messages_continuation_body


def ev(data: dict[str, Any]) -> bytes:
    return b"event: " + data["type"].encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def start(msg_id: str = "msg_1", input_tokens: int = 5) -> bytes:
    usage = {"input_tokens": input_tokens, "output_tokens": 0}
    message = {"id": msg_id, "type": "message", "role": "assistant", "content": [], "model": "m", "usage": usage}
    return ev({"type": "message_start", "message": message})


def block(kind: str = "text", index: int = 0) -> bytes:
    return ev({"type": "content_block_start", "index": index, "content_block": {"type": kind, "text": ""}})


def text(t: str, index: int = 0) -> bytes:
    return ev({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}})


def end(output_tokens: int) -> bytes:
    return (ev({"type": "content_block_stop", "index": 0})
            + ev({"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                  "usage": {"output_tokens": output_tokens}})
            + ev({"type": "message_stop"}))


SENT = start() + block() + text("The") + text(" quick")
BODY = {"model": "m", "max_tokens": 10, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


def test_the_continuation_is_the_text_so_far_as_a_prefilled_assistant_message() -> None:
    t = MessagesTranscript.read(SENT)
    assert (t.id, t.text, t.tokens, t.block, t.finished, t.opaque) == ("msg_1", "The quick", 2, 0, False, False)
    body = messages_continuation_body(BODY, t)
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "The quick"} and body["max_tokens"] == 8
    # A client's own prefill goes on in its message.
    prefilled = {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "Say:"}]}
    body = messages_continuation_body(prefilled, t)
    assert body is not None and body["messages"][-1] == {"role": "assistant", "content": "Say:The quick"}


def test_what_text_cannot_carry_on_is_not_continued() -> None:
    tool = start() + ev({"type": "content_block_start", "index": 0,
                         "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}}})
    for sent in (tool, SENT + end(2), start() + block("thinking")):
        assert messages_continuation_body(BODY, MessagesTranscript.read(sent)) is None, sent
    assert messages_continuation_body({**BODY, "max_tokens": 2}, MessagesTranscript.read(SENT)) is None


def test_the_seam_keeps_one_message_and_drops_a_repeated_prefill() -> None:
    seam = MessagesSeam(MessagesTranscript.read(SENT), node="b")
    # llama-server: the continuation's own start, its block's, then the prefill repeated before " brown".
    out = seam.rewrite(start("msg_2", 7) + block() + text("The quick brown") + text(" fox") + end(2))
    got = MessagesTranscript.read(SENT + out)
    assert got.text == "The quick brown fox" and got.id == "msg_1"
    kinds = [orjson.loads(line[6:])["type"] for line in out.split(b"\n") if line.startswith(b"data: ")]
    assert kinds == ["content_block_delta", "content_block_delta", "content_block_stop", "message_delta",
                     "message_stop"]
    assert b'"output_tokens":4' in out  # 2 before the seam, 2 after
    # A server that does not repeat the prefill: its text goes on as it came.
    plain = MessagesSeam(MessagesTranscript.read(SENT)).rewrite(start() + block() + text(" brown"))
    assert MessagesTranscript.read(SENT + plain).text == "The quick brown"
