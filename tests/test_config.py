"""kilolined.core.config: the example file, defaults, ${VAR} expansion and dotted-path errors (SPEC §2)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kilolined.core.config import ConfigError, load_config, parse_config, split_listen

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "etc" / "kiloline.yaml"
ENV = {"KILOLINE_ADMIN_KEY": "kl_dummy_admin_0000", "ALICE_KEY": "kl_dummy_alice_0000", "BOB_KEY": "kl_dummy_bob_00000"}
DOTTED = re.compile(r"^[^\s:]+(?: [^:]+)?: .+$")


def minimal(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "nodes": {"gpu": {"url": "http://127.0.0.1:8188"}},
        "routes": {"gen": {"path": "/gen", "nodes": ["gpu"]}},
    }
    cfg.update(over)
    return cfg


def errors_of(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env=env or {})
    errs = ei.value.errors
    assert errs, "ConfigError without errors"
    for e in errs:
        assert DOTTED.match(e), f"not 'dotted.path: message': {e!r}"
    return errs


def dump(cfg: dict[str, Any]) -> str:
    return yaml.safe_dump(cfg)


# --- the example file ---------------------------------------------------------------------------


def test_example_config_is_valid() -> None:
    cfg, version = load_config(EXAMPLE, env=ENV)
    assert version == hashlib.sha256(EXAMPLE.read_bytes()).hexdigest()
    assert len(cfg.routes) == 3 and len(cfg.nodes) == 4 and len(cfg.keys) == 2
    assert cfg.admin.digest() == hashlib.sha256(b"kl_dummy_admin_0000").hexdigest()
    if yaml.safe_load(EXAMPLE.read_text())["keys"]["bob"].get("key") == "${BOB_KEY}":
        assert cfg.keys["bob"].digest() == hashlib.sha256(b"kl_dummy_bob_00000").hexdigest()
    assert re.fullmatch(r"[0-9a-f]{64}", cfg.keys["bob"].digest() or "")
    # ${VAR:-default} fallbacks in the example
    assert cfg.server.state_dir == "/var/lib/kiloline"
    assert cfg.nodes["vast-8410"].headers["Authorization"] == "Bearer changeme"
    # empty ${TG_TOKEN:-} turns the channel off
    assert cfg.notify.telegram is None and cfg.notify.discord is None
    assert cfg.routes["comfy"].kind == "comfyui"


def test_example_config_without_env_names_the_variable() -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(EXAMPLE, env={"BOB_KEY": "x"})
    line = next(i for i, t in enumerate(EXAMPLE.read_text().splitlines(), 1) if "${KILOLINE_ADMIN_KEY}" in t)
    assert f"{EXAMPLE}:{line}: admin.key: environment variable KILOLINE_ADMIN_KEY is not set" in ei.value.errors


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path / "nope.yaml", env={})
    assert "nope.yaml" in ei.value.errors[0]


# --- defaults (SPEC §2) -------------------------------------------------------------------------


def test_defaults() -> None:
    cfg = parse_config(dump(minimal()), env={})
    r = cfg.routes["gen"]
    assert r.max_concurrency == 1
    assert r.max_queue_depth == 100
    assert r.queue_timeout_sec == 120
    assert r.request_timeout_sec == 600
    assert r.drop_policy == "reject_with_429"
    assert r.strategy == "fifo_fair_lease"
    assert r.retry_on_failover == 1
    assert r.auth == "required"
    assert r.rate is None
    assert r.kind == "generic" and r.standby == [] and r.max_queued_per_key is None
    assert r.unqueued == []
    s = cfg.server
    assert s.listen == "0.0.0.0:8080" and s.max_body_mb == 64 and s.shutdown_grace_sec == 30
    assert s.heartbeat_sec == 10 and s.state_dir is None and s.tls is None and s.trusted_proxies == []
    assert cfg.admin.public_metrics is False
    assert cfg.keys == {}
    n = cfg.nodes["gpu"]
    assert n.max_concurrency is None and n.health is None and n.headers == {}
    assert cfg.jobs.result_ttl_sec == 600 and cfg.jobs.max_results_mb == 512
    assert cfg.jobs.webhook_backoff_sec == [5, 30, 120, 600, 1800] and cfg.jobs.webhook_allow_private is False


def test_key_defaults_no_budget_no_rate() -> None:
    cfg = parse_config(dump(minimal(keys={"k": {"key": "kl_7f3a9c_e41b8d20"}})), env={})
    k = cfg.keys["k"]
    assert k.routes == ["*"] and k.rate is None and k.budget is None and k.priority == 0
    assert k.adhoc_targets == []


def test_unqueued_defaults_per_kind() -> None:
    cfg = parse_config(dump(minimal(routes={"c": {"path": "/c", "nodes": ["gpu"], "kind": "comfyui"},
                                            "o": {"path": "/o", "nodes": ["gpu"], "kind": "openai"}})), env={})
    assert cfg.routes["c"].unqueued == ["*"]  # only a prompt takes a slot (config.GPU_WORK)
    assert "/v1/models" in cfg.routes["o"].unqueued and "/health" in cfg.routes["o"].unqueued


def test_decimal_seconds_accepted() -> None:
    cfg = parse_config(dump(minimal(routes={"gen": {"path": "/gen", "nodes": ["gpu"], "queue_timeout_sec": 0.5,
                                                    "request_timeout_sec": 1.25}})), env={})
    assert cfg.routes["gen"].queue_timeout_sec == 0.5


def test_node_url_trailing_slash_and_route_path_normalised() -> None:
    cfg = parse_config(dump(minimal(nodes={"gpu": {"url": "http://127.0.0.1:8188/"}},
                                    routes={"gen": {"path": "/gen/", "nodes": ["gpu"]}})), env={})
    assert cfg.nodes["gpu"].url == "http://127.0.0.1:8188"
    assert cfg.routes["gen"].path == "/gen"


# --- ${VAR} -------------------------------------------------------------------------------------


def test_env_var_expanded() -> None:
    text = dump(minimal(keys={"k": {"key": "${MY_KEY}"}}))
    cfg = parse_config(text, env={"MY_KEY": "kl_7f3a9c_e41b8d20"})
    assert cfg.keys["k"].key == "kl_7f3a9c_e41b8d20"


def test_missing_env_var_names_the_variable_and_path() -> None:
    errs = errors_of(dump(minimal(keys={"k": {"key": "${MY_SECRET_KEY}"}})))
    assert any(e.startswith("keys.k.key:") and "MY_SECRET_KEY" in e for e in errs), errs


def test_env_default_used_when_unset_and_ignored_when_set() -> None:
    text = dump(minimal(server={"listen": "${LISTEN:-127.0.0.1:9999}"}))
    assert parse_config(text, env={}).server.listen == "127.0.0.1:9999"
    assert parse_config(text, env={"LISTEN": "127.0.0.1:7000"}).server.listen == "127.0.0.1:7000"


def test_env_empty_default() -> None:
    text = dump(minimal(nodes={"gpu": {"url": "http://127.0.0.1:1", "headers": {"X-T": "a${T:-}b"}}}))
    assert parse_config(text, env={}).nodes["gpu"].headers["X-T"] == "ab"


def test_env_expansion_inside_numbers_and_lists() -> None:
    text = """
nodes: {gpu: {url: "http://127.0.0.1:${PORT:-8188}"}}
routes:
  gen: {path: /gen, nodes: ["${NODE:-gpu}"], max_concurrency: "${SLOTS:-3}"}
"""
    cfg = parse_config(text, env={"SLOTS": "4"})
    assert cfg.nodes["gpu"].url == "http://127.0.0.1:8188"
    assert cfg.routes["gen"].nodes == ["gpu"] and cfg.routes["gen"].max_concurrency == 4


# --- errors -------------------------------------------------------------------------------------


def test_malformed_yaml() -> None:
    errs = errors_of("routes:\n  gen: {path: /gen, nodes: [gpu\nnodes: x\n")
    assert len(errs) == 1 and "line" in errs[0]


def test_top_level_not_a_mapping() -> None:
    errs = errors_of("- a\n- b\n")
    assert errs


def test_unknown_key_is_an_error_with_its_path() -> None:
    errs = errors_of(dump(minimal(routes={"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurency": 2}})))
    assert "routes.gen.max_concurency: unknown key" in errs


def test_unknown_top_level_key() -> None:
    errs = errors_of(dump(minimal(sevrer={"listen": "x"})))
    assert any(e.startswith("sevrer:") and "unknown" in e for e in errs), errs


def test_bad_value_names_the_path() -> None:
    errs = errors_of(dump(minimal(routes={"gen": {"path": "/gen", "nodes": ["gpu"], "max_concurrency": 0,
                                                  "drop_policy": "nope"}})))
    assert any(e.startswith("routes.gen.max_concurrency:") for e in errs), errs
    assert any(e.startswith("routes.gen.drop_policy:") for e in errs), errs


def test_duplicate_route_path() -> None:
    errs = errors_of(dump(minimal(routes={"a": {"path": "/gen", "nodes": ["gpu"]},
                                          "b": {"path": "/gen/", "nodes": ["gpu"]}})))
    assert any(e.startswith("routes.b.path:") and "/gen" in e for e in errs), errs


def test_route_naming_unknown_node() -> None:
    errs = errors_of(dump(minimal(routes={"gen": {"path": "/gen", "nodes": ["gpu", "ghost"], "standby": ["spook"]}})))
    assert any(e.startswith("routes.gen.nodes.1:") and "ghost" in e for e in errs), errs
    assert any(e.startswith("routes.gen.standby.0:") and "spook" in e for e in errs), errs


def test_key_naming_unknown_route() -> None:
    errs = errors_of(dump(minimal(keys={"alice": {"key": "x", "routes": ["gen", "nope"]}})))
    assert any(e.startswith("keys.alice.routes.1:") and "nope" in e for e in errs), errs


@pytest.mark.parametrize("listen", ["8080", "localhost", "host:port", "1.2.3.4:99999", "[::1]", ""])
def test_bad_listen(listen: str) -> None:
    errs = errors_of(dump(minimal(server={"listen": listen})))
    assert any(e.startswith("server.listen:") for e in errs), errs


@pytest.mark.parametrize(("listen", "want"), [("0.0.0.0:8080", ("0.0.0.0", 8080)), ("[::]:80", ("::", 80)),
                                              (":81", ("0.0.0.0", 81)), ("127.0.0.1:0", ("127.0.0.1", 0))])
def test_good_listen(listen: str, want: tuple[str, int]) -> None:
    assert split_listen(listen) == want
    assert parse_config(dump(minimal(server={"listen": listen})), env={}).server.listen == listen


def test_missing_required_fields() -> None:
    errs = errors_of(dump({"nodes": {"gpu": {}}, "routes": {"gen": {"nodes": ["gpu"]}}}))
    assert any(e.startswith("nodes.gpu.url:") for e in errs), errs
    assert any(e.startswith("routes.gen.path:") for e in errs), errs


def test_key_needs_exactly_one_secret() -> None:
    errs = errors_of(dump(minimal(keys={"a": {"routes": ["*"]}})))
    assert any(e.startswith("keys.a") for e in errs), errs
    errs = errors_of(dump(minimal(keys={"a": {"key": "x", "key_sha256": "0" * 64}})))
    assert any(e.startswith("keys.a") for e in errs), errs
    errs = errors_of(dump(minimal(keys={"a": {"key_sha256": "abc"}})))
    assert any(e.startswith("keys.a.key_sha256:") for e in errs), errs


def test_all_problems_reported_at_once() -> None:
    errs = errors_of(dump(minimal(routes={"gen": {"path": "/gen", "nodes": ["gpu"], "bogus": 1, "max_queue_depth": -1}},
                                  server={"listen": "nope"})))
    assert len(errs) >= 3


def test_empty_file_reports_missing_sections() -> None:
    errs = errors_of("")
    assert any(e.startswith("nodes") for e in errs) and any(e.startswith("routes") for e in errs)


# --- file:line, duplicate keys, alias bound (like nginx -t) ----------------------------------------

LOCATED = "cfg.yaml"


def located_errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env={}, source=LOCATED)
    for e in ei.value.errors:
        assert re.match(rf"^{LOCATED}:\d+: \S+: .+$", e), e
    return ei.value.errors


def test_error_names_file_and_line_of_the_key() -> None:
    text = ("nodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\n"
            "routes:\n  gen:\n    path: /gen\n    nodes: [gpu]\n    max_concurrency: 0\n")
    want = f"{LOCATED}:7: routes.gen.max_concurrency: Input should be greater than or equal to 1"
    assert located_errors(text) == [want]


def test_missing_key_is_reported_at_its_mapping() -> None:
    text = "nodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\nroutes:\n\n  gen:\n    nodes: [gpu]\n"
    assert located_errors(text) == [f"{LOCATED}:5: routes.gen.path: Field required"]


def test_load_config_errors_carry_the_file_name(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text("nodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\nroutes:\n  gen: {path: /gen, nodes: [ghost]}\n")
    with pytest.raises(ConfigError) as ei:
        load_config(f, env={})
    assert ei.value.errors == [f"{f}:4: routes.gen.nodes.0: unknown node 'ghost'"]


def test_a_second_server_block_is_an_error() -> None:
    text = ("server:\n  listen: 127.0.0.1:1\nnodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\n"
            "routes:\n  gen: {path: /gen, nodes: [gpu]}\nserver:\n  max_body_mb: 1\n")
    assert located_errors(text) == [f"{LOCATED}:7: server: duplicate key (first at line 1)"]


def test_a_second_route_with_the_same_name_is_an_error() -> None:
    text = ("nodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\nroutes:\n  gen: {path: /gen, nodes: [gpu]}\n"
            "  img: {path: /img, nodes: [gpu]}\n  gen: {path: /other, nodes: [gpu]}\n")
    assert located_errors(text) == [f"{LOCATED}:6: routes.gen: duplicate key (first at line 4)"]
    with pytest.raises(ConfigError):  # without a file name too: never last-wins
        parse_config(text, env={})


def test_merge_keys_and_small_aliases_still_work() -> None:
    text = ("nodes:\n  gpu: {url: 'http://127.0.0.1:8188'}\n"
            "routes:\n  gen: &base {path: /gen, nodes: [gpu], max_concurrency: 3}\n"
            "  img:\n    <<: *base\n    path: /img\n")
    cfg = parse_config(text, env={}, source=LOCATED)
    assert (cfg.routes["img"].path, cfg.routes["img"].max_concurrency) == ("/img", 3)


def billion_laughs(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + f"\nnodes: *a{levels}\n"


def test_alias_bomb_is_an_error_not_a_frozen_parser() -> None:
    assert located_errors(billion_laughs()) == [f"{LOCATED}:1: (yaml): aliases expand to more than 10000 nodes"]


def test_aliases_up_to_the_bound_are_accepted() -> None:
    # 10 × 10 × 10 leaves: ~1,100 nodes of growth, well under the bound; the config is then
    # refused for its contents, not for its aliases.
    errs = located_errors(billion_laughs(levels=3))
    assert not any("aliases" in e for e in errs), errs


def test_recursive_alias_is_an_error() -> None:
    errs = located_errors("nodes: &n\n  gpu: *n\n")
    assert errs == [f"{LOCATED}:1: (yaml): an alias refers to the node that contains it"]


def test_client_side_limits_defaults() -> None:
    s = parse_config(dump(minimal()), env={}).server
    assert (s.header_timeout_sec, s.idle_timeout_sec, s.max_connections) == (30, 75, 10000)
    s = parse_config(dump(minimal(server={"header_timeout_sec": 0.5, "idle_timeout_sec": 2.5, "max_connections": 3})),
                     env={}).server
    assert (s.header_timeout_sec, s.idle_timeout_sec, s.max_connections) == (0.5, 2.5, 3)
    errs = errors_of(dump(minimal(server={"max_connections": 0, "header_timeout_sec": 0})))
    assert any(e.startswith("server.max_connections:") for e in errs)
    assert any(e.startswith("server.header_timeout_sec:") for e in errs)


# --- multi-model nodes (docs/CONFIG.md#multi-model-nodes) ---------------------------------------


def test_models_warm_models_and_max_swap_bypass() -> None:
    cfg = parse_config(dump(minimal(
        nodes={"box": {"url": "http://h:1", "models": ["qwen2.5-coder:32b", "llama3.3:70b"], "warm_models": 2},
               "disc": {"url": "http://h:2", "models": "discover"}},
        routes={"gen": {"path": "/v1", "kind": "openai", "nodes": ["box", "disc"], "max_swap_bypass": 0}})), env={})
    assert cfg.nodes["box"].models == ["qwen2.5-coder:32b", "llama3.3:70b"] and cfg.nodes["box"].warm_models == 2
    assert cfg.nodes["disc"].models == "discover" and cfg.nodes["disc"].warm_models == 1
    assert cfg.routes["gen"].max_swap_bypass == 0
    plain = parse_config(dump(minimal()), env={})
    assert plain.nodes["gpu"].models is None and plain.routes["gen"].max_swap_bypass == 4


@pytest.mark.parametrize(("node", "route", "want"), [
    ({"models": "discovery"}, {}, 'nodes.gpu.models: must be a list of model names or "discover"'),
    ({"models": []}, {}, "nodes.gpu.models: must name at least one model"),
    ({"models": ["a", "a"]}, {}, "nodes.gpu.models: model listed twice: a"),
    ({"models": [" "]}, {}, "nodes.gpu.models: a model name may not be empty"),
    ({"warm_models": 0}, {}, "nodes.gpu.warm_models:"),
    ({}, {"max_swap_bypass": -1}, "routes.gen.max_swap_bypass:"),
])
def test_bad_multi_model_keys_name_their_path(node: dict[str, Any], route: dict[str, Any], want: str) -> None:
    errs = errors_of(dump(minimal(nodes={"gpu": {"url": "http://127.0.0.1:8188", **node}},
                                  routes={"gen": {"path": "/gen", "nodes": ["gpu"], **route}})))
    assert any(e.startswith(want) for e in errs), errs
