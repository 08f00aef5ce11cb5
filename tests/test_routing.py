"""kilolined.scheduling.routing and the config rules of routes sharing a path (pure)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from kilolined.core.config import ConfigError, MatchConfig, RouteConfig, parse_config
from kilolined.edge.models_list import is_models_list, merge
from kilolined.scheduling.routing import Router, body_model, holds


def route(path: str, **kw: Any) -> RouteConfig:
    return RouteConfig(path=path, nodes=["a"], **kw)


def test_longest_prefix_on_a_segment_boundary() -> None:
    r = Router({"comfy": route("/comfy"), "root": route("/"), "deep": route("/comfy/x")})
    assert r.match("/comfy/prompt") == (("comfy",), "/prompt")
    assert r.match("/comfy/x/y") == (("deep",), "/y")
    assert r.match("/comfyx") == (("root",), "/comfyx")
    assert Router({"c": route("/c")}).match("/d") is None


def test_routes_sharing_a_path_in_file_order_fallback_last() -> None:
    r = Router({"chat": route("/v1"), "batch": route("/v1", match={"min_units": 8000}),
                "coder": route("/v1", match={"model": ["qwen*"]})})
    assert r.match("/v1/chat/completions") == (("batch", "coder", "chat"), "/chat/completions")


def m(**kw: Any) -> MatchConfig:
    return MatchConfig(**kw)


def never() -> float:
    raise AssertionError("units read although no bound needs them")


def test_match_conditions() -> None:
    assert holds(None, "GET", {}, None, never)
    assert holds(m(model=["qwen2.5-coder*"]), "POST", {}, "qwen2.5-coder:32b", never)
    assert not holds(m(model=["qwen2.5-coder*"]), "POST", {}, "llama3", never)
    assert not holds(m(model=["*"]), "POST", {}, None, never)  # no model in the body
    assert holds(m(header={"X-Tier": "batch*"}), "POST", {"X-Tier": "batch-nightly"}, None, never)
    assert not holds(m(header={"X-Tier": "batch*"}), "POST", {}, None, never)
    assert holds(m(method=["post"]), "POST", {}, None, never)
    assert not holds(m(method=["GET"]), "POST", {}, None, never)
    assert holds(m(min_units=10, max_units=20), "POST", {}, None, lambda: 10)  # inclusive
    assert holds(m(min_units=10, max_units=20), "POST", {}, None, lambda: 20)
    assert not holds(m(min_units=10), "POST", {}, None, lambda: 9.9)
    assert not holds(m(max_units=10), "POST", {}, None, lambda: 10.1)
    assert not holds(m(model=["x"], min_units=1), "POST", {}, "y", never)  # all given must hold


def test_body_model() -> None:
    assert body_model(b'{"model": "m"}') == "m"
    assert body_model(b'{"model": 3}') is None
    assert body_model(b"nope") is None and body_model(b"") is None


def cfg(routes: dict[str, Any]) -> str:
    return yaml.safe_dump({"nodes": {"a": {"url": "http://127.0.0.1:1"}}, "routes": routes})


def errors(routes: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(cfg(routes), env={})
    return e.value.errors


def test_config_rules_for_shared_paths() -> None:
    ok = {"batch": {"path": "/v1", "kind": "openai", "nodes": ["a"], "match": {"min_units": 8000},
                    "cost": {"unit": "tokens"}},
          "chat": {"path": "/v1", "kind": "openai", "nodes": ["a"]}}
    parse_config(cfg(ok), env={})
    two_fallbacks = {"x": {"path": "/v1", "nodes": ["a"]}, "y": {"path": "/v1", "nodes": ["a"]}}
    assert any("routes.y.path" in e and "need a match" in e for e in errors(two_fallbacks))
    kinds = {"x": {"path": "/v1", "nodes": ["a"], "match": {"method": ["GET"]}},
             "y": {"path": "/v1", "kind": "openai", "nodes": ["a"]}}
    assert any("routes.y.kind" in e for e in errors(kinds))
    no_unit = {"x": {"path": "/v1", "nodes": ["a"], "match": {"min_units": 1}}}
    assert any("routes.x.match" in e and "cost.unit" in e for e in errors(no_unit))


def test_models_union_merge_keeps_the_first_of_each_id() -> None:
    a = {"object": "list", "data": [{"id": "x", "n": 1}, {"id": "y"}]}
    b = {"object": "list", "data": [{"id": "y", "n": 2}, {"id": "z"}, {"no": "id"}]}
    assert merge([a, b, "junk", {"data": 3}]) == [{"id": "x", "n": 1}, {"id": "y"}, {"id": "z"}]
    assert is_models_list("GET", "/models?x=1") and is_models_list("GET", "/v1/models/")
    assert not is_models_list("POST", "/models") and not is_models_list("GET", "/models/x")
