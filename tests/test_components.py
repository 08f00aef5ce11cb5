"""Reload is prepare-all, then commit — or nothing (runtime.Component)."""

from __future__ import annotations

import hashlib

import pytest
import yaml

from kilolined.core.config import Config, parse_config
from kilolined.ops.runtime import Component, ConfigRefused, Runtime, Wiring


def cfg(slots: int) -> Config:
    return parse_config(yaml.safe_dump({
        "keys": {"k": {"key_sha256": hashlib.sha256(b"k").hexdigest()}},
        "nodes": {"a": {"url": "http://127.0.0.1:9"}},
        "routes": {"r": {"path": "/r", "nodes": ["a"], "max_concurrency": slots}},
    }))


def test_a_refusing_component_leaves_everything_as_it_was() -> None:
    committed: list[int] = []
    rt = Runtime(cfg(1), "v1", wire=lambda rt: Wiring(components=(
        Component("recorder", lambda c: committed.append(c.routes["r"].max_concurrency)),
        Component("picky", lambda c: None,
                  prepare=lambda c: ["more than 2 slots not supported"] if c.routes["r"].max_concurrency > 2 else []),
    )))
    rt.apply(cfg(2), "v2")
    assert committed == [2] and rt.version == "v2"
    with pytest.raises(ConfigRefused) as info:
        rt.apply(cfg(3), "v3")
    assert info.value.errors == ["picky: more than 2 slots not supported"]
    # Nothing moved: not the runtime, not the other component.
    assert committed == [2]
    assert rt.version == "v2" and rt.cfg.routes["r"].max_concurrency == 2
    assert rt.scheduler.routes["r"].cfg.max_concurrency == 2
