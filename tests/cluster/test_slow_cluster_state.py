"""Cluster mode: the speed verdict travels like a breaker state — only the transition, as its own
group — and another gateway says the same event in the decider's words (pure, cluster/nodestate.py)."""

from __future__ import annotations

import pytest

from kilolined.cluster.nodestate import apply, changed_groups, export, snapshot
from kilolined.core.config import NodeConfig
from kilolined.scheduling.nodes import SPEED_HARD, SPEED_OK, SPEED_SLOW, SPEED_STALLED, SPEED_TRIAL, NodeState

URL = "http://10.0.0.3:8188"


def pair() -> tuple[NodeState, NodeState]:
    return NodeState("c", NodeConfig(url=URL)), NodeState("c", NodeConfig(url=URL))


def verdict(ns: NodeState, state: str, now: float, note: str = "", until: float = 0.0) -> None:
    """As the speed watch decides (ops/speedwatch.py _decide)."""
    ns.slow_state, ns.slowed = state, state in (SPEED_SLOW, SPEED_HARD)
    ns.slow_until, ns.slow_period, ns.slow_cause, ns.slow_note = until, 30.0, "gen\t\tms/request", note


def send(src: NodeState, dst: NodeState, now_src: float, now_dst: float) -> list[str]:
    before = snapshot(dst)
    groups = changed_groups(before, snapshot(src))
    return apply(dst, export(src, now_src, groups), now_dst)


def test_the_verdict_is_its_own_group() -> None:
    here, _ = pair()
    before = snapshot(here)
    verdict(here, SPEED_SLOW, 0.0, "🐢 c slow", until=30.0)
    assert changed_groups(before, snapshot(here)) == ["slow"]
    fields = export(here, 10.0, ["slow"])
    assert fields["slowed"] == 1 and fields["slow"] == SPEED_SLOW and fields["slow_left_ms"] == 20000
    assert fields["slow_note"] == "🐢 c slow" and "breaker" not in fields and "healthy" not in fields


def test_an_eject_seen_elsewhere_is_news_here_with_its_words_and_its_trial_moment() -> None:
    here, there = pair()
    verdict(here, SPEED_SLOW, 100.0, "🐢 c slow: 41 ms/request vs 18", until=130.0)
    # The other gateway alerts it (if it leads), in the decider's words; the trial is 20 s away on both clocks.
    assert send(here, there, 110.0, 5000.0) == ["node_slow"]
    assert there.slowed and there.effective(4, 5000.0) == 1 and there.slow_note.startswith("🐢 c slow: 41")
    assert there.slow_until == pytest.approx(5020.0) and there.slow_cause == "gen\t\tms/request"
    # Read again (the sweep): not news.
    assert apply(there, export(here, 111.0, ["slow"]), 5001.0) == []
    # Harder: the eject again, with the breaker (its own group).
    verdict(here, SPEED_HARD, 112.0, "🐢 c slow: 3.4×", until=160.0)
    assert send(here, there, 112.0, 5002.0) == ["node_slow"]


def test_a_trial_is_quiet_and_a_recovery_is_news() -> None:
    here, there = pair()
    verdict(here, SPEED_SLOW, 0.0, "slow", until=30.0)
    send(here, there, 0.0, 0.0)
    here.slow_state, here.slowed, here.recovered_at = SPEED_TRIAL, False, 30.0
    assert send(here, there, 31.0, 1.0) == []
    assert not there.slowed and there.recovered_at == pytest.approx(0.0)  # it ramps from the same moment
    verdict(here, SPEED_OK, 40.0, "✓ c back to speed")
    assert send(here, there, 40.0, 10.0) == ["node_recovered"]
    assert there.slow_note == "✓ c back to speed"
    # Tried again, slow again: ejected anew.
    verdict(here, SPEED_SLOW, 50.0, "slow again", until=110.0)
    assert send(here, there, 50.0, 20.0) == ["node_slow"]


def test_a_stall_is_news_and_ends_quietly() -> None:
    here, there = pair()
    verdict(here, SPEED_STALLED, 0.0, "🐢 c stalled")
    assert send(here, there, 0.0, 0.0) == ["node_slow"]
    assert not there.slowed and there.slow_state == SPEED_STALLED
    verdict(here, SPEED_OK, 1.0, "")
    assert send(here, there, 1.0, 1.0) == []


def test_a_gateway_with_slow_off_takes_none_of_it() -> None:
    here = NodeState("c", NodeConfig(url=URL))
    there = NodeState("c", NodeConfig(url=URL, slow=False))
    verdict(here, SPEED_SLOW, 0.0, "slow", until=30.0)
    assert send(here, there, 0.0, 0.0) == []
    assert not there.slowed and there.slow_state == SPEED_OK and there.effective(4, 0.0) == 4


def test_a_lift_by_slow_off_elsewhere_is_quiet() -> None:
    here, there = pair()
    verdict(here, SPEED_SLOW, 0.0, "slow", until=30.0)
    send(here, there, 0.0, 0.0)
    here.clear_slow()  # that gateway reloaded `slow: off`
    assert send(here, there, 1.0, 1.0) == []
    assert not there.slowed and there.slow_state == SPEED_OK
