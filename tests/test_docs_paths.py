"""The docs and scripts name no path of the machine they were written on: a default the reader
cannot have (/work/…, /root/…) is an env var or a repo-relative path instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "scripts").iterdir()])
# A directory under /work or /root; a glob such as install.sh's `/root/*` refusal is not a path.
MACHINE_PATH = re.compile(r"(?<![\w.$}])/(?:work|root)/\w")


@pytest.mark.parametrize("path", [p for p in FILES if p.is_file()], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_machine_specific_path(path: Path) -> None:
    hits = [f"{path.name}:{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if MACHINE_PATH.search(line)]
    assert not hits, hits
