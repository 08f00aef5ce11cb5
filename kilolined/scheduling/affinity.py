"""Prefix and session affinity (docs/CONFIG.md#affinity): which node already holds a
request's prompt.

Pure: no I/O, no clock. The gateway cannot see a node's KV cache, so it keeps its own guess: the
canonical text of each request (its model, then every chat message as ``role``, NUL, content;
or a completion's prompt) is cut into blocks, and block i's key is a 64-bit hash of block i and
key i-1 (the first seeded by route and model), so one key names the whole prefix up to it. Each
node keeps a bounded LRU of the keys dispatched to it; a request's match on a node is the number
of its leading keys found there. Recording at dispatch, not at the answer, makes a prefix that a
node is still prefilling a hit there: the next request with it goes where it will be warm.

Hashing is in C and costs a few hundred instructions a block (docs/CONFIG.md#affinity): key 0 is
BLAKE2b of the seed and the first block, so every gateway and every restart gives a new prefix the
same rendezvous key; key i after it is key i-1 XOR the interpreter's SipHash of (i, block i), all
blocks cut, hashed and chained by C iterators (no Python step per block). SipHash is keyed per
process, which is right for an index that lives in one process's memory. These keys route, they
secure nothing: a collision costs one misrouted request, which the node's reported reuse corrects.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from itertools import accumulate, count, repeat
from operator import xor
from struct import iter_unpack
from typing import Any

import orjson

#: the most bytes of one request's canonical text that are indexed
MAX_INDEXED_BYTES = 128 * 1024
#: keys kept per node (8-byte keys in an ordered dict: a few MiB at most)
DEFAULT_INDEX_KEYS = 32768
#: a predicted hit whose node reports less than this share of the prompt reused was a misprediction
REUSED_AT_LEAST = 0.1
#: session affinity: a node whose in-flight would pass this many times the mean is skipped
SESSION_LOAD_BOUND = 1.25
PREFIX, SESSION = "prefix", "session"
HIT, MISS, LOAD = "hit", "miss", "load"


@dataclass(slots=True)
class Affinity:
    """What one request's affinity is computed from (once, at admission) and what was decided."""

    mode: str  # PREFIX | SESSION
    keys: tuple[int, ...]  # prefix: the chained block keys; session: one key
    size: int = 0  # bytes of canonical text indexed (prefix)
    block: int = 256
    #: the last decision: the node it was taken for, the match there, the outcome (HIT/MISS/LOAD)
    node: str | None = None
    match: int = 0
    outcome: str | None = None
    #: at dispatch another in-flight request on the node held the matched prefix (still computing it)
    busy: bool = False
    #: the node whose in-flight list holds this request until its lease ends (Scheduler.release)
    held: str | None = None

    def uncached(self, match: int) -> int:
        """Bytes of the request that ``match`` leading keys do not cover."""
        return max(0, self.size - match * self.block)

    def predicted_hit(self) -> bool:
        """The dispatch expected the node to hold at least half of the prompt. A match that an
        in-flight request there was still computing is a hit for routing (docs/CONFIG.md#affinity) but not a
        prediction the node's report can refute: llama.cpp keeps a prompt in one slot and does not
        share a busy one (``-no-kvu``), so "nothing reused" then says nothing about the index."""
        return (self.mode == PREFIX and self.size > 0 and not self.busy
                and 2 * min(self.size, self.match * self.block) >= self.size)

    def shares(self, other: Affinity, match: int) -> bool:
        """``other`` holds this request's first ``match`` keys (chained: one key names its prefix)."""
        return len(other.keys) >= match and other.keys[match - 1] == self.keys[match - 1]


def _text(content: Any, out: list[bytes]) -> None:
    if isinstance(content, str):
        out.append(content.encode())
    elif isinstance(content, list):
        # A content list: its text parts in order (an image's bytes are not the gateway's to read).
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"].encode())


def canonical(data: dict[str, Any]) -> bytes:
    """The text a request's prompt is indexed by: its model, tools as their JSON, then for chat
    every message as ``role``, NUL, content (text parts in order); for completions the prompt.
    Cut at MAX_INDEXED_BYTES."""
    model = data.get("model")
    out: list[bytes] = [model.encode() if isinstance(model, str) else b"", b"\0"]
    tools = data.get("tools")
    if tools is not None:
        out.append(orjson.dumps(tools))
        out.append(b"\0")
    messages = data.get("messages")
    size = 0
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict):
                continue
            before = len(out)
            role = m.get("role")
            out.append(role.encode() if isinstance(role, str) else b"")
            out.append(b"\0")
            _text(m.get("content"), out)
            out.append(b"\0")
            size += sum(len(b) for b in out[before:])
            if size > MAX_INDEXED_BYTES:
                break  # the rest would be cut anyway
    else:
        prompt = data.get("prompt")
        if isinstance(prompt, str):
            out.append(prompt.encode())
        elif prompt is not None:
            out.append(orjson.dumps(prompt))  # token ids or a list of prompts
    return b"".join(out)[:MAX_INDEXED_BYTES]


def seed(route: str, model: str | None) -> bytes:
    """The key before the first block: two routes, or two models, never share a key."""
    return blake2b(f"{route}\0{model or ''}".encode(), digest_size=8).digest()


def _key(digest: bytes) -> int:
    return int.from_bytes(digest, "big")


def chain(text: bytes, first: bytes, block: int) -> tuple[int, ...]:
    """The chained keys of ``text`` in blocks of ``block`` bytes: key 0 = BLAKE2b(first ‖ block 0)
    (stable across processes: the rendezvous key), key i = key i-1 XOR SipHash((i, block i))."""
    text = text[:MAX_INDEXED_BYTES]
    if not text:
        return ()
    head = _key(blake2b(first + text[:block], digest_size=8).digest())
    rest = memoryview(text)[block:]
    cut = len(rest) - len(rest) % block
    # One C pipeline: struct cuts the full blocks, zip tags each with its position (so two blocks
    # swapped give other keys), hash() is SipHash over the bytes, accumulate chains them.
    tagged = zip(count(1), iter_unpack(f"{block}s", rest[:cut]))
    keys = list(accumulate(map(hash, tagged), xor, initial=head))
    if cut < len(rest):  # the last, short block
        keys.append(keys[-1] ^ hash((len(keys), (bytes(rest[cut:]),))))
    return tuple(keys)


def prefix_affinity(route: str, data: dict[str, Any], block: int) -> Affinity | None:
    """A chat or completion request's prefix keys; None when it has no text to index."""
    text = canonical(data)
    model = data.get("model")
    keys = chain(text, seed(route, model if isinstance(model, str) else None), block)
    if not keys:
        return None
    return Affinity(PREFIX, keys, size=len(text), block=block)


def session_affinity(route: str, session: str) -> Affinity:
    return Affinity(SESSION, (_key(blake2b(f"{route}\0{session}".encode(), digest_size=8).digest()),))


def weight(key: int | bytes, node: str) -> bytes:
    """Rendezvous (highest random weight) hashing: every gateway ranks the nodes for ``key`` alike."""
    raw = key if isinstance(key, bytes) else (key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
    return blake2b(node.encode(), digest_size=8, key=raw).digest()


def rendezvous(key: int | bytes, nodes: Iterable[str]) -> list[str]:
    """``nodes`` in ``key``'s order of preference (the consistent-hashing walk)."""
    return sorted(nodes, key=lambda n: weight(key, n), reverse=True)


def bounded(loads: Sequence[int]) -> int:
    """Bounded-load consistent hashing: a node may take one more request while its in-flight,
    counting that request, stays within 125 % of the mean (rounded up), so that at least one
    node always may."""
    return max(1, math.ceil(SESSION_LOAD_BOUND * (sum(loads) + 1) / max(1, len(loads)) - 1e-9))


#: a node's reported start time must move by more than this to be a restart (uptime is read with latency)
RESTART_SLACK_SEC = 2.0
_UPTIME_KEYS = ("uptime", "uptime_sec", "uptime_seconds")
_START_KEYS = ("start_time", "started_at")


def reported_start(doc: object, wall: float) -> float | None:
    """When a node's process started, from its health answer (``uptime``/``uptime_sec``/
    ``uptime_seconds`` seconds, or ``start_time``/``started_at`` unix seconds); None if it says neither."""
    if not isinstance(doc, dict):
        return None
    for k in _UPTIME_KEYS:
        v = doc.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0:
            return wall - v
    for k in _START_KEYS:
        v = doc.get(k)
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def restarted(known: float | None, seen: float) -> bool:
    """The start time moved: the process is a new one (its KV and prompt caches are empty)."""
    return known is None or abs(seen - known) > RESTART_SLACK_SEC


class PrefixIndex:
    """One node's keys, least recently dispatched first, at most ``limit``."""

    __slots__ = ("_keys", "limit", "started", "url")

    def __init__(self, limit: int = DEFAULT_INDEX_KEYS, started: float | None = None, url: str | None = None):
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        self.limit = limit
        #: the node's reported start time when these keys were recorded: another one empties it
        self.started = started
        #: the node's address when these keys were recorded: another address is another server
        self.url = url

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[Hashable]) -> int:
        """How many of ``keys``, from the first, are here.

        Found by bisection: a chain's keys here are its first n. Each record holds a prefix from
        key 0 and puts a shallower key after every deeper one, so the LRU loses a chain's tail
        before its head; a misprediction drops a request's keys from key 0 on, which leaves only
        keys that cannot match without it, and the first key is checked. About 7 probes for a
        chain of 64, where a probe per key costs more than the rest of the decision."""
        d = self._keys
        if not keys or keys[0] not in d:
            return 0
        lo, hi = 1, len(keys)  # keys[:lo] are taken as here; keys[hi:] as not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in d:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def record(self, keys: Sequence[Hashable]) -> None:
        """``keys`` were dispatched here. Recorded deepest first, so that under pressure a prefix
        loses its tail before its head (a broken head would lose the whole match)."""
        d = self._keys
        moves = map(d.move_to_end, reversed(keys))
        try:  # a prefix seen before: its keys only move (C iterators, no Python step per key)
            deque(moves, maxlen=0)
        except KeyError:  # some are new: add them, then the same moves, in the same order
            d.update(zip(reversed(keys), repeat(None)))
            deque(map(d.move_to_end, reversed(keys)), maxlen=0)
        while len(d) > self.limit:
            d.popitem(last=False)

    def drop(self, keys: Sequence[Hashable]) -> None:
        """The node did not hold what these keys claimed."""
        d = self._keys
        for k in keys:
            d.pop(k, None)

    def clear(self) -> None:
        self._keys.clear()
