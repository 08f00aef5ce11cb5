"""Runs `kilolined check` on a config, as the check tests do."""

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
