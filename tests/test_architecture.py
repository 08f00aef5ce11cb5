"""The package's import graph has layers: no import goes up, no cycle, no function-level import of
its own modules.

A cycle held open by imports inside functions is how a hub (a Runtime every module reaches
into) hides; this test keeps it from coming back. docs/ARCHITECTURE.md draws the layers; LAYERS
below is its table, and a test keeps the two the same.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "kilolined"
DOC = PKG.parent / "docs" / "ARCHITECTURE.md"

# The layer table of docs/ARCHITECTURE.md ("Layers"), top to bottom: a module imports only its own
# layer and the ones below. Names are paths under kilolined/ without ".py"; "x/" is the package
# kilolined/x/ except its modules that another row names; "__init__" is kilolined/__init__.py.
LAYERS: dict[str, tuple[str, ...]] = {
    "entry": ("__main__", "cli", "demo", "status"),
    "HTTP": ("edge/", "cluster/build"),
    "modes": ("modes/", "cluster/jobs"),
    "kinds": ("adapters/",),
    "lease": ("scheduling/lease",),
    "fleet": ("fleet/loop",),
    "live state": ("ops/runtime", "ops/speedwatch", "ops/health", "ops/views", "ops/history", "ops/adhoc", "ops/reload",
                   "ops/systemd"),
    "cluster": ("cluster/",),
    "wire": ("wire/", "fleet/vastai", "fleet/runpod", "fleet/wire"),
    "side": ("ops/",),
    "fake GPU": ("fakegpu/",),
    "core (pure)": ("__init__", "core/", "scheduling/", "fleet/"),
}

# Imports that go up the table and stay, each with the reason it cannot go (importer, imported).
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


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


def _imports(mods: dict[str, Path], name: str, tree: ast.Module) -> tuple[set[str], list[tuple[int, str]]]:
    """(modules imported at module level, incl. TYPE_CHECKING blocks; function-level imports: (line, module))."""
    top: set[str] = set()
    nested: list[tuple[int, str]] = []
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
                    nested.extend((child.lineno, t) for t in ts)
                else:
                    top.update(ts)
            visit(child, in_func or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(tree, False)
    top.discard(name)
    return top, nested


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level imports per module; every import per module, function-level ones included)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    every: dict[str, set[str]] = {}
    for name, path in mods.items():
        top, inner = _imports(mods, name, ast.parse(path.read_text()))
        graph[name] = top
        every[name] = top | {t for _, t in inner if t != name}
    return graph, every


def _nested() -> list[str]:
    mods = _modules()
    found = []
    for name, path in mods.items():
        _, inner = _imports(mods, name, ast.parse(path.read_text()))
        found.extend(f"{name}:{line} imports {t}" for line, t in inner)
    return found


def _module_of(entry: str) -> str:
    """A table entry as a dotted module name (a package entry: the package)."""
    parts = [p for p in entry.split("/") if p]
    return "kilolined" if parts == ["__init__"] else ".".join(["kilolined", *parts])


def _layer_of(layers: dict[str, tuple[str, ...]]) -> dict[str, tuple[int, str]]:
    """Entry module -> (rank, layer): rank 0 is the top layer."""
    return {_module_of(e): (rank, layer) for rank, (layer, entries) in enumerate(layers.items()) for e in entries}


def _rank(table: dict[str, tuple[int, str]], packages: set[str], module: str) -> tuple[int, str] | None:
    """The row of a module: its own entry, else the nearest package entry that holds it."""
    if module in table:
        return table[module]
    parts = module.split(".")
    for n in range(len(parts) - 1, 0, -1):
        pkg = ".".join(parts[:n])
        if pkg in packages:
            return table[pkg]
    return None


def _upward(layers: dict[str, tuple[str, ...]], every: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """Every import from a module to one in a higher layer: (importer, imported) -> the two layers."""
    table = _layer_of(layers)
    packages = {_module_of(e) for entries in layers.values() for e in entries if e.endswith("/")}
    found = {}
    for importer, targets in every.items():
        low = _rank(table, packages, importer)
        for target in targets:
            high = _rank(table, packages, target)
            if low is not None and high is not None and high[0] < low[0]:
                found[(importer, target)] = f"{low[1]} imports {high[1]}"
    return found


def _doc_layers() -> dict[str, tuple[str, ...]]:
    """The layer table of docs/ARCHITECTURE.md: layer -> the modules column's `names`."""
    text = DOC.read_text()
    section = text[text.index("\n## Layers"):]
    section = section[: section.index("\n## ", 1)]
    rows: dict[str, tuple[str, ...]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[0] in ("layer", "") or set(cells[0]) <= {"-", " "}:
            continue
        rows[cells[0]] = tuple(re.findall(r"`([^`]+)`", cells[1]))
    return rows


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
    assert len(graph) > 40 and graph["kilolined.edge.app"], "the walk found the package"
    assert _cycle(graph) is None


def test_no_function_level_imports_of_the_package() -> None:
    assert _nested() == []


def test_the_layer_table_is_the_docs_table() -> None:
    assert _doc_layers() == LAYERS


def test_every_module_has_a_layer_and_every_entry_a_module() -> None:
    mods = _modules()
    table = _layer_of(LAYERS)
    packages = {_module_of(e) for entries in LAYERS.values() for e in entries if e.endswith("/")}
    assert sorted(m for m in mods if _rank(table, packages, m) is None) == []
    assert sorted(m for m in table if m not in mods) == []
    entries = [e for es in LAYERS.values() for e in es]
    assert sorted({e for e in entries if entries.count(e) > 1}) == [], "a module is in one layer"


def test_the_checker_sees_an_upward_import() -> None:
    layers = {"top": ("a", "p/"), "low": ("b", "p/low")}
    every = {"kilolined.b": {"kilolined.a"}, "kilolined.p.low": {"kilolined.p.x"}, "kilolined.a": {"kilolined.b"},
             "kilolined.p.x": {"kilolined.p.low"}}
    assert _upward(layers, every) == {("kilolined.b", "kilolined.a"): "low imports top",
                                      ("kilolined.p.low", "kilolined.p.x"): "low imports top"}


def test_no_import_goes_up_the_layers() -> None:
    """Every import counts: module level, under TYPE_CHECKING, inside a function."""
    _, every = _graph()
    up = _upward(LAYERS, every)
    assert {edge: why for edge, why in up.items() if edge not in UPWARD_ALLOWED} == {}
    assert sorted(set(UPWARD_ALLOWED) - set(up)) == [], "an allowed exception that no longer goes up"


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


def test_slot_counters_have_one_python_writer() -> None:
    """In-flight, capacity and swap counts are written by Scheduler.grant / release only (the
    cluster store calls grant for a grant Redis made; its Lua twin is scripts.grant)."""
    writers = []
    pattern = re.compile(r"\.(inflight|node_inflight|capacity_used|swaps)(\[[^\]]*\])?\s*([+-]=|=(?!=))")
    for path in PKG.rglob("*.py"):
        if path.name == "queue.py" or "fakegpu" in path.parts:
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line.split("#", 1)[0]):
                writers.append(f"{path.relative_to(PKG)}:{lineno}: {line.strip()}")
    assert writers == []



TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str, level: int) -> bool:
    """Whether an import names one of tests/'s test modules (a library's ``x.test_utils`` is not)."""
    parts = name.split(".") if name else []
    if not parts or not parts[-1].startswith("test_"):
        return False
    if level:  # relative: within tests/ by construction
        return True
    if parts[0] == "tests":
        parts = parts[1:]
    return TESTS.joinpath(*parts).with_suffix(".py").is_file()


def _test_module_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) for each import of a test module, plain, dotted or relative, at any depth."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if _is_test_module(a.name, 0)]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if _is_test_module(base, node.level):
                out.append((node.lineno, "." * node.level + base))
            # `from . import test_x` / `from cluster import test_x`: the module is an imported name
            out += [(node.lineno, f"{'.' * node.level}{base}.{a.name}".replace("..", ".")) for a in node.names
                    if _is_test_module(f"{base}.{a.name}".lstrip("."), node.level)]
    return out


def test_the_checker_sees_a_test_importing_a_test() -> None:
    src = ("from test_lease import runtime\nfrom .test_cluster import x\nimport tests.cluster.test_cluster\n"
           "from cluster import test_cluster_wire\nfrom aiohttp.test_utils import make_mocked_request\n"
           "from fakes import FakeTelegram\nfrom lease_props import runtime\n")
    assert [m for _, m in _test_module_imports(ast.parse(src))] == [
        "test_lease", ".test_cluster", "tests.cluster.test_cluster", "cluster.test_cluster_wire"]


def test_no_test_imports_another_test_module() -> None:
    # What tests share is a fixture in a conftest.py or a helper module (fakes.py, cluster/harness.py):
    # a test module imported by another runs its module-level code twice and ties the two files.
    found = [f"{p.relative_to(TESTS)}:{line}: {mod}" for p in sorted(TESTS.rglob("*.py"))
             for line, mod in _test_module_imports(ast.parse(p.read_text()))]
    assert not found, "test modules import test modules:\n" + "\n".join(found)
