"""A clear-text key of 16 characters or more can still be guessed: repeats, runs, repeated words.
Such a key is refused as a short one is (docs/CONFIG.md#guessable-keys), at its line, and a key
from `kilolined keygen` always passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from check_run import ROOT, check

from kilolined.core.auth import new_key
from kilolined.core.config import WELL_KNOWN_KEYS, ConfigError, parse_config
from kilolined.core.keystrength import MIN_KEY_BITS, key_bits

GUESSABLE = ("aaaaaaaaaaaaaaaa", "1234567890123456", "passwordpassword", "abcdefghijklmnopqrstuvwxyz",
             "Password1234567890", "abcabcabcabcabcabc", "9876543210987654", "kl_secret_0000000000",
             "changeme-changeme-changeme")
ENTROPY = ("has too little entropy (repeats, runs like 1234 or abcd, well-known words: anyone can guess it): "
           "make one with `kilolined keygen`")


def test_keys_that_are_long_but_guessable_are_refused_at_their_line(tmp_path: Path) -> None:
    f = tmp_path / "weak.yaml"
    f.write_text("admin: {key: '${ADMIN}'}\n"
                 "keys:\n"
                 "  a: {key: 'aaaaaaaaaaaaaaaa'}\n"
                 "  b: {key: '1234567890123456'}\n"
                 "  c: {key: '${C_KEY}'}\n"
                 "  d: {key: '" + new_key() + "'}\n"
                 "nodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                 "routes: {gen: {path: /gen, nodes: [gpu]}}\n")
    r = check(f, {"ADMIN": "aaaaaaaaaaaaaaaa", "C_KEY": "passwordpassword"})
    assert r.returncode == 1
    assert r.stdout.splitlines() == [
        f"{f}:1: admin.key: {ENTROPY}",
        f"{f}:3: keys.a.key: {ENTROPY}",
        f"{f}:4: keys.b.key: {ENTROPY}",
        f"{f}:5: keys.c.key: {ENTROPY}",
    ]
    assert "passwordpassword" not in r.stdout + r.stderr  # the key itself is never printed


@pytest.mark.parametrize("key", GUESSABLE)
def test_guessable_keys_score_under_the_bound(key: str) -> None:
    assert key_bits(key, WELL_KNOWN_KEYS) < MIN_KEY_BITS
    with pytest.raises(ConfigError, match="too little entropy"):
        parse_config("keys: {k: {key: '" + key + "'}}\nnodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                     "routes: {gen: {path: /gen, nodes: [gpu]}}\n", env={})


def test_keygen_keys_always_pass() -> None:
    """`kilolined keygen` as an operator runs it, then 2,000 more of its keys: each far above the bound."""
    out = subprocess.run([sys.executable, "-m", "kilolined", "keygen", "--id", "k"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    keys = [out.splitlines()[0], *(new_key() for _ in range(2000))]
    assert min(key_bits(k, WELL_KNOWN_KEYS) for k in keys) > 3 * MIN_KEY_BITS
    for k in keys[:50]:
        parse_config("keys: {k: {key: '" + k + "'}}\nnodes: {gpu: {url: 'http://127.0.0.1:1'}}\n"
                     "routes: {gen: {path: /gen, nodes: [gpu]}}\n", env={})


def test_random_keys_of_sixteen_characters_pass() -> None:
    """What operators make by hand (openssl rand, a password manager) passes: the estimate counts
    repeats and runs, not the alphabet alone."""
    for key in ("fa027e8061e32bd5", "Zq3vN8rT1xW6yB4m", "sixteen-chars-ok", "correct-horse-battery-staple",
                "kl_alice_key_0000000000000000000000"):
        assert key_bits(key, WELL_KNOWN_KEYS) >= MIN_KEY_BITS, key
