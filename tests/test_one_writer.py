"""Node state has one writer, and the Runtime is built whole.

``NodeState`` (kilolined/scheduling/nodes.py) changes only through its own methods, each of which
returns the events it caused; every other module reads its fields. The ``Runtime``
(kilolined/ops/runtime.py) gets its parts at construction (a ``Wiring``) and no other module
assigns onto it afterwards. Both are conventions Python does not enforce, so these walks of the
package's syntax do: a write that slips back in fails here with its file and line.

Which expression is a NodeState is read from the code's own conventions, not from a type checker:
a name annotated ``NodeState``, one bound from ``NodeState(...)`` or from a scheduler's ``nodes``
(``x.nodes[n]``, ``x.nodes.get(n)``, a loop over ``x.nodes.values()`` or ``.items()``), or an
attribute write straight onto ``x.nodes[n]``. A Runtime is what the code calls ``rt``
(``rt``, ``self.rt``, ``gw.rt``).
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import yaml

from kilolined.core.config import parse_config
from kilolined.ops.runtime import Runtime, Wiring
from kilolined.scheduling.nodes import CHANGED, NodeState

PKG = Path(__file__).resolve().parent.parent / "kilolined"
OWNER = PKG / "scheduling" / "nodes.py"
RUNTIME = PKG / "ops" / "runtime.py"
FIELDS = {f.name for f in dataclasses.fields(NodeState)}


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    found: list[ast.expr] = []
    if isinstance(node, ast.Assign):
        found = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        found = [node.target]
    elif isinstance(node, ast.Delete):
        found = list(node.targets)
    while found:
        t = found.pop()
        if isinstance(t, ast.Tuple | ast.List):
            found.extend(t.elts)
        else:
            yield t


def _of_nodes(e: ast.expr) -> bool:
    """``x.nodes[n]`` or ``x.nodes.get(n)``: a scheduler's NodeState."""
    if isinstance(e, ast.Subscript):
        return isinstance(e.value, ast.Attribute) and e.value.attr == "nodes"
    if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr in ("get", "pop", "setdefault"):
        return isinstance(e.func.value, ast.Attribute) and e.func.value.attr == "nodes"
    return isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "NodeState"


def _loop_over_nodes(it: ast.expr) -> str | None:
    """``x.nodes.values()`` -> "values", ``x.nodes.items()`` -> "items"."""
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) and it.func.attr in ("values", "items"):
        inner = it.func.value
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "list":
            inner = inner.args[0] if inner.args else inner
        if isinstance(inner, ast.Attribute) and inner.attr == "nodes":
            return it.func.attr
    if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "list" and it.args:
        return _loop_over_nodes(it.args[0])
    return None


def _node_names(fn: ast.AST) -> set[str]:
    """The names bound to a NodeState in one function (or module body)."""
    names: set[str] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.arg) and node.annotation is not None and "NodeState" in ast.unparse(node.annotation):
            names.add(node.arg)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                "NodeState" in ast.unparse(node.annotation) or (node.value is not None and _of_nodes(node.value))):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign | ast.NamedExpr):
            value = node.value
            if _of_nodes(value):
                for t in ([node.target] if isinstance(node, ast.NamedExpr) else node.targets):
                    names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.For | ast.comprehension):
            kind = _loop_over_nodes(node.iter)
            if kind == "values" and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif kind == "items" and isinstance(node.target, ast.Tuple) and isinstance(node.target.elts[-1], ast.Name):
                names.add(node.target.elts[-1].id)
    return names


def node_state_writes(path: Path) -> list[str]:
    """Every assignment (or del, or augmented assignment) to a NodeState field in ``path``."""
    tree = ast.parse(path.read_text())
    functions = (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))
    scopes: list[ast.AST] = [tree, *functions]
    found: set[str] = set()
    for scope in scopes:
        names = _node_names(scope)
        for node in ast.walk(scope):
            for t in _targets(node):
                if not (isinstance(t, ast.Attribute) and t.attr in FIELDS):
                    continue
                base = t.value
                if (isinstance(base, ast.Name) and base.id in names) or _of_nodes(base):
                    found.add(f"{path.relative_to(PKG.parent)}:{t.lineno} {ast.unparse(t)}")
    return sorted(found)


def _runtime_attrs() -> set[str]:
    tree = ast.parse(RUNTIME.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Runtime")
    out = {f.name for f in cls.body if isinstance(f, ast.FunctionDef)}  # its seams are properties
    for node in ast.walk(cls):
        for t in _targets(node):
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
    return out


def runtime_writes(path: Path, attrs: set[str]) -> list[str]:
    """Every assignment onto a Runtime (``rt``, ``self.rt``, ``x.rt``) in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        for t in _targets(node):
            if not (isinstance(t, ast.Attribute) and t.attr in attrs):
                continue
            base = t.value
            if (isinstance(base, ast.Name) and base.id == "rt") or (
                    isinstance(base, ast.Attribute) and base.attr == "rt"):
                found.append(f"{path.relative_to(PKG.parent)}:{t.lineno} {ast.unparse(t)}")
    return sorted(found)


def _package() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def test_the_walk_sees_a_node_state_write() -> None:
    src = ("def f(sched, ns: NodeState, name):\n"
           "    ns.healthy = False\n"
           "    node = sched.nodes.get(name)\n"
           "    node.drained, x = True, 1\n"
           "    sched.nodes[name].slowed = True\n"
           "    for other in sched.nodes.values():\n"
           "        other.failures += 1\n"
           "    for _, st in list(sched.nodes.items()):\n"
           "        st.retired = True\n"
           "    t.healthy = True  # not a NodeState: a fleet target\n")
    tmp = PKG / "_walk_probe.py"
    try:
        tmp.write_text(src)
        found = node_state_writes(tmp)
    finally:
        tmp.unlink()
    assert [f.split(" ", 1)[1] for f in found] == [
        "ns.healthy", "node.drained", "sched.nodes[name].slowed", "other.failures", "st.retired"]


def test_only_node_state_writes_its_fields() -> None:
    writes = [w for p in _package() if p != OWNER for w in node_state_writes(p)]
    assert writes == [], "NodeState changes through its own methods (scheduling/nodes.py):\n" + "\n".join(writes)


def test_nothing_assigns_onto_the_runtime_after_it_is_built() -> None:
    attrs = _runtime_attrs()
    assert {"leases", "alert", "scheduler"} <= attrs, "the walk found the Runtime's attributes"
    writes = [w for p in _package() if p != RUNTIME for w in runtime_writes(p, attrs)]
    assert writes == [], "the Runtime takes its parts at construction (Wiring):\n" + "\n".join(writes)


def test_a_transition_returns_its_events_and_the_quiet_one_is_shared_not_alerted() -> None:
    alerts: list[str] = []
    cfg = {"nodes": {"a": {"url": "http://127.0.0.1:9"}, "b": {"url": "http://127.0.0.1:10"}},
           "routes": {"r": {"path": "/r", "nodes": ["a", "b"]}}}  # b keeps the route up: its alerts are none
    rt = Runtime(parse_config(yaml.safe_dump(cfg), env={}), "t",
                 wire=lambda rt: Wiring(alert=lambda event, text, node: alerts.append(event)))
    ns = rt.scheduler.nodes["a"]
    assert ns.drain(True) == [CHANGED] and ns.drain(True) == []
    rt.node_events(ns, [CHANGED])
    assert alerts == [] and ns.drained and not ns.available(0.0)
    assert ns.drain(False) == [CHANGED] and ns.available(0.0)
    rt.node_events(ns, ns.trip(0.0))
    assert alerts == ["breaker_open"]
