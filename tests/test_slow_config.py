"""``nodes.<n>.slow``: defaults, ``off``, and `kilolined check` naming each bad key with file:line."""

from __future__ import annotations

import textwrap
from pathlib import Path

from check_run import check

from kilolined.core.config import SlowConfig, parse_config

BASE = """\
nodes:
  a:
    url: http://127.0.0.1:9001
{slow}
routes:
  gen: {{path: /gen, nodes: [a]}}
"""


def node_slow(slow: str) -> SlowConfig | None:
    return parse_config(BASE.format(slow=textwrap.indent(slow, "    ")), env={}).nodes["a"].slow


def test_on_by_default_off_disables_and_keys_override() -> None:
    assert node_slow("") == SlowConfig(ratio=1.5, min_gap_ms=5, samples=20, evaluations=3, stall_sec=30, drift=1.3)
    assert node_slow("slow: off") is None
    assert node_slow("slow:") == SlowConfig()
    assert node_slow("slow: {ratio: 2, samples: 5}") == SlowConfig(ratio=2, samples=5)


def test_check_names_each_bad_slow_key_with_its_line(tmp_path: Path) -> None:
    f = tmp_path / "k.yaml"
    f.write_text(BASE.format(slow="    slow:\n      ratio: 1\n      samples: 0\n      stall_sec: -1\n      speed: 3"))
    r = check(f)
    assert r.returncode != 0
    lines = r.stdout.splitlines()
    assert any(ln.startswith(f"{f}:5: nodes.a.slow.ratio: ") for ln in lines), lines
    assert any(ln.startswith(f"{f}:6: nodes.a.slow.samples: ") for ln in lines), lines
    assert any(ln.startswith(f"{f}:7: nodes.a.slow.stall_sec: ") for ln in lines), lines
    assert any(ln.startswith(f"{f}:8: nodes.a.slow.speed: ") for ln in lines), lines
