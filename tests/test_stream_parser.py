"""The OpenAI stream parser reads usage, timings and content chunks the same however the node's
bytes are cut into reads: whole events, lines split mid-way, CRLF line ends, indented fields."""

from __future__ import annotations

import orjson
import pytest

from kilolined.adapters.openai import StreamParser


def _event(obj: object, eol: bytes = b"\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + eol + eol


def _stream(eol: bytes) -> bytes:
    parts = [b": keep-alive" + eol + eol]
    parts += [_event({"choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}, eol) for i in range(5)]
    parts.append(_event({"choices": [{"index": 0, "delta": {}}]}, eol))  # no content: not counted
    parts.append(b"  " + _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5,
                                                            "total_tokens": 8}}, eol))
    parts.append(b"data: [DONE]" + eol + eol)
    return b"".join(parts)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"])
@pytest.mark.parametrize("cut", [0, 1, 7, 64])
def test_the_same_reading_whatever_the_reads(eol: bytes, cut: int) -> None:
    data = _stream(eol)
    p = StreamParser()
    reads = [data] if cut == 0 else [data[i:i + cut] for i in range(0, len(data), cut)]
    for r in reads:
        p.feed(r)
    p.done(True)
    assert p.stream is True
    assert p.chunks == 5
    assert p.usage == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert p.tokens() == 8
    assert p.first_at is not None
    assert not p.buf  # nothing left over once every line has ended


def test_a_line_that_has_not_ended_waits_for_the_rest() -> None:
    ev = _event({"choices": [{"delta": {"content": "x"}}], "timings": {"predicted_n": 4}})
    p = StreamParser()
    p.feed(ev[:20])
    assert p.chunks == 0 and p.timings is None
    p.feed(ev[20:])
    assert p.chunks == 1 and p.timings == {"predicted_n": 4}
