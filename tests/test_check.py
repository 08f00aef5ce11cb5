"""`kilolined check` as an operator runs it (a subprocess): every problem at once, each with file:line."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

from check_run import ROOT, check
from conftest import auth, base_config

from kilolined.core.config import load_config
from kilolined.core.targetglobs import local_host_reached
from kilolined.ops.reload import reload_from_file


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


# --- guessable keys (docs/CONFIG.md#guessable-keys) ----------------------------------------------

EXAMPLE = ROOT / "etc" / "kiloline.yaml"
KEY_ENV = {"KILOLINE_ADMIN_KEY": "kl_check_admin_0000000", "ALICE_KEY": "kl_check_alice_0000000",
           "BOB_KEY": "kl_check_bob_000000000"}


def line_of(path: Path, text: str) -> int:
    return next(i for i, t in enumerate(path.read_text().splitlines(), 1) if text in t)


def test_the_example_with_its_keys_set_passes() -> None:
    r = check(EXAMPLE, KEY_ENV)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == f"ok: 3 routes, 4 nodes, 2 keys in {EXAMPLE}"


def test_the_example_gives_no_key_a_loopback_or_private_target() -> None:
    """install.sh deploys the example: a glob there reaching 127.0.0.1 would hand a key the
    machine's own services through /v1/proxy."""
    cfg, _ = load_config(EXAMPLE, KEY_ENV)
    assert [g for k in cfg.keys.values() for g in k.adhoc_targets if local_host_reached(g)] == []
    r = check(EXAMPLE, KEY_ENV)
    assert "warning:" not in r.stdout


def test_check_warns_about_globs_that_reach_loopback_or_private_addresses(tmp_path: Path) -> None:
    f = tmp_path / "adhoc.yaml"
    f.write_text("nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                 "routes: {gen: {path: /gen, nodes: [gpu]}}\n"
                 "keys:\n"
                 "  bob:\n"
                 "    key: kl_Zx8fQ2mR7pL4vN9sT3wY6bC1\n"
                 "    adhoc_targets: ['http://127.0.0.1:9*', 'https://gpu-*.example.com:*', 'http://*',\n"
                 "                    'http://10.0.0.*:8188', 'http://[::1]:*', 'http://169.254.169.254*',\n"
                 "                    'http://203.0.113.*:8188', 'http://localhost:8080']\n")
    r = check(f)
    assert r.returncode == 0, r.stdout + r.stderr  # a warning: a LAN of GPUs is private by design
    warned = sorted(int(m) for m in re.findall(r"^warning: keys\.bob\.adhoc_targets\.(\d+): ", r.stdout, re.M))
    assert warned == [0, 2, 3, 4, 5, 7], r.stdout
    assert "'http://127.0.0.1:9*' lets this key reach 127.0.0.1 through /v1/proxy" in r.stdout


def test_the_example_without_its_keys_fails_naming_each(tmp_path: Path) -> None:
    r = check(EXAMPLE)
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        f"{EXAMPLE}:{line_of(EXAMPLE, '${KILOLINE_ADMIN_KEY}')}: admin.key: "
        "environment variable KILOLINE_ADMIN_KEY is not set",
        f"{EXAMPLE}:{line_of(EXAMPLE, '${ALICE_KEY}')}: keys.alice.key: environment variable ALICE_KEY is not set",
        f"{EXAMPLE}:{line_of(EXAMPLE, '${BOB_KEY}')}: keys.bob.key: environment variable BOB_KEY is not set",
    ]


def test_the_hashes_an_older_example_shipped_are_refused(tmp_path: Path) -> None:
    """sha256("foo") and sha256("bar"): what the example gave alice and bob before, on every route."""
    old = tmp_path / "old.yaml"
    text = EXAMPLE.read_text()
    for name, word in (("ALICE", "foo"), ("BOB", "bar")):
        text = text.replace(f"key: ${{{name}_KEY}}", f'key_sha256: "{hashlib.sha256(word.encode()).hexdigest()}"')
    old.write_text(text)
    r = check(old, KEY_ENV)
    assert r.returncode == 1
    alice, bob = line_of(old, "2c26b46b68ffc68ff99b"), line_of(old, "fcde2b2edba56bf40860")
    assert r.stdout.splitlines() == [
        f"{old}:{alice}: keys.alice.key_sha256: is the sha256 of a well-known word (anyone can guess the key): "
        "make one with `kilolined keygen`",
        f"{old}:{bob}: keys.bob.key_sha256: is the sha256 of a well-known word (anyone can guess the key): "
        "make one with `kilolined keygen`",
    ]


def test_short_and_well_known_clear_keys_are_refused(tmp_path: Path) -> None:
    f = tmp_path / "short.yaml"
    f.write_text("admin: {key: '${ADMIN}'}\n"
                 "keys:\n"
                 "  a: {key: '${SHORT}'}\n"
                 "  b: {key: 'fifteen-chars-x'}\n"
                 "  c: {key: 'sixteen-chars-ok'}\n"
                 "  d: {key_sha256: '" + hashlib.sha256(b"changeme").hexdigest().upper() + "'}\n"
                 "nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                 "routes: {gen: {path: /gen, nodes: [gpu]}}\n")
    r = check(f, {"ADMIN": "letmein", "SHORT": "foo"})
    assert r.returncode == 1
    short = "shorter than 16 characters (anyone can guess it): make one with `kilolined keygen`"
    assert r.stdout.splitlines() == [
        f"{f}:1: admin.key: {short}",
        f"{f}:3: keys.a.key: {short}",
        f"{f}:4: keys.b.key: {short}",
        f"{f}:6: keys.d.key_sha256: is the sha256 of a well-known word (anyone can guess the key): "
        "make one with `kilolined keygen`",
    ]
    # The key itself is never printed.
    assert "letmein" not in r.stdout and "fifteen-chars-x" not in r.stdout


def test_run_refuses_a_guessable_key(tmp_path: Path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("server: {listen: '127.0.0.1:0'}\n"
                 "keys: {alice: {key_sha256: '" + hashlib.sha256(b"foo").hexdigest() + "'}}\n"
                 "nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                 "routes: {gen: {path: /gen, nodes: [gpu]}}\n")
    r = subprocess.run([sys.executable, "-m", "kilolined", "run", "-c", str(f)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env={k: v for k, v in os.environ.items() if k != "KILOLINE_CONFIG"})
    assert r.returncode == 1
    assert f"{f}:2: keys.alice.key_sha256: is the sha256 of a well-known word" in r.stderr


async def test_a_reload_to_a_guessable_key_changes_nothing(fakegpus, gateway, http) -> None:
    gpu = await fakegpus()
    cfg = base_config({"a": gpu.url})
    gw = await gateway(cfg)
    before = gw.rt.version
    cfg["keys"]["alice"] = {"key_sha256": hashlib.sha256(b"foo").hexdigest()}
    gw.write_config(cfg)
    errors = await reload_from_file(gw.rt, reason="test")
    assert len(errors) == 1 and "keys.alice.key_sha256: is the sha256 of a well-known word" in errors[0]
    assert gw.rt.version == before
    async with http.post(gw.url + "/gen/generate", json={}, headers={"Authorization": "Bearer foo"}) as r:
        assert r.status == 401
    async with http.post(gw.url + "/gen/generate", json={}, headers=auth("alice")) as r:
        assert r.status == 200


def test_the_published_webhook_secret_is_refused_and_an_empty_one_is_unsigned(tmp_path: Path) -> None:
    """The Standard Webhooks documentation's secret (an older example's default) signs nothing
    anyone can trust: refused at its line. The example's `${KILOLINE_WEBHOOK_SECRET:-}` unset means
    unsigned callbacks, not a config error."""
    published = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    f = tmp_path / "whsec.yaml"
    body = ("nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
            "routes: {gen: {path: /gen, nodes: [gpu]}}\n")
    f.write_text(f"jobs: {{webhook_secret: '{published}'}}\n" + body)
    r = check(f, {})
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        f"{f}:1: jobs.webhook_secret: the Standard Webhooks example secret, published: anyone can sign with it; "
        "make one with `kilolined keygen --whsec`"]
    f.write_text("jobs: {webhook_secret: '${KILOLINE_WEBHOOK_SECRET:-}'}\n" + body)
    assert check(f, {}).returncode == 0
    assert load_config(f, env={})[0].jobs.webhook_secret is None
    made = subprocess.run([sys.executable, "-m", "kilolined", "keygen", "--whsec"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60).stdout.strip()
    assert re.fullmatch(r"whsec_[A-Za-z0-9+/]{32}", made) and len(base64.b64decode(made[6:])) == 24
    assert check(f, {"KILOLINE_WEBHOOK_SECRET": made}).returncode == 0
