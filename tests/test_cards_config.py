"""`cards` and `nodes.<n>.card` in the config (docs/CONFIG.md#cards): each mistake is an error at
its file and line, as `kilolined check` prints it, also when another part of the file is broken."""

from __future__ import annotations

import pytest

from kilolined.core.config import ConfigError, parse_config

SRC = "cfg.yaml"

CARDS = """\
cards:
  box4090: {max_concurrency: 5, capacity: 24}
nodes:
  box-comfy: {url: "http://10.0.0.5:8188", card: box4090}
  box-tts:
    url: "http://10.0.0.5:5002"
    card: box4090
routes:
  comfy: {path: /comfy, kind: comfyui, nodes: [box-comfy]}
  tts: {path: /tts, nodes: [box-tts]}
"""


def errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as ei:
        parse_config(text, env={}, source=SRC)
    return ei.value.errors


def test_the_spec_example_is_accepted() -> None:
    cfg = parse_config(CARDS, env={})
    card = cfg.cards["box4090"]
    assert (card.max_concurrency, card.capacity) == (5, 24)
    assert cfg.nodes["box-comfy"].card == cfg.nodes["box-tts"].card == "box4090"


def test_both_limits_are_optional() -> None:
    cfg = parse_config(CARDS.replace("{max_concurrency: 5, capacity: 24}", "{}"), env={})
    assert (cfg.cards["box4090"].max_concurrency, cfg.cards["box4090"].capacity) == (None, None)


def test_an_unknown_card_is_an_error_at_the_node_line() -> None:
    text = CARDS.replace("    card: box4090", "    card: box3090")
    assert errors(text) == [f"{SRC}:7: nodes.box-tts.card: unknown card 'box3090'"]


def test_a_card_no_node_uses_is_an_error_at_its_line() -> None:
    text = CARDS.replace("cards:\n", "cards:\n  spare: {max_concurrency: 1}\n")
    assert errors(text) == [f"{SRC}:2: cards.spare: no node uses this card (nodes.<n>.card)"]


def test_bad_limits_are_errors_at_their_line() -> None:
    text = CARDS.replace("{max_concurrency: 5, capacity: 24}", "{max_concurrency: 0, capacity: -1}")
    assert errors(text) == [f"{SRC}:2: cards.box4090.max_concurrency: Input should be greater than or equal to 1",
                            f"{SRC}:2: cards.box4090.capacity: Input should be greater than 0"]


def test_a_card_mistake_is_reported_with_the_schema_errors_of_the_same_run() -> None:
    text = CARDS.replace("    card: box4090", "    card: box3090").replace("path: /tts", "path: tts")
    errs = errors(text)
    assert f"{SRC}:7: nodes.box-tts.card: unknown card 'box3090'" in errs
    assert any(e.startswith(f"{SRC}:10: routes.tts.path:") for e in errs)


def test_cards_are_taken_in_cluster_mode() -> None:
    cfg = parse_config(CARDS + "cluster: {redis_url: 'redis://127.0.0.1:6379/0'}\n", env={})
    assert cfg.cluster is not None and cfg.nodes["box-tts"].card == "box4090"
