"""scripts/install.sh into a temporary root, then the unit's ExecStart= run the way systemd would.

install.sh runs for real (venv, pip, group, permissions, the rendered unit) with its path
overrides and ``--no-start``; nothing under /etc or /opt of this machine is touched except one
throw-away system group. The daemon is then started from the rendered unit's ExecStart= as a uid
that exists nowhere (what DynamicUser= hands out) with the unit's SupplementaryGroups= and the
environment systemd would give it (Environment=, the EnvironmentFile= read as root,
STATE_DIRECTORY): if install.sh left the config unreadable to that uid, /healthz never answers.
The same flow under a real systemd as PID 1 is scripts/boot_test.sh (run by .ci/run).

Needs root (chown, a group, setuid); skipped otherwise.
"""

from __future__ import annotations

import contextlib
import grp
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import stat
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import base_config
from daemon import free_port, service_values, verify
from install_run import Install, read_env_file

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="install.sh needs root"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) not installed"),
    pytest.mark.skipif(shutil.which("groupadd") is None, reason="groupadd (passwd) not installed"),
]


def mode_owner(path: Path) -> tuple[int, str, str]:
    st = path.stat()
    return stat.S_IMODE(st.st_mode), pwd.getpwuid(st.st_uid).pw_name, grp.getgrgid(st.st_gid).gr_name


def unused_id() -> int:
    """A uid and gid no account has, in the range systemd's DynamicUser= allocates from."""
    for n in range(61184, 65520):
        try:
            pwd.getpwuid(n)
            continue
        except KeyError:
            pass
        try:
            grp.getgrgid(n)
        except KeyError:
            return n
    raise AssertionError("no free id in 61184..65519")


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


# --- what install.sh lays down --------------------------------------------------------------------


def test_config_is_readable_by_the_group_and_written_by_root_only(installed: Install) -> None:
    g = installed.group
    assert mode_owner(installed.etc) == (0o750, "root", g)
    assert mode_owner(installed.etc / "kiloline.yaml") == (0o640, "root", g)
    assert mode_owner(installed.etc / "kiloline.env") == (0o640, "root", g)
    assert read_env_file(installed.etc / "kiloline.env")["KILOLINE_ADMIN_KEY"].startswith("kl_")
    # Installed under umask 077, yet the venv is world-readable: the dynamic uid is in no other group.
    exe = installed.prefix / "venv" / "bin" / "kilolined"
    assert mode_owner(exe)[0] & 0o005 == 0o005
    assert mode_owner(installed.prefix / "venv" / "pyvenv.cfg")[0] & 0o004


def test_unit_is_rendered_with_the_overrides(installed: Install) -> None:
    text = installed.unit.read_text()
    assert "/opt/kiloline" not in text and "/etc/kiloline" not in text
    [start] = service_values(text, "ExecStart")
    argv = shlex.split(start)
    assert argv[0] == str(installed.prefix / "venv" / "bin" / "kilolined")
    assert argv[argv.index("-c") + 1] == str(installed.etc / "kiloline.yaml")
    assert service_values(text, "EnvironmentFile") == [f"-{installed.etc}/kiloline.env"]
    assert service_values(text, "SupplementaryGroups") == [installed.group]
    assert service_values(text, "DynamicUser") == ["yes"]
    assert service_values(text, "Type") == ["notify"]
    if shutil.which("systemd-analyze") is not None:
        rc, ours = verify(installed.unit_dir)
        assert rc == 0 and not ours, ours


# --- the unit's ExecStart= as the unprivileged uid systemd would use --------------------------------


def systemd_like_env(installed: Install, text: str, state_dir: Path) -> dict[str, str]:
    """What PID 1 hands the service: a small base, Environment=, the EnvironmentFile= (read as root)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           "HOME": "/", "STATE_DIRECTORY": str(state_dir)}
    for assignment in service_values(text, "Environment"):
        for item in shlex.split(assignment):
            k, _, v = item.partition("=")
            env[k] = v
    for spec in service_values(text, "EnvironmentFile"):
        path = Path(spec.removeprefix("-"))
        if path.exists() or not spec.startswith("-"):
            env.update(read_env_file(path))
    return env


def expand(word: str, env: dict[str, str]) -> str:
    """${VAR} in an ExecStart= word, as systemd expands it (a variable it does not have is a bug here)."""
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word)


def test_exec_start_serves_as_an_unprivileged_uid(installed: Install) -> None:
    text = installed.unit.read_text()
    uid = unused_id()
    groups = [str(grp.getgrnam(name).gr_gid) for value in service_values(text, "SupplementaryGroups")
              for name in value.split()]
    # StateDirectory=: systemd creates it for the dynamic uid, 0700.
    state_dir = installed.root / "var" / "lib" / "kiloline"
    state_dir.mkdir(parents=True)
    os.chown(state_dir, uid, uid)
    state_dir.chmod(0o700)
    env = systemd_like_env(installed, text, state_dir)

    # An operator's edit: a node on loopback, the admin key from the env file. Rewritten in place,
    # so the mode and owner stay exactly what install.sh set.
    port = free_port()
    cfg = base_config({"a": f"http://127.0.0.1:{free_port()}"})
    cfg["server"].update(listen=f"127.0.0.1:{port}", state_dir="${STATE_DIRECTORY}")
    cfg["admin"] = {"key": "${KILOLINE_ADMIN_KEY}"}
    with open(installed.etc / "kiloline.yaml", "r+") as f:
        f.truncate()
        f.write(yaml.safe_dump(cfg))
    assert mode_owner(installed.etc / "kiloline.yaml") == (0o640, "root", installed.group)

    [start] = service_values(text, "ExecStart")
    argv = [expand(w, env) for w in shlex.split(start)]
    setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}",
               f"--groups={','.join(groups)}" if groups else "--clear-groups", "--no-new-privs", "--"]
    log = installed.root / "daemon.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(setpriv + argv, env=env, stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                cwd="/")
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        status = 0
        while status != 200:
            assert proc.poll() is None, f"kilolined exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no /healthz in 60 s:\n{log.read_text()}"
            with contextlib.suppress(OSError):
                status, _ = get(base + "/healthz")
            time.sleep(0.1)
        # The admin key came from the env file through the environment, as systemd passes it.
        key = env["KILOLINE_ADMIN_KEY"]
        status, body = get(base + "/admin/state", {"Authorization": f"Bearer {key}"})
        assert status == 200, body
        assert json.loads(body)["config"]["last_error"] is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Permission denied" not in log.read_text()
    assert "Traceback" not in log.read_text()


# --- again, and away --------------------------------------------------------------------------------


def test_rerun_repairs_an_older_installs_permissions_and_keeps_the_key(installed: Install) -> None:
    env_before = (installed.etc / "kiloline.env").read_bytes()
    yaml_before = (installed.etc / "kiloline.yaml").read_bytes()
    unit_before = installed.unit.read_bytes()
    # What the previous install.sh left: root:root 0750, files with root's umask.
    os.chown(installed.etc, 0, 0)
    installed.etc.chmod(0o750)
    for name in ("kiloline.yaml", "kiloline.env"):
        os.chown(installed.etc / name, 0, 0)
        (installed.etc / name).chmod(0o600)
    installed.run("--no-start")
    assert (installed.etc / "kiloline.env").read_bytes() == env_before
    assert (installed.etc / "kiloline.yaml").read_bytes() == yaml_before
    assert installed.unit.read_bytes() == unit_before
    assert mode_owner(installed.etc) == (0o750, "root", installed.group)
    for name in ("kiloline.yaml", "kiloline.env"):
        assert mode_owner(installed.etc / name) == (0o640, "root", installed.group)


def test_uninstall_removes_unit_and_venv_and_keeps_the_config(installed: Install) -> None:
    installed.run("--uninstall", "--no-start")
    assert not installed.unit.exists()
    assert not installed.prefix.exists()
    assert (installed.etc / "kiloline.yaml").exists() and (installed.etc / "kiloline.env").exists()
