"""The ``fleet:`` section (docs/CONFIG.md#fleet): validated like the rest, each problem as
``file:line: dotted.path: message``; the API key is a secret from the moment it is parsed."""

from __future__ import annotations

import pytest

from kilolined.core.config import ConfigError, parse_config

SRC = "kiloline.yaml"
GOOD = """\
nodes:
  static: {url: "http://127.0.0.1:9"}
routes:
  gen: {path: /gen, nodes: [static]}
  comfy: {path: /comfy, nodes: []}
fleet:
  providers:
    vast: {kind: vastai, api_key: "${VAST_API_KEY}"}
  pools:
    comfy-4090:
      provider: vast
      size: 2
      offer: {gpu_name: "RTX 4090", num_gpus: 1, max_dph: 0.45, min_reliability: 0.97, interruptible: true}
      template: {image: "ghcr.io/ai-dock/comfyui:latest", disk_gb: 40, env: {PORT: "8188"}, port: 8188}
      node: {health: {path: /system_stats}, max_concurrency: 4, label: "Vast {id}"}
      routes: [comfy]
  max_spend_per_hour: 2.00
"""
ENV = {"VAST_API_KEY": "vast-key-from-env-0123456789"}


def errors(text: str, env: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env=ENV if env is None else env, source=SRC)
    return ei.value.errors


def test_the_spec_example_parses_and_hides_its_key() -> None:
    cfg = parse_config(GOOD, env=ENV, source=SRC)
    assert cfg.fleet is not None
    p = cfg.fleet.pools["comfy-4090"]
    assert (p.size, p.boot_timeout_sec, p.backoff_base_sec, p.node.health.path) == (2, 900, 60, "/system_stats")
    node = p.node.node("http://1.2.3.4:41000", "8410")
    assert node.label == "Vast 8410" and node.max_concurrency == 4 and node.url == "http://1.2.3.4:41000"
    key = ENV["VAST_API_KEY"]
    assert cfg.fleet.providers["vast"].api_key.get_secret_value() == key
    assert key not in repr(cfg) and key not in str(cfg.model_dump()) and key not in cfg.model_dump_json()


@pytest.mark.parametrize(("change", "want"), [
    (("provider: vast", "provider: vsat"), f"{SRC}:11: fleet.pools.comfy-4090.provider: unknown provider 'vsat'"),
    (("routes: [comfy]", "routes: [comfyy]"),
     f"{SRC}:16: fleet.pools.comfy-4090.routes.0: unknown route 'comfyy'"),
    (("kind: vastai", "kind: lambda"), f"{SRC}:8: fleet.providers.vast.kind: Input should be 'vastai' or 'runpod'"),
    (("max_dph: 0.45", "max_dph: 0"), f"{SRC}:13: fleet.pools.comfy-4090.offer.max_dph: "
                                      "Input should be greater than 0"),
    (("port: 8188}", "port: 0}"), f"{SRC}:14: fleet.pools.comfy-4090.template.port: "
                                  "Input should be greater than or equal to 1"),
    (("  max_spend_per_hour: 2.00\n", ""), f"{SRC}:6: fleet.max_spend_per_hour: Field required"),
])
def test_mistakes_are_reported_with_file_and_line(change: tuple[str, str], want: str) -> None:
    assert want in errors(GOOD.replace(*change))


def test_a_route_without_nodes_needs_a_pool_and_pool_names_are_reserved() -> None:
    text = GOOD.replace("routes: [comfy]", "routes: [gen]").replace(
        '  static: {url: "http://127.0.0.1:9"}', '  static: {url: "http://127.0.0.1:9"}\n  comfy-4090-1: {url: "http://x:1"}')
    errs = errors(text)
    assert any(e.startswith(f"{SRC}:6: routes.comfy.nodes: must list at least one node") for e in errs), errs
    assert any("nodes.comfy-4090-1: the name is a node of fleet pool 'comfy-4090'" in e for e in errs), errs


def test_an_unset_key_variable_is_one_error_and_the_key_is_never_in_one() -> None:
    assert errors(GOOD, env={}) == [f"{SRC}:8: fleet.providers.vast.api_key: environment variable VAST_API_KEY "
                                    "is not set"]
    bad = GOOD.replace("max_dph: 0.45", "max_dph: -1")
    assert all(ENV["VAST_API_KEY"] not in e for e in errors(bad))


SCALING = GOOD.replace("      size: 2\n", "      min: 0\n      max: 3\n      idle_stop_sec: 300\n").replace(
    '      offer: {gpu_name: "RTX 4090", num_gpus: 1, max_dph: 0.45, min_reliability: 0.97, interruptible: true}\n',
    '      offers:\n        - {gpu_name: "RTX 4090", max_dph: 0.45}\n'
    '        - {gpu_name: "RTX 4090", max_dph: 0.80, interruptible: false}\n')


def test_a_scaling_pool_parses_and_size_still_means_min_equals_max() -> None:
    p = parse_config(SCALING, env=ENV, source=SRC).fleet.pools["comfy-4090"]  # type: ignore[union-attr]
    assert (p.min_size, p.max_size, p.scale_up_wait_sec) == (0, 3, 20)
    assert (p.idle_stop_sec, p.stopped_destroy_sec) == (300, 86400)
    assert [(o.max_dph, o.interruptible) for o in p.offer_list] == [(0.45, True), (0.80, False)]
    fixed = parse_config(GOOD, env=ENV, source=SRC).fleet.pools["comfy-4090"]  # type: ignore[union-attr]
    assert (fixed.min_size, fixed.max_size, len(fixed.offer_list)) == (2, 2, 1)


@pytest.mark.parametrize(("change", "want"), [
    (("      max: 3\n", "      max: 3\n      size: 2\n"),
     f"{SRC}:12: fleet.pools.comfy-4090.min: give size (min = max = size), or min and max, not both"),
    (("      min: 0\n", "      min: 4\n"), f"{SRC}:12: fleet.pools.comfy-4090.min: must be at most max (3), not 4"),
    (("      max: 3\n", ""), f"{SRC}:10: fleet.pools.comfy-4090.max: required (or size: N, which means min = max = N)"),
    (("      offers:\n", '      offer: {gpu_name: "A100", max_dph: 1}\n      offers:\n'),
     f"{SRC}:16: fleet.pools.comfy-4090.offers: give offer or offers, not both"),
    (("      offers:\n        - {gpu_name: \"RTX 4090\", max_dph: 0.45}\n"
      "        - {gpu_name: \"RTX 4090\", max_dph: 0.80, interruptible: false}\n", "      offers: []\n"),
     f"{SRC}:15: fleet.pools.comfy-4090.offers: required, the offers to rent from in order of preference "
     "(or one offer)"),
    (("max_dph: 0.80", "max_dph: -1"),
     f"{SRC}:17: fleet.pools.comfy-4090.offers.1.max_dph: Input should be greater than 0"),
    (("      idle_stop_sec: 300\n", "      idle_stop_sec: -1\n"),
     f"{SRC}:14: fleet.pools.comfy-4090.idle_stop_sec: Input should be greater than or equal to 0"),
])
def test_scaling_mistakes_are_reported_with_file_and_line(change: tuple[str, str], want: str) -> None:
    assert want in errors(SCALING.replace(*change))
