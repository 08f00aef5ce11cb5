"""scripts/install.sh never leaves a service that accepts a guessable key: the example's keys are
generated into kiloline.env, and an older config with the example's well-known hashes stops it.

Runs install.sh for real with --no-start into a temporary root (tests/test_install.py's fixture);
needs root, skipped otherwise.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import shutil
import subprocess

import pytest
from install_run import INSTALL, Install, read_env_file

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="install.sh needs root"),
    pytest.mark.skipif(shutil.which("groupadd") is None, reason="groupadd (passwd) not installed"),
]


def test_every_key_the_example_needs_is_generated(installed: Install) -> None:
    env = read_env_file(installed.etc / "kiloline.env")
    keys = [env["KILOLINE_ADMIN_KEY"], env["ALICE_KEY"], env["BOB_KEY"]]
    assert all(k.startswith("kl_") and len(k) == 35 for k in keys), env.keys()
    assert len(set(keys)) == 3
    # and the job callbacks' signing secret the example reads from the environment: its own, random
    whsec = env["KILOLINE_WEBHOOK_SECRET"]
    assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{32}", whsec) and len(base64.b64decode(whsec[6:])) == 24
    # The service's config passes check with exactly that environment (install.sh ran it too).
    r = subprocess.run([str(installed.prefix / "venv" / "bin" / "kilolined"), "check", "-c",
                        str(installed.etc / "kiloline.yaml")], env={"PATH": os.environ["PATH"], **env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("ok: 3 routes, 4 nodes, 2 keys"), r.stdout + r.stderr


def test_a_rerun_keeps_the_keys_and_adds_one_a_new_key_needs(installed: Install) -> None:
    before = read_env_file(installed.etc / "kiloline.env")
    path = installed.etc / "kiloline.yaml"
    text = path.read_text()
    path.write_text(text.replace("  bob:\n", "  carol:\n    key: ${CAROL_KEY}\n  bob:\n", 1))
    try:
        p = installed.run("--no-start")
        after = read_env_file(installed.etc / "kiloline.env")
        assert {k: after[k] for k in before} == before
        assert after["CAROL_KEY"].startswith("kl_") and "CAROL_KEY" in p.stdout
        assert after["CAROL_KEY"] not in p.stdout + p.stderr  # client keys stay in the file
    finally:
        path.write_text(text)


def test_an_older_config_with_the_examples_hashes_stops_the_install(installed: Install) -> None:
    path = installed.etc / "kiloline.yaml"
    text = path.read_text()
    foo = hashlib.sha256(b"foo").hexdigest()
    path.write_text(text.replace("key: ${ALICE_KEY}", f'key_sha256: "{foo}"', 1))
    try:
        p = subprocess.run(["bash", str(INSTALL), "--no-start"], env=installed.env(), capture_output=True,
                           text=True, timeout=600)
        assert p.returncode != 0
        assert "keys.alice.key_sha256: is the sha256 of a well-known word" in p.stdout + p.stderr
        assert f"fix {installed.etc}/kiloline.yaml" in p.stderr
    finally:
        path.write_text(text)


def test_an_older_config_with_the_published_webhook_secret_upgrades_to_its_own(installed: Install) -> None:
    """An install made from an older example reads ``${KILOLINE_WEBHOOK_SECRET:-whsec_MfKQ9r8…}``
    (the Standard Webhooks documentation's secret, now refused) and has no such variable in its
    env file: install.sh generates one, which the variable's default never reaches, so the
    upgrade passes `check` and the callbacks are signed with a secret of its own."""
    path, env_path = installed.etc / "kiloline.yaml", installed.etc / "kiloline.env"
    text, env_text = path.read_text(), env_path.read_text()
    old = 'webhook_secret: "${KILOLINE_WEBHOOK_SECRET:-whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw}"'
    path.write_text(re.sub(r'webhook_secret: "\$\{KILOLINE_WEBHOOK_SECRET:-\}"', lambda _: old, text, count=1))
    assert old in path.read_text()
    env_path.write_text("".join(ln + "\n" for ln in env_text.splitlines()
                                if not ln.startswith("KILOLINE_WEBHOOK_SECRET=")))
    try:
        p = installed.run("--no-start")
        env = read_env_file(env_path)
        assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{32}", env["KILOLINE_WEBHOOK_SECRET"]), p.stdout
        assert "KILOLINE_WEBHOOK_SECRET" in p.stdout and env["KILOLINE_WEBHOOK_SECRET"] not in p.stdout + p.stderr
    finally:
        path.write_text(text)
        env_path.write_text(env_text)
