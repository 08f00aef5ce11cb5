"""`kilolined check` as an operator runs it (a subprocess): every problem at once, each with file:line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check(path: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in ("KILOLINE_CONFIG", "KILOLINE_ADMIN_KEY")}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "kilolined", "check", "-c", str(path)], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)


def test_schema_and_cross_reference_errors_are_reported_together(tmp_path: Path) -> None:
    f = tmp_path / "both.yaml"
    f.write_text(
        "nodes:\n"
        "  gpu: {url: 'http://127.0.0.1:1'}\n"
        "routes:\n"
        "  gen:\n"
        "    path: /gen\n"
        "    nodes: [gpu]\n"
        "    max_concurrency: 0\n"
        "  tts:\n"
        "    path: /tts\n"
        "    nodes: [ghost]\n"
        "keys:\n"
        "  k:\n"
        "    key_sha256: '" + "ab" * 32 + "'\n"
        "    routes: [gen, nope]\n"
    )
    r = check(f)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        f"{f}:7: routes.gen.max_concurrency: Input should be greater than or equal to 1",
        f"{f}:10: routes.tts.nodes.0: unknown node 'ghost'",
        f"{f}:14: keys.k.routes.1: unknown route 'nope'",
    ]


def test_a_route_with_a_schema_error_still_has_its_nodes_checked(tmp_path: Path) -> None:
    f = tmp_path / "route.yaml"
    f.write_text("nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                 "routes:\n"
                 "  gen: {path: /gen, nodes: [gpu, ghost], drop_policy: sometimes}\n")
    r = check(f)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and all(ln.startswith(f"{f}:3: routes.gen.") for ln in lines), lines
    assert "routes.gen.drop_policy: " in lines[0] and lines[1].endswith("routes.gen.nodes.1: unknown node 'ghost'")


def test_rules_between_valid_routes_hold_while_another_section_is_wrong(tmp_path: Path) -> None:
    # A shared path needs a match: said even while server.listen is broken.
    f = tmp_path / "paths.yaml"
    f.write_text("server: {listen: nope}\n"
                 "nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                 "routes:\n"
                 "  a: {path: /gen, nodes: [gpu]}\n"
                 "  b: {path: /gen, nodes: [gpu]}\n")
    r = check(f)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{f}:1: server.listen: ")
    assert lines[1].startswith(f"{f}:5: routes.b.path: '/gen' already used by route 'a'"), lines
    assert len(lines) == 2
