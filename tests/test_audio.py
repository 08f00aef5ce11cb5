"""Audio on openai routes (SPEC §19): the `model` of a multipart form (`/v1/audio/transcriptions`)
is read for `match`, routing to a node that serves it and its warm model; a form with no `model`
is refused in OpenAI's shape. The official `openai` SDK sends the form; the node is the simulated
LLM server, which transcribes as vLLM does."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from conftest import KEYS, auth, base_config
from hypothesis import given
from hypothesis import strategies as st
from openai import AsyncOpenAI

from kilolined.core.forms import FormError, form_field

WAV = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(256)) * 4  # the bytes are never read as audio


def client(gw: Any) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)


async def transcribe(c: AsyncOpenAI, model: str) -> tuple[str, str]:
    raw = await c.audio.transcriptions.with_raw_response.create(model=model, file=("a.wav", WAV, "audio/wav"))
    return raw.parse().text, raw.headers["X-KiloLine-Node"]


async def test_the_forms_model_chooses_the_route_and_the_node(fakegpus, gateway) -> None:
    whisper = await fakegpus("openai", step_ms=1, models=["whisper-small", "whisper-large"])
    chat = await fakegpus("openai", step_ms=1)
    cfg = base_config({"w": whisper.url, "c": chat.url}, kind="openai", path="/v1")
    cfg["nodes"]["w"]["models"] = ["whisper-small", "whisper-large"]
    cfg["routes"] = {
        "speech": {"path": "/v1", "kind": "openai", "nodes": ["w"], "match": {"model": ["whisper-*"]}},
        "llm": {"path": "/v1", "kind": "openai", "nodes": ["c"]},
    }
    gw = await gateway(cfg)
    c = client(gw)
    assert await transcribe(c, "whisper-large") == ("The quick brown", "w")
    assert whisper.backend.asked == ["whisper-large"]  # type: ignore[attr-defined]
    # A model the speech route does not match goes by the fallback route, as a JSON body's would.
    assert (await transcribe(c, "other-model"))[1] == "c"
    assert [q["path"] for q in chat.requests if q["path"] != "/health"] == ["/v1/audio/transcriptions"]
    await c.close()


async def test_a_form_reaches_only_a_node_that_serves_its_model(fakegpus, gateway) -> None:
    a = await fakegpus("openai", step_ms=1, models=["whisper-small"])
    b = await fakegpus("openai", step_ms=1, models=["whisper-large"])
    cfg = base_config({"a": a.url, "b": b.url}, kind="openai", path="/v1", max_concurrency=2)
    cfg["routes"]["gen"]["nodes"], cfg["routes"]["gen"]["standby"] = ["a", "b"], []
    cfg["nodes"]["a"]["models"], cfg["nodes"]["b"]["models"] = ["whisper-small"], ["whisper-large"]
    gw = await gateway(cfg)
    c = client(gw)
    for _ in range(3):
        assert (await transcribe(c, "whisper-large"))[1] == "b"
        assert (await transcribe(c, "whisper-small"))[1] == "a"
    await c.close()


async def test_a_form_without_model_is_400_in_openais_shape(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(base_config({"o": fake.url}, kind="openai", path="/v1"))
    form = aiohttp.FormData()
    form.add_field("file", WAV, filename="a.wav", content_type="audio/wav")
    async with http.post(gw.url + "/v1/audio/transcriptions", data=form, headers=auth()) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert err["type"] == "bad_request" and err["code"] == "bad_request" and "model" in err["message"]
    bad = {**auth(), "Content-Type": "multipart/form-data; boundary=xyz"}
    async with http.post(gw.url + "/v1/audio/transcriptions", data=b"not a form", headers=bad) as r:
        assert r.status == 400
        assert "boundary" in (await r.json())["error"]["message"]
    assert not [q for q in fake.requests if q["path"] != "/health"]


def test_form_field_reads_a_text_field_past_the_file() -> None:
    ctype = 'multipart/form-data; boundary="b0undary"'
    body = (b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="x.wav"\r\n'
            b'Content-Type: audio/wav\r\n\r\n' + WAV + b'\r\n--b0undary\r\n'
            b'content-disposition: form-data; name="model"\r\n\r\nwhisper-1\r\n--b0undary--\r\n')
    assert form_field(body, ctype, "model") == "whisper-1"
    assert form_field(body, ctype, "language") is None
    with pytest.raises(FormError):
        form_field(body[:60], ctype, "model")  # cut before the part's end
    with pytest.raises(FormError):
        form_field(body, "multipart/form-data", "model")  # no boundary


@given(body=st.binary(max_size=300), ctype=st.text(max_size=60),
       parts=st.lists(st.sampled_from([b"--b\r\n", b"--b--", b"\r\n\r\n", b"\r\n--b\r\n", b'name="model"',
                                       b"Content-Disposition: form-data; ", b"\xff\xfe", b"model"]), max_size=8))
def test_form_field_answers_or_refuses_any_bytes(body: bytes, ctype: str, parts: list[bytes]) -> None:
    """Whatever a client sends, the field is a string, None, or FormError (400): never a crash (500)."""
    for ct in (ctype, "multipart/form-data; boundary=b", "multipart/form-data; boundary=" + ctype):
        try:
            got = form_field(b"".join(parts) + body, ct, "model")
        except FormError:
            continue
        assert got is None or isinstance(got, str)
