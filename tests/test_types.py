"""The package type-checks: mypy, configured in pyproject.toml ([tool.mypy]), reports no error.

The check runs as part of the test suite so that the README's one test command (and CI) keeps
it at zero; mypy and the stubs it needs are pinned in the ``test`` extra of setup.cfg.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed (pip install -e '.[test]')")
def test_the_package_has_no_type_errors() -> None:
    # cwd is the repository root, so mypy reads its settings from pyproject.toml.
    done = subprocess.run([sys.executable, "-m", "mypy", "kilolined"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    checked = re.search(r"no issues found in (\d+) source files", report)
    assert checked and int(checked.group(1)) > 40, f"mypy checked the package: {report}"
