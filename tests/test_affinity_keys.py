"""The prefix keys' hash and the index's bisection match (kilolined.scheduling.affinity, SPEC §13)."""

from __future__ import annotations

import os
import subprocess
import sys

from kilolined.scheduling.affinity import PrefixIndex, chain, prefix_affinity, rendezvous, seed

_PRINT_KEYS = ("from kilolined.scheduling.affinity import chain, seed;"
               "print(chain(b'x' * 1000 + b'tail', seed('r', 'm'), 256))")


def _keys_in_a_process(hash_seed: str) -> tuple[int, ...]:
    out = subprocess.run([sys.executable, "-c", _PRINT_KEYS], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": hash_seed})
    return tuple(int(x) for x in out.stdout.strip("()\n ,").split(","))


def test_the_first_key_is_the_same_in_every_process() -> None:
    # Gateways and restarts must agree where a new prefix goes: the rendezvous key is process-free.
    a, b = _keys_in_a_process("1"), _keys_in_a_process("2")
    assert len(a) == len(b) == 4
    assert a[0] == b[0] == chain(b"x" * 1000 + b"tail", seed("r", "m"), 256)[0]
    assert rendezvous(a[0], ["n1", "n2", "n3"]) == rendezvous(b[0], ["n1", "n2", "n3"])


def test_swapped_blocks_give_other_keys() -> None:
    s = seed("r", "m")
    a, b = chain(b"h" * 16 + b"A" * 16 + b"B" * 16, s, 16), chain(b"h" * 16 + b"B" * 16 + b"A" * 16, s, 16)
    assert a[0] == b[0] and a[1] != b[1] and a[2] != b[2]


def test_a_short_last_block_is_keyed() -> None:
    s = seed("r", "m")
    a, b = chain(b"q" * 40, s, 16), chain(b"q" * 41, s, 16)
    assert a[:2] == b[:2] and a[2] != b[2] and len(a) == len(b) == 3


def test_a_dropped_head_matches_nothing_though_its_tail_stays() -> None:
    long = prefix_affinity("r", {"model": "m", "prompt": "doc " * 500}, 64)
    short = prefix_affinity("r", {"model": "m", "prompt": "doc " * 100}, 64)
    assert long is not None and short is not None and long.keys[:6] == short.keys[:6]
    idx = PrefixIndex()
    idx.record(long.keys)
    assert idx.match(long.keys) == len(long.keys) and idx.match(short.keys) == 6  # its short last block is its own
    idx.drop(short.keys)  # a misprediction on the short one: the long one's tail is still here
    assert idx.match(long.keys) == 0 and idx.match(short.keys) == 0


def test_eviction_keeps_a_chain_head_and_the_match_counts_it() -> None:
    a = prefix_affinity("r", {"model": "m", "prompt": "a" * 4000}, 64)
    b = prefix_affinity("r", {"model": "m", "prompt": "b" * 4000}, 64)
    assert a is not None and b is not None
    idx = PrefixIndex(limit=len(a.keys) + 10)
    idx.record(a.keys)
    idx.record(b.keys)  # pushes out the deepest keys of a first
    assert idx.match(b.keys) == len(b.keys)
    assert idx.match(a.keys) == 10
