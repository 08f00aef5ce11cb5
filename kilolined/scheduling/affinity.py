"""Prefix and session affinity (docs/CONFIG.md#affinity): which node already holds a
request's prompt.

Pure: no I/O, no clock. The gateway cannot see a node's KV cache, so it keeps its own guess: the
canonical text of each request (its model, then every chat message as ``role``, NUL, content;
or a completion's prompt; at most 128 KiB and 256 messages of it) is cut into blocks, and block
i's key is a 64-bit hash of block i and key i-1 (the first seeded by route and model), so one key
names the whole prefix up to it. Each
node keeps a bounded LRU of the keys dispatched to it; a request's match on a node is the number
of its leading keys found there. Recording at dispatch, not at the answer, makes a prefix that a
node is still prefilling a hit there: the next request with it goes where it will be warm.

Hashing is in C and costs a few hundred instructions a block (docs/CONFIG.md#affinity): key 0 is
BLAKE2b of the seed and the first block, so every gateway and every restart gives a new prefix the
same rendezvous key; key i after it is key i-1 XOR the interpreter's SipHash of (i, block i), all
blocks cut, hashed and chained by C iterators (no Python step per block). SipHash is keyed per
process, which is right for an index that lives in one process's memory: only key 0 leaves it
(the cluster's rendezvous order is made from it). These keys route, they secure nothing: a
collision costs one misrouted request, which the node's reported reuse corrects.

Even in C, SipHash over 16 KiB is about 53k instructions, 5 % of a whole proxied request. Most
prefix traffic sends a prefix again (a conversation's earlier turns, a shared system prompt), so
``KeyMemo`` keeps the recent messages with the keys up to each: a message found there is compared
(memcmp, a tenth of the hash's cost) and its keys reused; only new text is hashed.
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
from sys import getsizeof
from typing import Any

import orjson

#: the most bytes of one request's canonical text that are indexed
MAX_INDEXED_BYTES = 128 * 1024
#: the most entries of a request's ``messages`` that are indexed (the first ones). The byte bound
#: alone lets a request of tiny messages cost a step per message (~2 µs each in ``KeyMemo``, over
#: 10,000 of them in 128 KiB, and without end for entries that are not messages): more CPU than
#: the rest of the request. Past 256 messages the prefix already names the conversation.
MAX_INDEXED_MESSAGES = 256
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
    Cut at MAX_INDEXED_MESSAGES messages and MAX_INDEXED_BYTES."""
    model = data.get("model")
    out: list[bytes] = [model.encode() if isinstance(model, str) else b"", b"\0"]
    tools = data.get("tools")
    if tools is not None:
        out.append(orjson.dumps(tools))
        out.append(b"\0")
    messages = data.get("messages")
    size = 0
    if isinstance(messages, list):
        for m in messages[:MAX_INDEXED_MESSAGES]:
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


def prefix_affinity(route: str, data: dict[str, Any], block: int, memo: KeyMemo | None = None) -> Affinity | None:
    """A chat or completion request's prefix keys; None when it has no text to index. ``memo``
    (the scheduler's) remembers recent messages, so that a prefix sent before is not hashed again;
    without one the keys are computed from nothing, the same keys."""
    return (memo if memo is not None else KeyMemo()).affinity(route, data, block)


#: the most bytes of message text, keys and tails ``KeyMemo`` keeps (least recently used dropped)
MEMO_BYTES = 4 * 1024 * 1024
#: what an entry costs beside its text and keys (objects and the lookup tuple), for the bound
_ENTRY_BYTES = 400
#: characters of a message's head and tail in its lookup tuple: a cheap probe, the whole text
#: is compared (memcmp) before an entry is used
_PROBE = 32


@dataclass(slots=True, eq=False)
class _Step:
    """The canonical text up to the end of one message (or the model and tools): the keys of its
    full blocks, the bytes after them, its length; what it was made from, to verify a lookup."""

    id: int
    first: bytes  # the chain's seed
    keys: tuple[int, ...]
    tail: bytes
    size: int
    text: str | bytes = b""
    final: tuple[int, ...] | None = None  # keys with the tail's own, made once

    def done(self) -> tuple[int, ...]:
        if self.final is None:
            self.final = (*self.keys, _tail_key(self.keys, self.first, self.tail)) if self.tail else self.keys
        return self.final


def _tail_key(keys: tuple[int, ...], first: bytes, tail: bytes) -> int:
    """The key of the short last block: as any other block's (``chain``)."""
    if not keys:
        return _key(blake2b(first + tail, digest_size=8).digest())
    return keys[-1] ^ hash((len(keys), (tail,)))


def _extend(keys: tuple[int, ...], first: bytes, data: memoryview, block: int) -> tuple[int, ...]:
    """``keys`` followed by the keys of ``data``'s full blocks (``data`` continues the text ``keys``
    name; a multiple of ``block`` bytes), hashed and chained by C iterators as in ``chain``."""
    if not keys:
        keys = (_key(blake2b(first + data[:block], digest_size=8).digest()),)
        data = data[block:]
    if not data:
        return keys
    tagged = zip(count(len(keys)), iter_unpack(f"{block}s", data))
    return keys + tuple(accumulate(map(hash, tagged), xor, initial=keys[-1]))[1:]


def _advance(prev: _Step, head: bytes, body: bytes, end: bytes, block: int, sid: int, text: str | bytes) -> _Step:
    """The step after ``prev`` with a message's canonical bytes, ``head`` + ``body`` + ``end``,
    appended, cut at MAX_INDEXED_BYTES. ``body`` (the text: most of the bytes) is hashed where it
    lies; only the blocks it shares with its neighbours are copied."""
    room = MAX_INDEXED_BYTES - prev.size
    added = len(head) + len(body) + len(end)
    first, keys = prev.first, prev.keys
    lead = prev.tail + head  # small: a block's worth at most, and the role
    skip = -len(lead) % block  # the body's bytes that complete the block ``lead`` begins
    full = (len(body) - skip) // block * block
    if added > room or full <= 0:  # short, or cut: in one piece
        data = b"".join((lead, body, end))[:len(prev.tail) + room]
        cut = len(data) - len(data) % block
        keys = _extend(keys, first, memoryview(data)[:cut], block) if cut else keys
        return _Step(sid, first, keys, data[cut:], prev.size + min(added, room), text)
    if lead:
        keys = _extend(keys, first, memoryview(lead + body[:skip]), block)
    keys = _extend(keys, first, memoryview(body)[skip:skip + full], block)
    rest = body[skip + full:] + end
    cut = len(rest) - len(rest) % block
    keys = _extend(keys, first, memoryview(rest)[:cut], block) if cut else keys
    return _Step(sid, first, keys, rest[cut:], prev.size + added, text)


def _content_text(content: Any) -> str:
    """A message's content as the canonical text has it: a string, or a list's text parts in
    order (UTF-8 of the parts one after another is UTF-8 of their concatenation)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join([p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)])
    return ""


class KeyMemo:
    """Recent canonical texts, message by message, with the keys of each prefix: a request whose
    first messages were seen (a system prompt, the turns before this one) hashes only the rest.

    An entry is found by its parent, its role and a probe of its text (length, head and tail),
    and used only when its whole text equals the message's (a compare, not a hash: memcmp is an
    order of magnitude cheaper than SipHash over the same bytes). The keys are those of
    ``chain(canonical(data), seed(route, model), block)``, whether hashed now or remembered.
    Bounded by MEMO_BYTES, least recently used dropped; it holds recent prompts' text, as the
    gateway's request buffers do, for no longer than it takes others to push them out."""

    __slots__ = ("_bytes", "_entries", "_ids", "limit")

    def __init__(self, limit: int = MEMO_BYTES):
        self._entries: OrderedDict[tuple[Any, ...], _Step] = OrderedDict()
        self._bytes = 0
        self._ids = count(1)
        self.limit = limit

    def __len__(self) -> int:
        return len(self._entries)

    def affinity(self, route: str, data: dict[str, Any], block: int) -> Affinity | None:
        """The request's prefix affinity: the chained keys of its canonical text, or None if empty."""
        # Inline, the lookups of what was seen before (the model, then each message): this runs
        # for every message of every prefix request.
        entries = self._entries
        model = data.get("model")
        if not isinstance(model, str):
            model = None
        tools = data.get("tools")
        probe: tuple[Any, ...] = (route, model, block, orjson.dumps(tools) if tools is not None else None)
        step = entries.get(probe)
        if step is None:
            step = self._root(probe, route, model, block)
        else:
            entries.move_to_end(probe)
        messages = data.get("messages")
        if isinstance(messages, list):
            for m in messages[:MAX_INDEXED_MESSAGES]:
                if step.size >= MAX_INDEXED_BYTES:
                    break  # the rest would be cut anyway
                try:
                    role, text = m.get("role"), m.get("content")
                except AttributeError:  # not an object (only a JSON object has .get): not a message
                    continue
                if not isinstance(role, str):
                    role = ""
                if not isinstance(text, str):
                    text = _content_text(text)
                probe = (step.id, role, len(text), text[-_PROBE:])
                seen = entries.get(probe)
                if seen is not None and seen.text == text:
                    entries.move_to_end(probe)
                    step = seen
                else:
                    step = self._add(step, probe, role, text, block)
        else:
            prompt = data.get("prompt")
            if prompt is not None and step.size < MAX_INDEXED_BYTES:
                text_ = prompt if isinstance(prompt, str) else orjson.dumps(prompt)  # token ids, or a list
                probe = (step.id, None, len(text_), text_[-_PROBE:])
                seen = entries.get(probe)
                if seen is not None and seen.text == text_:
                    entries.move_to_end(probe)
                    step = seen
                else:
                    step = self._add(step, probe, None, text_, block)
        if step.size == 0:
            return None
        return Affinity(PREFIX, step.final or step.done(), size=step.size, block=block)

    def _root(self, probe: tuple[Any, ...], route: str, model: str | None, block: int) -> _Step:
        """The step of the model (then the tools' JSON, ``probe``'s last), which seeds the chain
        with the route."""
        tj: bytes | None = probe[-1]
        empty = _Step(0, seed(route, model), (), b"", 0)
        step = _advance(empty, (model or "").encode() + b"\0", tj or b"", b"\0" if tj is not None else b"", block,
                        next(self._ids), tj or b"")
        self._put(probe, step)
        return step

    def _add(self, prev: _Step, probe: tuple[Any, ...], role: str | None, text: str | bytes, block: int) -> _Step:
        """Hash the canonical bytes of a message (``role`` None: a completion's prompt) on from
        ``prev``, and remember them."""
        body = text.encode() if isinstance(text, str) else text
        if role is None:
            step = _advance(prev, b"", body, b"", block, next(self._ids), text)
        else:
            step = _advance(prev, role.encode() + b"\0", body, b"\0", block, next(self._ids), text)
        self._put(probe, step)
        return step

    def _put(self, probe: tuple[Any, ...], step: _Step) -> None:
        entries = self._entries
        old = entries.pop(probe, None)
        if old is not None:
            self._bytes -= _cost(old)
        entries[probe] = step
        self._bytes += _cost(step)
        while self._bytes > self.limit and entries:
            self._bytes -= _cost(entries.popitem(last=False)[1])


def _cost(step: _Step) -> int:
    """An entry's memory, about: its text (as stored: 1, 2 or 4 bytes a character), keys, tail."""
    return getsizeof(step.text) + 8 * len(step.keys) + len(step.tail) + _ENTRY_BYTES


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

    __slots__ = ("_keys", "_last", "limit", "started", "url")

    def __init__(self, limit: int = DEFAULT_INDEX_KEYS, started: float | None = None, url: str | None = None):
        self._keys: OrderedDict[Hashable, None] = OrderedDict()
        #: the chain recorded last, whole, with nothing recorded or dropped since: its keys are the
        #: most recent, in record order, so recording it again changes nothing and it matches whole
        #: (``KeyMemo`` gives a prefix sent again the same tuple)
        self._last: tuple[Hashable, ...] | None = None
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
        if keys is self._last:
            return len(keys)
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
        if keys is self._last:
            return
        d = self._keys
        moves = map(d.move_to_end, reversed(keys))
        try:  # a prefix seen before: its keys only move (C iterators, no Python step per key)
            deque(moves, maxlen=0)
        except KeyError:  # some are new: add them, then the same moves, in the same order
            before = len(d)
            d.update(zip(reversed(keys), repeat(None)))
            if len(d) - before < len(keys):  # all new (a new prefix): already in order
                deque(map(d.move_to_end, reversed(keys)), maxlen=0)
        excess = len(d) - self.limit
        if excess > 0:  # the least recently dispatched go, in C
            deque(map(d.popitem, repeat(False, excess)), maxlen=0)
        self._last = keys if keys.__class__ is tuple and len(keys) <= self.limit else None

    def drop(self, keys: Sequence[Hashable]) -> None:
        """The node did not hold what these keys claimed."""
        self._last = None
        d = self._keys
        for k in keys:
            d.pop(k, None)

    def clear(self) -> None:
        self._last = None
        self._keys.clear()
