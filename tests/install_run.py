"""Runs install.sh into a temporary root and reads what it installed."""

from __future__ import annotations

import contextlib
import grp
import os
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL = REPO / "scripts" / "install.sh"


@dataclass
class Install:
    root: Path
    prefix: Path
    etc: Path
    unit_dir: Path
    group: str

    @property
    def unit(self) -> Path:
        return self.unit_dir / "kilolined.service"

    def env(self) -> dict[str, str]:
        return {**os.environ, "KILOLINE_PREFIX": str(self.prefix), "KILOLINE_ETC": str(self.etc),
                "KILOLINE_UNIT_DIR": str(self.unit_dir), "KILOLINE_GROUP": self.group}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        # A hardened root umask: the venv must still be readable by the service's uid.
        p = subprocess.run(["bash", "-c", 'umask 077 && exec bash "$0" "$@"', str(INSTALL), *args],
                           env=self.env(), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, f"install.sh {' '.join(args)} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
        return p


@pytest.fixture(scope="module")
def installed() -> Iterator[Install]:
    # Not under pytest's tmp_path: its parents are 0700, which no unprivileged uid can traverse.
    root = Path(tempfile.mkdtemp(prefix="kl-install-"))
    root.chmod(0o755)
    group = "kltest" + secrets.token_hex(3)
    # Paths unlike the defaults, so a default left in the rendered unit cannot hide among them.
    inst = Install(root, root / "srv" / "kl", root / "conf" / "kl", root / "units", group)
    try:
        inst.run("--no-start")
        yield inst
    finally:
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(KeyError):
            grp.getgrnam(group)
            subprocess.run(["groupdel", group], check=False, timeout=60)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as systemd's EnvironmentFile= reads them (no quotes in what install.sh writes)."""
    out = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", ";")):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out
