"""`rewrite`, `overflow` and `price_per_mtok` in the config (docs/CONFIG.md#rewriting-requests,
#overflow): each mistake is an error at its file and line, as `kilolined check` prints it."""

from __future__ import annotations

import pytest

from kilolined.core.config import ConfigError, parse_config
from kilolined.core.rewrite import cost_of

SRC = "cfg.yaml"

NODES = """\
nodes:
  gpu:
    url: http://10.0.0.1:8080
    models: [qwen2.5-7b]
  cloud:
    url: https://api.example.com
    headers: {Authorization: "Bearer sk-x"}
    rewrite:
      model: {qwen2.5-7b: provider/qwen-7b}
    price_per_mtok: {input: 0.2, output: 0.6}
"""


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env={}, source=SRC)
    return ei.value.errors


def test_a_full_example_is_accepted() -> None:
    cfg = parse_config(NODES + """\
routes:
  llm:
    path: /v1
    kind: openai
    nodes: [gpu]
    rewrite:
      model: {gpt-4o-mini: qwen2.5-7b}
      default: {max_tokens: 512}
      set: {temperature: 0.6}
      strip: [logit_bias, user]
    overflow: {nodes: [cloud], when_wait_sec: 30}
""", env={})
    r = cfg.routes["llm"]
    assert r.rewrite is not None and r.rewrite.model == {"gpt-4o-mini": "qwen2.5-7b"}
    assert r.overflow_nodes == ["cloud"] and cfg.nodes["cloud"].price_per_mtok is not None


def test_an_alias_to_a_model_no_node_serves_is_an_error_at_its_line() -> None:
    text = NODES + "routes:\n  llm:\n    path: /v1\n    kind: openai\n    nodes: [gpu]\n" \
                   "    rewrite:\n      model:\n        gpt-4o: qwen2.5-32b\n"
    assert errors(text) == [f"{SRC}:18: routes.llm.rewrite.model.gpt-4o: 'qwen2.5-32b' is served by no node "
                            "of the route"]


def test_overflow_naming_an_unknown_node_or_a_primary() -> None:
    text = NODES + "routes:\n  llm:\n    path: /v1\n    kind: openai\n    nodes: [gpu]\n" \
                   "    overflow:\n      nodes: [gpu, ghost]\n"
    assert errors(text) == [f"{SRC}:17: routes.llm.overflow.nodes.0: 'gpu' is also in the route's nodes",
                            f"{SRC}:17: routes.llm.overflow.nodes.1: unknown node 'ghost'"]


def test_overflow_is_refused_in_cluster_mode() -> None:
    text = NODES + "cluster: {redis_url: 'redis://127.0.0.1:6379/0'}\n" \
                   "routes:\n  llm:\n    path: /v1\n    kind: openai\n    nodes: [gpu]\n" \
                   "    overflow: {nodes: [cloud]}\n"
    assert errors(text) == [f"{SRC}:17: routes.llm.overflow: not available in cluster mode (one gateway only)"]


def test_rules_that_contradict_each_other() -> None:
    text = NODES + "routes:\n  llm:\n    path: /v1\n    kind: openai\n    nodes: [gpu]\n" \
                   "    rewrite: {set: {user: x}, strip: [user]}\n"
    assert errors(text) == [f"{SRC}:16: routes.llm.rewrite: strip: user also set (or defaulted): say one"]
    text = NODES + "routes:\n  llm:\n    path: /v1\n    kind: openai\n    nodes: [gpu]\n" \
                   "    rewrite: {set: {model: x}}\n"
    assert errors(text) == [f"{SRC}:16: routes.llm.rewrite: set: the model is renamed by rewrite.model, not set"]


def test_a_comfyui_route_has_no_rewrite() -> None:
    text = "nodes:\n  c: {url: 'http://10.0.0.1:8188'}\nroutes:\n  comfy:\n    path: /comfy\n" \
           "    kind: comfyui\n    nodes: [c]\n    rewrite: {strip: [x]}\n"
    assert errors(text) == [f"{SRC}:8: routes.comfy.rewrite: not for comfyui routes (openai and generic routes)"]


def test_cost_of() -> None:
    price = parse_config(NODES + "routes:\n  llm: {path: /v1, kind: openai, nodes: [gpu]}\n",
                         env={}).nodes["cloud"].price_per_mtok
    assert cost_of((1_000_000, 500_000), price) == pytest.approx(0.2 + 0.3)
    assert cost_of((10, 10), None) is None
