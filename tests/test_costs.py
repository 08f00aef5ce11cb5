"""kilolined.scheduling.costs: a request's cost from its body, headers and route (pure)."""

from __future__ import annotations

import math
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kilolined.core.config import RequestCostConfig
from kilolined.scheduling.costs import UnitError, json_pointer, megapixels, request_cost, request_units, token_estimate


def cost(unit: str | None = None, **kw: Any) -> RequestCostConfig:
    return RequestCostConfig(unit=unit, **kw)


def latent(w: Any, h: Any, b: Any = None) -> dict[str, Any]:
    inputs = {"width": w, "height": h}
    if b is not None:
        inputs["batch_size"] = b
    return {"class_type": "EmptyLatentImage", "inputs": inputs}


def test_megapixels_sums_latents_and_skips_linked_sizes() -> None:
    graph = {"1": latent(1024, 1024, 2), "2": latent(512, 512), "3": latent(["9", 0], 512),
             "4": latent(512, 512, ["7", 0]), "5": {"class_type": "KSampler", "inputs": {"seed": 1}}}
    assert megapixels(graph) == pytest.approx((1024 * 1024 * 2 + 512 * 512 + 512 * 512) / 1e6)
    assert megapixels({}) == 0
    assert megapixels({"1": latent(True, 512)}) == 0  # a boolean is not a number


def test_comfy_prompt_cost_and_other_paths_cost_base() -> None:
    cfg = cost("megapixels", base=4, per_unit=1.5)
    body = orjson.dumps({"prompt": {"1": latent(2048, 2048, 4)}, "client_id": "x"})
    assert request_cost(cfg, "comfyui", "POST", "/prompt", body, {}) == pytest.approx(4 + 1.5 * 2048 * 2048 * 4 / 1e6)
    assert request_cost(cfg, "comfyui", "POST", "/api/prompt?x=1", body, {}) > 4
    assert request_cost(cfg, "comfyui", "POST", "/upload/image", b"--multipart--", {}) == 4
    with pytest.raises(UnitError):
        request_cost(cfg, "comfyui", "POST", "/prompt", b"not json", {})


def test_tokens_estimate_counts_text_only_rounded_once() -> None:
    doc = {"model": "m", "messages": [{"role": "system", "content": "abc"},
                                      {"role": "user", "content": [{"type": "text", "text": "defgh"},
                                                                   {"type": "image_url", "image_url": {}}]}],
           "max_tokens": 10}
    assert token_estimate(doc, 1024) == math.ceil(8 / 4) + 10
    assert token_estimate({"prompt": "x" * 9}, 100) == 3 + 100  # completions, default_max_tokens
    assert token_estimate({"messages": [], "max_completion_tokens": 7}, 100) == 7
    with pytest.raises(UnitError):
        token_estimate({"messages": [], "max_tokens": "lots"}, 100)
    cfg = cost("tokens", per_unit=0.5, default_max_tokens=4)
    assert request_cost(cfg, "openai", "POST", "/v1/chat/completions", orjson.dumps({"prompt": "abcd"}), {}) == 2.5
    assert request_cost(cfg, "openai", "POST", "/v1/embeddings", b"{}", {}) == 0


@pytest.mark.parametrize(("value", "expected"), [(3, 3.0), (2.5, 2.5), (0, 0.0)])
def test_json_pointer_number(value: Any, expected: float) -> None:
    cfg = cost("json:/opts/batch_size")
    assert request_units(cfg, "generic", "POST", "/", orjson.dumps({"opts": {"batch_size": value}}), {}) == expected


@pytest.mark.parametrize("bad", ["4", None, True, {}, [], -1])
def test_json_pointer_unreadable_is_an_error(bad: Any) -> None:
    with pytest.raises(UnitError):
        request_units(cost("json:/n"), "generic", "POST", "/", orjson.dumps({"n": bad}), {})


def test_json_pointer_absent_or_no_body_is_zero_and_non_json_is_an_error() -> None:
    assert request_units(cost("json:/n"), "generic", "POST", "/", b'{"m": 1}', {}) == 0
    assert request_units(cost("json:/n"), "generic", "GET", "/", b"", {}) == 0
    with pytest.raises(UnitError):
        request_units(cost("json:/n"), "generic", "POST", "/", b"<xml/>", {})


def test_rfc6901_escapes_and_arrays() -> None:
    doc = {"a/b": {"m~n": [10, 20]}}
    assert json_pointer(doc, "/a~1b/m~0n/1") == (True, 20)
    assert json_pointer(doc, "/a~1b/m~0n/01") == (False, None)
    assert json_pointer(doc, "/a~1b/m~0n/2") == (False, None)


def test_header_unit() -> None:
    cfg = cost("header:X-Frames", base=1, per_unit=2)
    assert request_cost(cfg, "generic", "POST", "/", b"", {"X-Frames": "3"}) == 7
    assert request_cost(cfg, "generic", "POST", "/", b"", {}) == 1
    for bad in ("three", "-1", "nan", "inf"):
        with pytest.raises(UnitError):
            request_cost(cfg, "generic", "POST", "/", b"", {"X-Frames": bad})


def test_no_cost_config_costs_nothing() -> None:
    assert request_cost(None, "generic", "POST", "/", b"garbage", {}) == 0
    assert request_cost(cost(base=1.5), "generic", "POST", "/", b"garbage", {}) == 1.5


@pytest.mark.parametrize("unit", ["pixels", "json:batch", "header:", "header:a b", "json:/a~2"])
def test_config_refuses_unknown_units(unit: str) -> None:
    with pytest.raises(ValueError):
        RequestCostConfig(unit=unit)


sizes = st.integers(0, 4096)


@given(nodes=st.lists(st.tuples(sizes, sizes, st.integers(1, 8)), max_size=6),
       base=st.floats(0, 10), per=st.floats(0, 5))
def test_megapixel_cost_is_affine_and_additive(nodes: list[tuple[int, int, int]], base: float, per: float) -> None:
    graph = {str(i): latent(w, h, b) for i, (w, h, b) in enumerate(nodes)}
    body = orjson.dumps({"prompt": graph})
    units = sum(w * h * b for w, h, b in nodes) / 1e6
    c = request_cost(cost("megapixels", base=base, per_unit=per), "comfyui", "POST", "/prompt", body, {})
    assert c == pytest.approx(base + per * units)
    assert c >= base


@given(texts=st.lists(st.text(max_size=40), max_size=6), gen=st.integers(0, 5000))
def test_token_estimate_is_monotone_in_text(texts: list[str], gen: int) -> None:
    msgs = [{"role": "user", "content": t} for t in texts]
    est = token_estimate({"messages": msgs, "max_tokens": gen}, 0)
    assert est == math.ceil(sum(len(t) for t in texts) / 4) + gen
    assert token_estimate({"messages": [*msgs, {"role": "user", "content": "more"}], "max_tokens": gen}, 0) >= est


def test_json_chars_counts_the_characters_of_a_string() -> None:
    """A TTS request (OpenAI's /v1/audio/speech) costs by the text it speaks."""
    cfg = cost("json_chars:/input", base=1, per_unit=0.01)
    speech = {"model": "kokoro", "input": "Grüße, world!", "voice": "af_sky"}
    assert request_units(cfg, "openai", "POST", "/v1/audio/speech", orjson.dumps(speech), {}) == 13  # characters
    assert request_cost(cfg, "openai", "POST", "/v1/audio/speech", orjson.dumps(speech), {}) == pytest.approx(1.13)
    assert request_units(cfg, "openai", "POST", "/v1/audio/speech", b'{"model": "kokoro"}', {}) == 0
    assert request_units(cfg, "openai", "GET", "/v1/audio/voices", b"", {}) == 0
    for bad in (12, None, ["a"], {"t": "a"}):
        with pytest.raises(UnitError):
            request_units(cfg, "openai", "POST", "/v1/audio/speech", orjson.dumps({"input": bad}), {})
    with pytest.raises(UnitError):
        request_units(cfg, "openai", "POST", "/v1/audio/speech", b"text=hello", {})
    assert RequestCostConfig(unit="json_chars:/a~1b").unit == "json_chars:/a~1b"
    for wrong in ("json_chars:input", "json_chars:/a~2"):
        with pytest.raises(ValueError):
            RequestCostConfig(unit=wrong)


def test_tokens_unit_reads_an_anthropic_messages_request_with_its_system() -> None:
    cfg = cost("tokens")
    body = {"model": "m", "system": "x" * 8, "max_tokens": 10,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "y" * 4}]}]}
    assert request_units(cfg, "openai", "POST", "/v1/messages", orjson.dumps(body), {}) == 3 + 10
    assert request_units(cfg, "openai", "POST", "/v1/messages/count_tokens", orjson.dumps(body), {}) == 0
