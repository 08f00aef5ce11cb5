"""The OpenAI stream parser (the per-token path of every relayed LLM stream) reads exactly what a
plain line-by-line reading of the whole stream reads — content chunks, usage, timings — whatever
the events, the line ends, the indentation and the way the node's bytes are cut into reads."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kilolined.adapters.openai import StreamParser

texts = st.sampled_from(["", "x", " grup", "tok1 ", "\n", "\"usage\""])
deltas = st.one_of(
    st.fixed_dictionaries({}, optional={"content": st.one_of(texts, st.none()), "role": st.just("assistant"),
                                        "tool_calls": st.sampled_from([[], [{"id": "c"}]]),
                                        "reasoning_content": texts}),
    st.none(), st.just("content"), st.just([]))
choices = st.one_of(
    st.fixed_dictionaries({"index": st.just(0)}, optional={"delta": deltas, "text": st.one_of(texts, st.none()),
                                                           "finish_reason": st.sampled_from([None, "stop"])}),
    st.none(), st.just("choice"))
events = st.fixed_dictionaries({}, optional={
    "choices": st.one_of(st.lists(choices, max_size=3), st.none(), st.just({"0": {}})),
    "usage": st.one_of(st.none(), st.fixed_dictionaries({"total_tokens": st.integers(0, 99)})),
    "timings": st.one_of(st.none(), st.just("t"), st.fixed_dictionaries({"predicted_n": st.integers(0, 9)})),
    "object": st.just("chat.completion.chunk")})


@st.composite
def lines(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["event", "event", "event", "comment", "blank", "done", "field", "junk"]))
    indent = draw(st.sampled_from([b"", b"", b" ", b"\t", b"  "]))
    if kind == "event":
        return indent + b"data:" + draw(st.sampled_from([b"", b" "])) + orjson.dumps(draw(events))
    return {"comment": b": keep-alive", "blank": b"", "done": indent + b"data: [DONE]", "field": b"event: x",
            "junk": indent + b"data: {not json"}[kind]


def reference(stream: bytes) -> tuple[int, Any, Any]:
    """The whole stream at once, one line at a time, every data line parsed on its own."""
    chunks, usage, timings = 0, None, None
    for line in stream.split(b"\n")[:-1]:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        try:
            ev = orjson.loads(line[5:])
        except orjson.JSONDecodeError:
            continue
        if not isinstance(ev, dict):
            continue
        if isinstance(ev.get("usage"), dict):
            usage = ev["usage"]
        if isinstance(ev.get("timings"), dict):
            timings = ev["timings"]
        cs = ev.get("choices")
        if isinstance(cs, list) and any(
                isinstance(c, dict) and ((isinstance(c.get("delta"), dict) and any(
                    c["delta"].get(k) for k in ("content", "tool_calls", "reasoning_content"))) or c.get("text"))
                for c in cs):
            chunks += 1
    return chunks, usage, timings


@settings(max_examples=150, deadline=None)
@given(st.lists(lines(), min_size=1, max_size=12), st.sampled_from([b"\n", b"\r\n"]),
       st.lists(st.integers(1, 80), max_size=8))
def test_every_read_split_reads_the_same_as_the_whole_stream(body: list[bytes], eol: bytes, cuts: list[int]) -> None:
    stream = b": hello" + eol + b"".join(line + eol for line in body)
    p = StreamParser()
    at = 0
    for n in cuts:
        p.feed(stream[at:at + n])
        at += n
    if at < len(stream):
        p.feed(stream[at:])
    p.done(True)
    want_chunks, want_usage, want_timings = reference(stream)
    assert (p.chunks, p.usage, p.timings) == (want_chunks, want_usage, want_timings)
    assert (p.first_at is not None) == (want_chunks > 0)
    assert not p.buf  # every line ended: nothing held back
