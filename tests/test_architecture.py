"""The package's import graph has layers: no cycle, no function-level import of its own modules.

A cycle held open by imports inside functions is how a hub (a Runtime every module reaches
into) hides; this test keeps it from coming back. docs/ARCHITECTURE.md draws the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kilolined"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _target(mods: dict[str, Path], base: str, name: str | None) -> str | None:
    if name is not None and f"{base}.{name}" in mods:
        return f"{base}.{name}"
    return base if base in mods else None


def _imports(mods: dict[str, Path], name: str, tree: ast.Module) -> tuple[set[str], list[str]]:
    """(modules imported at module level, incl. TYPE_CHECKING blocks; function-level imports)."""
    top: set[str] = set()
    nested: list[str] = []
    pkg = name if mods[name].name == "__init__.py" else name.rsplit(".", 1)[0]

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        found = []
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names if a.name.startswith("kilolined")]
            return [t for t in (_target(mods, f, None) for f in found) if t]
        base = node.module or ""
        if node.level:
            base = ".".join(pkg.split(".")[: len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
        if not base.startswith("kilolined"):
            return []
        return [t for t in (_target(mods, base, a.name) for a in node.names) if t]

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom):
                ts = targets(child)
                if in_func:
                    nested.extend(f"{name}:{child.lineno} imports {t}" for t in ts)
                else:
                    top.update(ts)
            visit(child, in_func or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    top.discard(name)
    return top, nested


def _graph() -> tuple[dict[str, set[str]], list[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    nested: list[str] = []
    for name, path in mods.items():
        top, inner = _imports(mods, name, ast.parse(path.read_text()))
        graph[name] = top
        nested.extend(inner)
    return graph, nested


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m):], m]
            if m not in state and (found := dfs(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := dfs(n)):
            return found
    return None


def test_the_checker_sees_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_package_has_no_import_cycle() -> None:
    graph, _ = _graph()
    assert len(graph) > 40 and graph["kilolined.app"], "the walk found the package"
    assert _cycle(graph) is None


def test_no_function_level_imports_of_the_package() -> None:
    _, nested = _graph()
    assert nested == []


def test_lease_release_lives_in_one_module() -> None:
    """Only the lease scope gives a slot back (the scheduler's own bookkeeping aside)."""
    callers = []
    for path in PKG.rglob("*.py"):
        if path.name in ("lease.py", "queue.py"):
            continue
        if path.relative_to(PKG).as_posix() == "cluster/leases.py":
            continue  # the cluster lease store: its own bookkeeping, like the scheduler's
        text = path.read_text()
        for needle in ("scheduler.release(", "scheduler.requeue(", ".release(lease"):
            if needle in text:
                callers.append(f"{path.name}: {needle}")
    assert callers == []


def test_node_verdicts_live_in_one_module() -> None:
    """Only the lease scope (node_ok / node_failed) feeds a node's health and breaker: the one
    hook where a node's answer is judged."""
    callers = []
    for path in PKG.rglob("*.py"):
        if path.name == "lease.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for needle in (".node_success(", ".node_failure("):
                if needle in code:
                    callers.append(f"{path.relative_to(PKG)}:{lineno}: {line.strip()}")
    assert callers == []
