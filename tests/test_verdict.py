"""A node's failure is typed (core/verdict.py): the lease scope judges the cause, not the words,
and "a 5xx is the node's failure" is one function.

The scope runs on a real Runtime, with a real speed watch and real node state: a stall goes to
the speed watch (the node is ejected, its breaker opens, no breaker failure is counted), any
other failure is one of the breaker's consecutive failures, whatever its words say.
"""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from kilolined.core.config import parse_config
from kilolined.core.verdict import Cause, NodeVerdict, failed_status, status_verdict
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.lease import ENDED, LeaseScope
from kilolined.scheduling.nodes import SPEED_OK, SPEED_STALLED

PKG = Path(__file__).resolve().parent.parent / "kilolined"


def _runtime() -> Runtime:
    nodes = {n: {"url": f"http://127.0.0.1:{9 + i}", "slow": {"stall_sec": 1},
                 "breaker": {"consecutive_failures": 3, "open_sec": 30}} for i, n in enumerate("abc")}
    cfg = {"nodes": nodes, "routes": {"r": {"path": "/r", "nodes": list(nodes), "max_concurrency": 1}}}
    return Runtime(parse_config(yaml.safe_dump(cfg), env={}), "t")


async def _failed_on(rt: Runtime, verdict: NodeVerdict) -> str:
    """One request leased to a node, failed with ``verdict``: the node it ran on."""
    ticket = rt.admit("r", "k", 0)
    assert ticket.lease is not None
    scope = LeaseScope(rt, ticket, ENDED, None)
    scope.lease = ticket.lease
    scope.node_failed(verdict)
    return ticket.lease.node


async def test_a_stall_is_judged_by_its_cause_not_its_words() -> None:
    rt = _runtime()
    node = await _failed_on(rt, NodeVerdict(Cause.STALL, "no byte from the node for 1s"))
    ns = rt.scheduler.nodes[node]
    assert ns.slow_state == SPEED_STALLED and ns.breaker == "open"


async def test_words_that_say_stalled_do_not_make_a_stall() -> None:
    rt = _runtime()
    node = await _failed_on(rt, NodeVerdict(Cause.LOST, "stalled: the words of a lost node"))
    ns = rt.scheduler.nodes[node]
    assert ns.slow_state == SPEED_OK and ns.failures == 1 and ns.breaker == "closed"


def test_a_5xx_is_the_nodes_failure_and_a_4xx_is_not() -> None:
    assert [failed_status(s) for s in (200, 404, 499, 500, 503, 599)] == [False, False, False, True, True, True]
    assert status_verdict(502) == NodeVerdict(Cause.STATUS, "HTTP 502 from node")


def _judging_modules() -> list[Path]:
    """Where a node's answer is judged: the adapters, the client modes, the scheduler, the wire."""
    return sorted(p for d in ("adapters", "modes", "scheduling", "wire") for p in (PKG / d).rglob("*.py"))


def test_the_5xx_rule_is_written_once() -> None:
    found = []
    for p in _judging_modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value == 500 for c in [node.left, *node.comparators]):
                found.append(f"{p.relative_to(PKG.parent)}:{node.lineno} {ast.unparse(node)}")
    assert found == [], "a node's failing status is core.verdict.failed_status:\n" + "\n".join(found)


def test_no_failure_is_recognised_by_its_words() -> None:
    found = []
    for p in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr == "startswith" and any("STALLED" in ast.unparse(a) for a in node.args):
                found.append(f"{p.relative_to(PKG.parent)}:{node.lineno} {ast.unparse(node)}")
    assert found == [], "a stall is Cause.STALL (core/verdict.py):\n" + "\n".join(found)
