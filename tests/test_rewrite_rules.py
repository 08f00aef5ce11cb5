"""The pure rules of rewriting (kilolined.core.rewrite, kilolined.core.forms.replace_field): what a
body becomes, a form's model renamed with its file untouched, and an answer's ``"model"``
members given back the client's name however a stream is cut into pieces."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given
from hypothesis import strategies as st

from kilolined.core.config import RewriteConfig
from kilolined.core.forms import form_field, replace_field
from kilolined.core.rewrite import ModelRename, rewrite_body, rewrite_doc

RW = RewriteConfig(model={"gpt-4o": "qwen"}, default={"max_tokens": 512}, set={"temperature": 0.6},
                   strip=["user"])


def test_each_rule() -> None:
    doc = {"model": "gpt-4o", "user": "u", "temperature": 1}
    assert rewrite_doc(doc, RW) == {"model": "qwen", "max_tokens": 512, "temperature": 0.6}
    assert doc == {"model": "gpt-4o", "user": "u", "temperature": 1}  # the client's parse is not changed
    assert rewrite_doc({"model": "qwen", "max_tokens": 9, "temperature": 0.6}, RW) is None  # nothing to do


def form(model: str, audio: bytes) -> tuple[bytes, str]:
    b = "xYz-boundary"
    body = (f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            'Content-Type: audio/wav\r\n\r\n').encode() + audio + \
        (f'\r\n--{b}\r\nContent-Disposition: form-data; name="model"\r\n\r\n{model}\r\n--{b}--\r\n').encode()
    return body, f"multipart/form-data; boundary={b}"


@given(st.binary(max_size=300).filter(lambda a: b"xYz-boundary" not in a))
def test_a_forms_model_is_renamed_and_its_file_kept(audio: bytes) -> None:
    body, ctype = form("whisper-1", audio)
    new = replace_field(body, ctype, "model", {"whisper-1": "large-v3"})
    assert new is not None and form_field(new, ctype, "model") == "large-v3"
    assert new == form("large-v3", audio)[0]
    assert rewrite_body(body, None, ctype, RewriteConfig(model={"other": "x"})) is None


STREAM = (b'data: {"id":"1","model":"qwen","choices":[{"delta":{"content":"say \\"model\\":\\"qwen\\""}}]}\n\n'
          b'data: {"id":"1", "model" : "qwen", "choices":[]}\n\n'
          b'event: message_start\ndata: {"type":"message_start","message":{"id":"m","model":"qwen"}}\n\n'
          b"data: [DONE]\n\n")


def renamed_whole() -> bytes:
    r = ModelRename('gpt-4o "mini"', sse=True)
    return r.feed(STREAM) + r.flush()


def test_every_model_member_and_nothing_else() -> None:
    out = renamed_whole()
    events = [orjson.loads(line[6:]) for line in out.split(b"\n") if line.startswith(b"data: {")]
    assert [e.get("model", e.get("message", {}).get("model")) for e in events] == ['gpt-4o "mini"'] * 3
    assert events[0]["choices"][0]["delta"]["content"] == 'say "model":"qwen"'  # text is never touched


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=8))
def test_any_cut_of_the_stream_gives_the_same_bytes(cuts: list[int]) -> None:
    r = ModelRename('gpt-4o "mini"', sse=True)
    at = [0, *sorted(set(cuts)), len(STREAM)]
    out = b"".join(r.feed(STREAM[a:b]) for a, b in itertools.pairwise(at)) + r.flush()
    assert out == renamed_whole()
    r = ModelRename('gpt-4o "mini"', sse=True)
    tap = r.after(lambda chunk: chunk)  # the relay's per-token path
    assert b"".join(tap(STREAM[a:b]) for a, b in itertools.pairwise(at)) + r.flush() == renamed_whole()


def test_a_json_body_is_renamed_at_its_end() -> None:
    r = ModelRename("gpt-4o", sse=False)
    assert r.feed(b'{"model": "qw') == b""
    assert r.feed(b'en", "x": 1}') == b""
    assert orjson.loads(r.flush()) == {"model": "gpt-4o", "x": 1}
