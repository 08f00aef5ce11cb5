"""kilolined.scheduling.affinity and the affinity decision in queue.Scheduler: pure logic (SPEC §13)."""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kilolined.adapters.openai import StreamParser
from kilolined.core.config import NodeConfig, RouteConfig
from kilolined.scheduling import affinity as aff
from kilolined.scheduling.affinity import (
    MAX_INDEXED_BYTES,
    Affinity,
    PrefixIndex,
    canonical,
    chain,
    prefix_affinity,
    seed,
)
from kilolined.scheduling.nodes import NodeState
from kilolined.scheduling.queue import LEASED, RouteQueue, Scheduler, Ticket

# --- the canonical text and the keys ---------------------------------------------------------------


def test_canonical_text_is_model_tools_then_role_nul_content() -> None:
    data = {"model": "m", "tools": [{"type": "function"}],
            "messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "image_url", "image_url": {"url": "x"}},
                                                      {"type": "text", "text": "b"}]}]}
    assert canonical(data) == b'm\0[{"type":"function"}]\0system\0be brief\0user\0ab\0'
    assert canonical({"model": "m", "prompt": "once upon"}) == b"m\0once upon"
    assert canonical({"prompt": [1, 2, 3]}) == b"\0[1,2,3]"


def test_at_most_128_kib_is_indexed() -> None:
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 300_000}, {"role": "user", "content": "y"}]}
    text = canonical(big)
    assert len(text) == MAX_INDEXED_BYTES
    a = prefix_affinity("r", big, 256)
    assert a is not None and len(a.keys) == MAX_INDEXED_BYTES // 256 and a.size == MAX_INDEXED_BYTES


@settings(max_examples=60, deadline=None)
@given(common=st.binary(min_size=0, max_size=2000), a=st.binary(min_size=1, max_size=600),
       b=st.binary(min_size=1, max_size=600), block=st.sampled_from([16, 64, 256]))
def test_a_key_names_the_whole_prefix_up_to_it(common: bytes, a: bytes, b: bytes, block: int) -> None:
    s = seed("r", "m")
    ka, kb = chain(common + a, s, block), chain(common + b, s, block)
    assert len(ka) == -(-len(common + a) // block)
    full = len(common) // block
    assert ka[:full] == kb[:full]  # the blocks they share give the same keys
    first_diff = next((i for i, (x, y) in enumerate(zip(common + a, common + b, strict=False)) if x != y), None)
    if first_diff is not None:
        i = first_diff // block
        # From the block where they differ on, no key is shared: each names its whole prefix.
        assert not set(ka[i:]) & set(kb[i:])


def test_route_and_model_seed_the_chain() -> None:
    data = {"model": "m", "messages": [{"role": "user", "content": "hello " * 100}]}
    a1, a2 = prefix_affinity("r", data, 64), prefix_affinity("s", data, 64)
    a3 = prefix_affinity("r", {**data, "model": "n"}, 64)
    assert a1 is not None and a2 is not None and a3 is not None
    assert not set(a1.keys) & set(a2.keys) and not set(a1.keys) & set(a3.keys)


# --- the index -------------------------------------------------------------------------------------


def _chain(blocks: list[int]) -> list[bytes]:
    """Keys as a real chain has them: key i names blocks 0..i, so a key is never repeated in a
    chain and two chains share a key only where they share the whole prefix up to it."""
    return [hashlib.blake2b(bytes(blocks[: i + 1]), digest_size=8).digest() for i in range(len(blocks))]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=30),
       st.integers(4, 64))
def test_index_is_bounded_and_a_match_counts_leading_keys(prefixes: list[list[int]], limit: int) -> None:
    idx = PrefixIndex(limit)
    for p in prefixes:
        keys = _chain(p)
        idx.record(keys)
        assert len(idx) <= limit
        assert idx.match(keys) == min(len(keys), _leading_within(keys, limit))
    probe = _chain(prefixes[-1])
    n = idx.match(probe)
    assert all(k in idx._keys for k in probe[:n]) and (n == len(probe) or probe[n] not in idx._keys)


def _leading_within(keys: list[bytes], limit: int) -> int:
    # Recorded deepest first, the head is the most recent: the first `limit` distinct keys stay.
    return len(keys) if len(set(keys)) <= limit else next(
        i for i in range(len(keys)) if len(set(keys[:i + 1])) > limit)


def test_drop_and_clear() -> None:
    idx = PrefixIndex()
    keys = [bytes([i]) * 8 for i in range(5)]
    idx.record(keys)
    assert idx.match(keys) == 5
    idx.drop(keys[2:])
    assert idx.match(keys) == 2
    idx.clear()
    assert idx.match(keys) == 0 and len(idx) == 0


@given(st.binary(min_size=8, max_size=8), st.sets(st.sampled_from("abcdefgh"), min_size=2, max_size=8))
def test_rendezvous_moves_only_what_a_removed_node_had(key: bytes, nodes: set[str]) -> None:
    order = aff.rendezvous(key, sorted(nodes))
    gone = order[0]
    assert aff.rendezvous(key, sorted(nodes - {gone}))[0] == order[1]
    other = order[-1]
    if other != gone:
        assert aff.rendezvous(key, sorted(nodes - {other}))[0] == gone


@given(st.lists(st.integers(0, 50), min_size=1, max_size=10))
def test_the_session_bound_always_leaves_a_node(loads: list[int]) -> None:
    cap = aff.bounded(loads)
    assert min(loads) + 1 <= cap
    assert cap <= 1.25 * (sum(loads) + 1) / len(loads) + 1


def test_a_restart_is_a_start_time_that_moved() -> None:
    assert aff.reported_start({"status": "ok", "uptime": 30.0}, 1000.0) == 970.0
    assert aff.reported_start({"uptime_sec": 5}, 100.0) == 95.0
    assert aff.reported_start({"start_time": 1234.5}, 9999.0) == 1234.5
    for doc in ({"status": "ok"}, [], {"uptime": -1}, {"uptime": True}, {"uptime": float("nan")}, {"uptime": "9"}):
        assert aff.reported_start(doc, 1000.0) is None
    assert aff.restarted(None, 5.0) and aff.restarted(100.0, 500.0)
    assert not aff.restarted(100.0, 101.0)  # latency in the uptime is no restart


# --- the decision inside the scheduler ----------------------------------------------------------------


def make(nodes: list[str], *, mode: str = "prefix", n: int = 2, standby: list[str] | None = None,
         models: dict[str, list[str]] | None = None) -> Scheduler:
    s = Scheduler()
    for name in [*nodes, *(standby or [])]:
        s.nodes[name] = NodeState(name, NodeConfig(url="http://10.0.0.1:1", models=(models or {}).get(name)))
    s.routes["r"] = RouteQueue("r", RouteConfig(path="/r", nodes=nodes, standby=standby or [], max_concurrency=n,
                                                affinity=mode, affinity_block_bytes=16))
    return s


def doc(i: int, question: str = "?") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "system", "content": f"{i}: the document " * 40},
                                       {"role": "user", "content": question}]}


def ask(s: Scheduler, data: dict[str, Any], now: float = 0.0, **kw: Any) -> Ticket:
    return s.admit("r", "k", 0, now, affinity=prefix_affinity("r", data, 16), **kw)


def node_of(t: Ticket) -> str:
    assert t.state == LEASED and t.lease is not None
    return t.lease.node


def test_a_follow_up_goes_where_its_prefix_was_sent_even_to_a_busier_node() -> None:
    s = make(["a", "b", "c"], n=4)
    first = ask(s, doc(1))
    home = node_of(first)
    assert first.affinity is not None and first.affinity.outcome == "miss"
    # Still in flight (still prefilling there): the next question about it is a hit there anyway.
    second = ask(s, doc(1, "and then?"))
    assert node_of(second) == home and second.affinity is not None and second.affinity.outcome == "hit"
    other = ask(s, doc(2))
    assert node_of(other) != home  # a new document: least-loaded
    assert s.affinity_decisions == Counter({("r", "miss"): 2, ("r", "hit"): 1})
    assert s.index_keys(home) == len(set(first.affinity.keys) | set(second.affinity.keys))


def test_affinity_never_waits_for_a_busy_affine_node() -> None:
    s = make(["a", "b"], n=1)
    first = ask(s, doc(1))
    home = node_of(first)
    second = ask(s, doc(1, "more"))
    assert node_of(second) != home  # the affine node is full: another one, now
    assert second.affinity is not None and second.affinity.outcome == "load"


def test_score_weighs_uncached_bytes_against_load() -> None:
    s = make(["a", "b"], n=8)
    short = {"model": "m", "messages": [{"role": "user", "content": "x" * 40}]}
    t0 = ask(s, short)
    home = node_of(t0)
    # Load the affine node: a tiny match is not worth four requests' wait there.
    for _ in range(4):
        s.admit("r", "k", 0, 0.0, pinned_node=home)
    longer = {"model": "m", "messages": [{"role": "user", "content": "x" * 40 + "y" * 4000}]}
    t = ask(s, longer)
    assert node_of(t) != home and t.affinity is not None and t.affinity.outcome == "load"


def test_a_cold_model_beats_affinity() -> None:
    s = make(["a", "b"], n=4, models={"a": ["m", "other"], "b": ["m", "other"]})
    first = s.admit("r", "k", 0, 0.0, model="m", affinity=prefix_affinity("r", doc(1), 16))
    home = node_of(first)
    s.nodes[home].models.warm = ["other"]  # the node swapped to another model since
    away = "b" if home == "a" else "a"
    s.nodes[away].models.warm = ["m"]
    t = s.admit("r", "k", 0, 0.0, model="m", affinity=prefix_affinity("r", doc(1, "next"), 16))
    assert node_of(t) == away


def test_a_node_slowed_for_being_slow_ranks_last_whatever_it_holds() -> None:
    s = make(["a", "b"], n=4)
    first = ask(s, doc(1))
    home = node_of(first)
    assert first.lease is not None
    s.release(first.lease, 0.0, None)
    s.nodes[home].slowed = True  # soft-ejected (docs/CONFIG.md#slow-nodes): ranked last, 1 slot
    again = ask(s, doc(1, "q2"))
    assert node_of(again) != home and again.affinity is not None and again.affinity.outcome == "load"
    s = make(["a", "b"], n=4, mode="session")
    s.nodes[home].slowed = True
    # a session whose ring sends it to the slowed node goes to the other one
    homed = next(a for i in range(100) if (a := aff.session_affinity("r", f"s{i}")) is not None
                 and aff.rendezvous(a.keys[0], ["a", "b"])[0] == home)
    sess = s.admit("r", "k", 0, 0.0, affinity=homed)
    assert node_of(sess) != home and homed.outcome == "load"


def test_a_standby_holding_the_prefix_does_not_beat_a_primary() -> None:
    s = make(["p"], n=2, standby=["s"])
    s.indexes["s"] = PrefixIndex()
    a = prefix_affinity("r", doc(1), 16)
    assert a is not None
    s.indexes["s"].record(a.keys)
    t = s.admit("r", "k", 0, 0.0, affinity=a)
    assert node_of(t) == "p"


def test_a_swap_forgets_the_node_index() -> None:
    s = make(["a"], n=4, models={"a": ["m", "n"]})
    s.nodes["a"].models.warm = ["m"]
    s.admit("r", "k", 0, 0.0, model="m", affinity=prefix_affinity("r", doc(1), 16))
    assert s.index_keys("a") > 0
    s.admit("r", "k", 0, 0.0, model="n", affinity=prefix_affinity("r", doc(2), 16))
    b = prefix_affinity("r", doc(1), 16)
    assert b is not None and s.indexes["a"].match(b.keys) == 0


def test_a_new_prefix_goes_where_the_rendezvous_hash_says_on_every_gateway() -> None:
    placed = set()
    for _ in range(2):  # two gateways (or a restart): same nodes, empty indexes
        s = make(["a", "b", "c"], n=2)
        placed.add(node_of(ask(s, doc(7))))
    assert len(placed) == 1
    a = prefix_affinity("r", doc(7), 16)
    assert a is not None and placed == {aff.rendezvous(a.keys[0], ["a", "b", "c"])[0]}


def test_a_misprediction_drops_the_keys() -> None:
    s = make(["a", "b"], n=4)
    t = ask(s, doc(1))
    home = node_of(t)
    assert t.lease is not None
    s.release(t.lease, 0.0, None)  # done: the node holds the document now
    t2 = ask(s, doc(1, "q2"))
    assert t2.affinity is not None and t2.affinity.predicted_hit()
    s.mispredicted(home, t2.affinity)
    again = prefix_affinity("r", doc(1), 16)
    assert again is not None and s.indexes[home].match(again.keys) == 0


def test_a_match_still_being_computed_is_a_hit_but_no_prediction_to_refute() -> None:
    # llama.cpp (-no-kvu) keeps a prompt in one slot and does not share a busy one: the second
    # request for a document the node is computing reports no reuse, which must not drop the keys.
    s = make(["a", "b"], n=4)
    first = ask(s, doc(1))
    home = node_of(first)
    second = ask(s, doc(1, "q2"))
    assert node_of(second) == home and second.affinity is not None and second.affinity.outcome == "hit"
    assert second.affinity.busy and not second.affinity.predicted_hit()
    other = ask(s, doc(2))  # another document: nothing of it is in flight
    assert other.affinity is not None and not other.affinity.busy
    for t in (first, second):
        assert t.lease is not None
        s.release(t.lease, 0.0, None)
    assert home not in s.prefix_flight or all(o is not first.affinity for o in s.prefix_flight[home])
    third = ask(s, doc(1, "q3"))  # nothing computes it now: a hit the node's report can refute
    assert node_of(third) == home and third.affinity is not None
    assert not third.affinity.busy and third.affinity.predicted_hit()
    for t in (other, third):
        assert t.lease is not None
        s.release(t.lease, 0.0, None)
    assert s.prefix_flight == {}  # released in full: nothing kept per node


def test_session_affinity_sticks_within_its_load_bound() -> None:
    s = make(["a", "b", "c"], mode="session", n=10)
    sess = aff.session_affinity("r", "user-42")
    home = aff.rendezvous(sess.keys[0], ["a", "b", "c"])[0]
    rq = s.routes["r"]
    for _ in range(3):  # one at a time: always its node
        t = s.admit("r", "k", 0, 0.0, affinity=aff.session_affinity("r", "user-42"))
        assert node_of(t) == home
        assert t.lease is not None and t.affinity is not None and t.affinity.outcome == "hit"
        s.release(t.lease, 0.0, 1.0)
    placed = []
    for _ in range(6):  # all at once: its node only while within 125 % of the mean in-flight
        before = {n: rq.inflight[n] for n in ("a", "b", "c")}
        t = s.admit("r", "k", 0, 0.0, affinity=aff.session_affinity("r", "user-42"))
        placed.append(node_of(t))
        assert before[node_of(t)] + 1 <= aff.bounded(list(before.values()))
    assert placed[0] == home and 1 < placed.count(home) < 6


# --- the property: affinity never changes how many run per node ------------------------------------


ops = st.lists(st.one_of(st.tuples(st.just("admit"), st.integers(0, 5), st.integers(0, 3)),
                         st.tuples(st.just("finish"), st.integers(0, 50), st.just(0))), max_size=60)


def _run(mode: str, steps: list[tuple[str, int, int]]) -> list[int]:
    s = make(["a", "b", "c"], mode=mode, n=2)
    s.nodes["c"] = NodeState("c", NodeConfig(url="http://10.0.0.1:1", max_concurrency=1))
    tickets: list[Ticket] = []
    seen: list[int] = []
    for op, x, y in steps:
        if op == "admit":
            data = doc(x, "q" * y)
            a = prefix_affinity("r", data, 16) if mode == "prefix" else aff.session_affinity("r", str(x)) \
                if mode == "session" else None
            tickets.append(s.admit("r", "k", 0, 0.0, affinity=a))
        else:
            leased = [t for t in tickets if t.state == LEASED]
            if leased:
                t = leased[x % len(leased)]
                assert t.lease is not None
                s.release(t.lease, 0.0, service_time=1.0)
                s.dispatch(0.0)
        rq = s.routes["r"]
        assert all(rq.inflight[n] <= 2 for n in ("a", "b", "c")) and s.node_inflight["c"] <= 1
        seen.append(sum(rq.inflight.values()))
    return seen


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_affinity_never_changes_how_many_run(steps: list[tuple[str, int, int]]) -> None:
    """At every step as many run with affinity as without, and never more than N on a node."""
    off = _run("off", steps)
    assert _run("prefix", steps) == off
    assert _run("session", steps) == off


def test_affinity_off_on_reload_is_plain_least_loaded() -> None:
    s = make(["a", "b"], n=4)
    first = ask(s, doc(1))
    home = node_of(first)
    s.routes["r"].configure(RouteConfig(path="/r", nodes=["a", "b"], max_concurrency=4), 0.0)
    t = ask(s, doc(1, "again"))
    assert node_of(t) != home  # least-loaded: the affine node holds one request already
    assert isinstance(t.affinity, Affinity) and t.affinity.outcome is None


# --- what a node says it reused -------------------------------------------------------------------


def _parsed(*chunks: bytes) -> StreamParser:
    p = StreamParser()
    for c in chunks:
        p.feed(c)
    p.done(True)
    return p


def test_reuse_is_read_from_timings_else_usage_on_json_and_streams() -> None:
    body = orjson.dumps({"choices": [], "timings": {"cache_n": 90, "prompt_n": 10},
                         "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 80}}})
    assert _parsed(body[:20], body[20:]).prompt_split() == (90, 10)  # llama.cpp's own count first
    vllm = orjson.dumps({"usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}})
    assert _parsed(vllm).prompt_split() == (64, 36)
    last = b'data: {"choices":[],"usage":{"prompt_tokens":7,"prompt_tokens_details":{"cached_tokens":3}}}\n\n'
    assert _parsed(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', last, b"data: [DONE]\n\n").prompt_split() \
        == (3, 4)
    assert _parsed(orjson.dumps({"usage": {"prompt_tokens": 5}})).prompt_split() is None  # it did not say


def test_absurd_reuse_counts_are_clamped() -> None:
    hostile = orjson.dumps({"usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 10**12}}})
    assert _parsed(hostile).prompt_split() == (10, 0)
    neg = orjson.dumps({"timings": {"cache_n": -50, "prompt_n": 3}})
    assert _parsed(neg).prompt_split() == (0, 3)
    junk = orjson.dumps({"timings": {"cache_n": "all", "prompt_n": 3}})
    assert _parsed(junk).prompt_split() is None
