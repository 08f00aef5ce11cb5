"""Runs the `kilolined` command line in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = {**os.environ, "KILOLINE_ADMIN_KEY": "kl_cli_admin_dummy", "ALICE_KEY": "kl_cli_alice_dummy",
       "BOB_KEY": "kl_cli_bob_dummy"}


def kl(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, "-m", "kilolined", *args], cwd=ROOT, env=env or ENV, capture_output=True, text=True,
                          timeout=timeout)
