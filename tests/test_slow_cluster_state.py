"""Cluster mode: a soft eject travels like a breaker state — only the transition, as its own group."""

from __future__ import annotations

from kilolined.cluster.nodestate import apply, changed_groups, export, snapshot
from kilolined.core.config import NodeConfig
from kilolined.scheduling.nodes import NodeState


def test_slowed_is_its_own_group_and_applies_without_an_event() -> None:
    here, there = NodeState("c", NodeConfig(url="http://10.0.0.3:8188")), NodeState("c", NodeConfig(url="http://10.0.0.3:8188"))
    before = snapshot(here)
    here.slowed = True
    groups = changed_groups(before, snapshot(here))
    assert groups == ["slow"]
    fields = export(here, 0.0, groups)
    assert fields == {"slowed": 1}
    assert apply(there, fields, 5.0) == []  # the deciding gateway alerts; the others follow quietly
    assert there.slowed and there.effective(4, 5.0) == 1
    here.slowed = False
    assert apply(there, export(here, 0.0, changed_groups(snapshot(there), snapshot(here))), 6.0) == []
    assert not there.slowed and there.effective(4, 6.0) == 4
