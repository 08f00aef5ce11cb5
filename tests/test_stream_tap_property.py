"""The relay's per-token path (``relay_tap`` → ``StreamParser.pass_on``): a whole standard content
event is counted from its bytes, without a JSON parse. Whatever the servers' spellings (vLLM's
compact JSON, Ollama's role first, OpenAI's ``"usage": null`` on every token, llama.cpp's timings,
a serializer with blanks or ``\\u`` escapes, keys spelled with them, text that quotes the keys it
looks for) and however the stream is cut into reads, it reads what a full parse of every data line
reads (content chunks, usage, timings) and passes on exactly what a line-by-line cut of the
gateway's usage leaves (the node's own fields of that chunk stay)."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kilolined.adapters.openai import StreamParser, UsageStripper, relay_tap
from kilolined.wire.proxy import Observer

texts = st.sampled_from(["", "x", " grup", "tok1 ", "\n", '"', "\\", '\\"', '"usage"', '"delta":{"content":"',
                         '"timings"', "é", "data: x", '","content":""'])
deltas = st.one_of(
    st.fixed_dictionaries({"content": texts}),  # vLLM, llama.cpp: the text first
    st.fixed_dictionaries({"role": st.just("assistant"), "content": texts}),  # Ollama, a first chunk
    st.fixed_dictionaries({"content": st.one_of(st.none(), texts)},
                          optional={"tool_calls": st.sampled_from([[], [{"id": "c"}]]), "reasoning_content": texts}),
    st.fixed_dictionaries({"reasoning_content": texts}),
    st.just({}))
choices = st.fixed_dictionaries({"index": st.just(0), "delta": deltas},
                                optional={"finish_reason": st.sampled_from([None, "stop"]),
                                          "logprobs": st.sampled_from([None, {"content": [{"token": "x"}]}])})
legacy = st.fixed_dictionaries({"index": st.just(0), "text": texts})
events = st.fixed_dictionaries(
    {"id": st.just("chatcmpl-1"), "object": st.just("chat.completion.chunk"),
     "choices": st.one_of(st.lists(choices, min_size=1, max_size=2), st.lists(legacy, max_size=1))},
    optional={"usage": st.one_of(st.none(), st.fixed_dictionaries({"total_tokens": st.integers(0, 99)})),
              "timings": st.fixed_dictionaries({"predicted_n": st.integers(0, 9)}),
              'a "delta': st.just({"content": "y"})})  # a key that ends in a quoted "delta"
usage_only = st.builds(lambda n, more: {"id": "chatcmpl-1", "choices": [],
                                       "usage": {"prompt_tokens": 3, "total_tokens": n}, **more},
                       st.integers(0, 99),
                       # llama.cpp moves its timings onto the usage chunk when usage is asked for
                       st.sampled_from([{}, {"model": "m"}, {"timings": {"predicted_n": 4}}]))


def escaped_keys(d: Any) -> bytes:
    """A serializer that spells the keys ``usage`` and ``timings`` with ``\\u`` escapes (JSON
    allows any character so spelled): the same document to every parser."""
    return (orjson.dumps(d).replace(b'"usage":', b'"\\u0075sage":')
            .replace(b'"timings":', b'"timin\\u0067s":'))


spellings = st.sampled_from([orjson.dumps, lambda d: json.dumps(d).encode(),
                             lambda d: json.dumps(d, separators=(",", ":")).encode(), escaped_keys])
ENVELOPE = {"id", "object", "created", "model", "choices", "usage"}


@st.composite
def sse_events(draw: Any) -> bytes:
    """One event as a server writes it: its lines and the blank line that ends it."""
    kind = draw(st.sampled_from(["event"] * 6 + ["usage", "done", "comment"]))
    if kind == "done":
        return b"data: [DONE]\n\n"
    if kind == "comment":
        return b": keep-alive\n\n"
    doc = draw(events) if kind == "event" else draw(usage_only)
    return b"data:" + draw(st.sampled_from([b" ", b""])) + draw(spellings)(doc) + b"\n\n"


def reference(stream: bytes) -> tuple[int, Any, Any, bytes]:
    """The whole stream at once, one line at a time: every data line parsed on its own, and what
    is left once the usage of each usage-only event is cut out: the event goes (with the blank
    line after it) when only the envelope is left of it, else it stays without its usage."""
    chunks, usage, timings = 0, None, None
    kept, drop_blank = [], False
    for line in stream.split(b"\n")[:-1]:
        if drop_blank and not line.strip():
            drop_blank = False
            continue
        drop_blank = False
        ev: Any = None
        if line.startswith(b"data:"):
            try:
                ev = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                ev = None
        if isinstance(ev, dict):
            if isinstance(ev.get("timings"), dict):
                timings = ev["timings"]
            if isinstance(ev.get("usage"), dict):
                usage = ev["usage"]
                if ev.get("choices") == []:
                    rest = {k: v for k, v in ev.items() if k != "usage"}
                    if set(rest) <= ENVELOPE:
                        drop_blank = True
                        continue
                    kept.append(b"data: " + orjson.dumps(rest) + b"\n")
                    continue
            cs = ev.get("choices")
            if isinstance(cs, list) and any(
                    isinstance(c, dict) and ((isinstance(c.get("delta"), dict) and any(
                        c["delta"].get(k) for k in ("content", "tool_calls", "reasoning_content"))) or c.get("text"))
                    for c in cs):
                chunks += 1
        kept.append(line + b"\n")
    return chunks, usage, timings, b"".join(kept)


@settings(max_examples=250, deadline=None)
@given(st.lists(sse_events(), min_size=1, max_size=12), st.lists(st.integers(1, 90), max_size=6),
       st.sampled_from(["one event a read", "whole events a read", "cut anywhere"]), st.booleans())
def test_the_per_token_path_reads_and_passes_what_a_full_parse_does(
        evs: list[bytes], cuts: list[int], reading: str, strip: bool) -> None:
    # A first comment: a first read of one byte could not tell a stream from a JSON body.
    evs = [b": ok\n\n", *evs]
    stream = b"".join(evs)
    # A node writes one event per write (the reads the per-token path takes); a gateway that
    # lags reads several whole events at once; or the reads are cut anywhere.
    reads = list(evs)
    if reading == "whole events a read":
        reads, at = [], 0
        for n in cuts:
            reads.append(b"".join(evs[at:at + n % 4 + 1]))
            at += n % 4 + 1
        reads.append(b"".join(evs[at:]))
    elif reading == "cut anywhere":
        reads, at = [], 0
        for n in cuts:
            reads.append(stream[at:at + n])
            at += n
        reads.append(stream[at:])
    parser = StreamParser()
    stripper = UsageStripper() if strip else None
    tap = relay_tap(parser, stripper)
    out = b"".join(tap(r) for r in reads if r) + (stripper.flush() if stripper else b"")
    parser.done(True)
    want_chunks, want_usage, want_timings, want_kept = reference(stream)
    assert (parser.chunks, parser.usage, parser.timings) == (want_chunks, want_usage, want_timings)
    assert (parser.first_at is not None) == (want_chunks > 0)
    assert out == (want_kept if strip else stream)


VLLM_TOKEN = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
              b'"choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null,"finish_reason":null}]}\n\n')
OPENAI_TOKEN = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,'
                b'"delta":{"content":"tok"},"finish_reason":null}],"usage":null}\n\n')


def test_a_standard_token_is_counted_without_a_parse() -> None:
    """The per-token path is the one taken (it is what the relay's CPU per chunk rests on): a
    vLLM or OpenAI token reaches neither the full parser nor the stripper's line split."""
    class Counted(StreamParser):
        full = 0

        def _feed(self, chunk: bytes) -> None:
            self.full += 1
            super()._feed(chunk)

    class Strip(UsageStripper):
        split = 0

        def feed(self, chunk: bytes) -> bytes:
            self.split += 1
            return super().feed(chunk)

    p, s = Counted(), Strip()
    tap = relay_tap(p, s)
    assert tap(b": ping\n\n") == b": ping\n\n"  # the first read tells a stream from a JSON body
    full, split = p.full, s.split
    for token in (VLLM_TOKEN, OPENAI_TOKEN) * 3:
        assert tap(token) == token
    assert tap(VLLM_TOKEN * 3) == VLLM_TOKEN * 3  # a lagging gateway's read of three
    assert (p.full, s.split, p.chunks) == (full, split, 9)


def test_relay_tap_without_a_parser_feeds_the_observer_and_cuts_usage() -> None:
    """Any other observer (a tee of two) still sees every byte, and the usage chunk is still cut."""
    seen: list[bytes] = []

    class Seen(Observer):
        def feed(self, chunk: bytes) -> None:
            seen.append(chunk)

    usage = b'data: {"choices":[],"usage":{"total_tokens":3}}\n\n'
    tap = relay_tap(Seen(), UsageStripper())
    assert tap(VLLM_TOKEN) + tap(usage) + tap(b"data: [DONE]\n\n") == VLLM_TOKEN + b"data: [DONE]\n\n"
    assert b"".join(seen) == VLLM_TOKEN + usage + b"data: [DONE]\n\n"


def test_a_usage_key_spelled_with_an_escape_is_read_and_cut() -> None:
    """``"\\u0075sage"`` is ``"usage"`` to the client's parser: the per-token path reads it (it
    counts against the budget) and the cut takes a usage-only chunk so spelled."""
    token = VLLM_TOKEN.replace(b'"choices"', b'"\\u0075sage":{"total_tokens":604},"choices"')
    p = StreamParser()
    tap = relay_tap(p, UsageStripper())
    tap(b": ping\n\n")
    assert tap(token) == token and p.usage == {"total_tokens": 604} and p.chunks == 1
    usage = b'data: {"id":"chatcmpl-1","choices":[],"\\u0075sage":{"total_tokens":604}}\n\n'
    assert tap(usage) == b"" and tap(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"
