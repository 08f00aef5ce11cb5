"""The pure part of continuing a stream (kilolined/core/continuation.py): what the client got, the
request that continues it, and the seam — the body each server needs, read from their source:

- vLLM (vllm/entrypoints/openai/chat_completion/protocol.py): ``add_generation_prompt`` defaults
  to true, ``continue_final_message`` to false, both true is a 400; without the flag a trailing
  assistant message gets a new assistant turn after it (a new answer, not a continuation).
- SGLang (python/sglang/srt/entrypoints/openai/serving_chat.py, ``_handle_last_assistant_message``):
  with the flag the last assistant message's tokens end the prompt; without it that message is
  turned into a user message.
- llama.cpp (tools/server/server-common.cpp, server-task.cpp): a trailing assistant message is
  prefilled even without the flag, but then the first delta repeats it; with the flag it is not
  repeated; both flags true is a 400.
So the continuation always carries ``continue_final_message: true, add_generation_prompt: false``.
"""

from __future__ import annotations

import orjson

from kilolined.core.continuation import CONTINUE_FIELDS, Seam, StreamKeeper, Transcript, continuation_body


def event(text: str | None = None, finish: str | None = None, role: bool = False, **top: object) -> bytes:
    delta: dict[str, object] = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    ev = {"id": "c1", "object": "chat.completion.chunk", "created": 7, "model": "m",
          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **top}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


SENT = event("", role=True) + event("The") + event(" quick")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 10,
        "max_completion_tokens": 9}


def test_the_transcript_is_what_the_client_got() -> None:
    t = Transcript.read(SENT)
    assert (t.id, t.model, t.created, t.text, t.tokens) == ("c1", "m", 7, "The quick", 2)
    assert not t.finished and not t.opaque


def test_a_chat_continues_its_text_as_a_final_assistant_message() -> None:
    body = continuation_body(CHAT, Transcript.read(SENT), chat=True)
    assert body is not None
    assert body["messages"][-1] == {"role": "assistant", "content": "The quick"}
    assert body["max_tokens"] == 8 and body["max_completion_tokens"] == 7
    assert {k: body[k] for k in CONTINUE_FIELDS} == CONTINUE_FIELDS
    assert body["stream_options"] == {"include_usage": True}
    assert CHAT["messages"] == [{"role": "user", "content": "hi"}]  # the client's body is left as it was


def test_a_completion_continues_its_prompt() -> None:
    sent = b"".join(b"data: " + orjson.dumps({"id": "x", "choices": [{"index": 0, "text": w}]}) + b"\n\n"
                    for w in ("Once", " more"))
    body = continuation_body({"prompt": ["Say:"], "stream": True, "max_tokens": 5}, Transcript.read(sent), chat=False)
    assert body is not None and body["prompt"] == ["Say:Once more"] and body["max_tokens"] == 3
    assert "continue_final_message" not in body


def test_what_cannot_be_continued_is_not() -> None:
    t = Transcript.read(SENT)
    assert continuation_body({**CHAT, "n": 2}, t, chat=True) is None
    assert continuation_body({**CHAT, "max_tokens": 2}, t, chat=True) is None  # nothing left to generate
    assert continuation_body({**CHAT, "stream": False}, t, chat=True) is None
    assert continuation_body({"prompt": [1, 2, 3], "stream": True}, t, chat=False) is None  # token ids
    called = SENT + b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [{}]}}]}) + b"\n\n"
    assert continuation_body(CHAT, Transcript.read(called), chat=True) is None
    assert continuation_body(CHAT, Transcript.read(SENT + event("", finish="stop")), chat=True) is None
    # A client's own trailing assistant message goes on only when it asked for that itself.
    prefilled = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Well,"}]}  # type: ignore[list-item]
    assert continuation_body(prefilled, t, chat=True) is None
    body = continuation_body({**prefilled, **CONTINUE_FIELDS}, t, chat=True)
    assert body is not None and body["messages"][-1] == {"role": "assistant", "content": "Well,The quick"}


def test_the_seam_keeps_the_first_identity_drops_the_opener_and_sums_usage() -> None:
    keeper = StreamKeeper()
    assert keeper.feed(SENT[:-5]) == SENT[:_last_end(SENT[:-5])]  # a piece ending inside an event waits
    keeper.cut()  # the node died: the half event never reached the client
    t = Transcript.read(bytes(keeper.sent))
    assert t.text == "The"
    keeper.continue_through(Seam(t, node="b"))
    node_b = (event("", role=True, id="c2", created=9) + event(" quick", id="c2", created=9)
              + event(None, finish="length", id="c2", created=9)
              + b"data: " + orjson.dumps({"id": "c2", "created": 9, "model": "m", "choices": [],
                                          "usage": {"prompt_tokens": 5, "completion_tokens": 2}}) + b"\n\n"
              + b"data: [DONE]\n\n")
    out = keeper.feed(node_b)
    assert out.startswith(b": continued on b\n\n")
    events = [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert [e["id"] for e in events] == ["c1"] * 3 and {e["created"] for e in events} == {7}
    assert events[0]["choices"][0]["delta"] == {"content": " quick"}  # no second role
    assert events[-1]["usage"] == {"prompt_tokens": 5 + 4, "completion_tokens": 3, "total_tokens": 12}
    assert out.endswith(b"data: [DONE]\n\n")
    assert Transcript.read(bytes(keeper.sent)).text == "The quick"


def test_crlf_framed_events_pass_whole() -> None:
    keeper = StreamKeeper()
    crlf = event("The").replace(b"\n", b"\r\n")
    assert keeper.feed(crlf[:-3]) == b"" and keeper.feed(crlf[-3:]) == crlf
    assert Transcript.read(bytes(keeper.sent)).text == "The"


def _last_end(data: bytes) -> int:
    return data.rfind(b"\n\n") + 2


def test_before_any_text_the_request_goes_again_as_it_came() -> None:
    body = continuation_body(CHAT, Transcript.read(event("", role=True)), chat=True)
    assert body is not None and body["messages"] == CHAT["messages"] and body["max_tokens"] == 10
    assert "continue_final_message" not in body
    # Nothing reached the client: the next node's opener is the client's first event, role and all.
    keeper = StreamKeeper()
    keeper.continue_through(Seam(Transcript.read(b""), node="b"))
    out = keeper.feed(event("", role=True) + event("The"))
    assert b'"role":"assistant"' in out
