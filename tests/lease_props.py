"""The lease store's property: the behaviours a request may have and the check that every slot comes back."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import yaml

from kilolined.core.config import parse_config
from kilolined.core.outcome import Failure
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.lease import (
    S_DETACHED,
    S_EXPIRED,
    S_HELD,
    S_RELEASED,
    S_WAITING,
    TRANSITIONS,
    LeaseScope,
    Sink,
)
from kilolined.scheduling.queue import Lease, Rejected, Ticket
from kilolined.wire.proxy import UpstreamFailed


def config(slots: int = 2, retries: int = 1, timeout: float = 0.2) -> dict[str, Any]:
    return {
        "keys": {"k": {"key_sha256": hashlib.sha256(b"k").hexdigest()}},
        # Breakers that never open: the pump (which half-opens them) does not run here, and the
        # breaker has tests of its own; this is about the scope. A node that lost a request is
        # kept from it for open_sec (nothing probes these nodes): short, so that a request that
        # other requests' failures left waiting for its nodes is tried again at the next tick.
        "nodes": {n: {"url": "http://127.0.0.1:9", "breaker": {"consecutive_failures": 10**6, "open_sec": 0.05}}
                  for n in "ab"},
        "routes": {"r": {"path": "/r", "nodes": ["a"], "standby": ["b"], "max_concurrency": slots,
                         "retry_on_failover": retries, "request_timeout_sec": timeout, "queue_timeout_sec": 30,
                         "max_queue_depth": 1000}},
    }


def runtime(slots: int = 2, retries: int = 1, timeout: float = 0.2) -> Runtime:
    return Runtime(parse_config(yaml.safe_dump(config(slots, retries, timeout))), "test")


def inflight(rt: Runtime) -> int:
    return sum(rt.scheduler.node_inflight.values())


class Quiet(Sink):
    __slots__ = ()


class Traced(LeaseScope):
    """A scope that writes down each move of its state (the table's assert checks it too)."""

    __slots__ = ("moves",)

    def __init__(self, rt: Runtime, ticket: Ticket, sink: Sink, key: str | None, moves: list[tuple[str, str]]):
        super().__init__(rt, ticket, sink, key)
        self.moves = moves

    def _to(self, new: str) -> None:
        self.moves.append((self.state, new))
        super()._to(new)


def check_moves(moves: list[tuple[str, str]]) -> None:
    """One scope's moves: a path through the table from waiting, released once, at the end."""
    assert moves, "the scope never left waiting"
    state = S_WAITING
    for old, new in moves:
        assert old == state, moves
        assert new in TRANSITIONS[old], (old, new, moves)
        state = new
    assert state == S_RELEASED and [n for _, n in moves].count(S_RELEASED) == 1, moves


class Peak(Sink):
    """Writes down, at each dispatch, how many run on the lease's node: the leases given out there
    and not yet given back (counted here, apart from the store's own counters), or the
    scheduler's count if higher."""

    __slots__ = ("live", "rt", "seen")

    def __init__(self, rt: Runtime, seen: list[int], live: dict[str, list[Lease]]):
        self.rt, self.seen, self.live = rt, seen, live

    def dispatched(self, lease: Lease, queue_wait: float) -> None:
        on_node = self.live.setdefault(lease.node, [])
        on_node[:] = [held for held in on_node if not held.released]
        on_node.append(lease)
        self.seen.append(max(len(on_node), self.rt.scheduler.routes["r"].inflight[lease.node]))


EXPECT = {"ok": "ok", "node_fails": "upstream_error", "node_fails_then_ok": "ok", "hang": "upstream_timeout",
          "bug": "bug", "cancel_in_attempt": "cancelled", "cancel_after": "cancelled", "hold_ok": "ok",
          "hold_hang": "ok"}


BEHAVIOURS = ("ok", "node_fails", "node_fails_then_ok", "hang", "bug", "cancel_in_attempt", "cancel_after",
              "hold_ok", "hold_hang")


@dataclass
class Run:
    """What one run of the property saw."""

    ran: list[int] = field(default_factory=list)  # the requests whose work reached the node, by index
    seen: list[int] = field(default_factory=list)  # how many ran on the node, at each dispatch
    live: dict[str, list[Lease]] = field(default_factory=dict)  # leases given out, by node (Peak)


async def one(rt: Runtime, behaviour: str, run: Run, i: int, moves: list[tuple[str, str]]) -> str:
    ticket = rt.admit("r", "k", 0)
    if rt.settle is not None:  # a shared store (cluster mode) decides there, as app.admit does
        try:
            ticket = await rt.settle(ticket)
        except Rejected as r:
            return r.type
    calls = 0

    async def attempt(lease: Lease) -> str:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        if behaviour == "node_fails" or (behaviour == "node_fails_then_ok" and calls == 1):
            raise UpstreamFailed("connection reset")
        if behaviour == "hang":
            await asyncio.sleep(10)
        if behaviour == "bug":
            raise RuntimeError("a bug")
        if behaviour == "cancel_in_attempt":
            raise asyncio.CancelledError
        run.ran.append(i)
        return "answer"

    try:
        async with Traced(rt, ticket, Peak(rt, run.seen, run.live), "k", moves=moves) as scope:
            await scope.acquire(attempt)
            await asyncio.sleep(0)
            if behaviour == "cancel_after":
                raise asyncio.CancelledError
            if behaviour.startswith("hold"):
                scope.hold(asyncio.sleep(10 if behaviour == "hold_hang" else 0.01))
            scope.ok = True
        return "ok"
    except Failure as f:
        return f.type
    except asyncio.CancelledError:
        return "cancelled"
    except RuntimeError:
        return "bug"


async def every_slot_comes_back(rt: Runtime, behaviours: list[str], slots: int,
                                meanwhile: Coroutine[Any, Any, None] | None = None, within: float = 30) -> None:
    """The property, on whatever lease store ``rt`` is wired to: ``behaviours`` run at once (and
    ``meanwhile`` beside them, e.g. faults of the store); every request ends as its behaviour says,
    every slot comes back, never more than ``slots`` run on a node, no work runs twice, and every
    scope moves through the transition table."""
    run = Run()
    moves: list[list[tuple[str, str]]] = [[] for _ in behaviours]
    requests = asyncio.gather(*(one(rt, b, run, i, moves[i]) for i, b in enumerate(behaviours)))
    # The pump's wake: a request re-queued without charge from nodes known lost waits until one
    # may have it again (lease.uncharged; queue.Scheduler.barred).
    ticks = asyncio.create_task(_tick(rt))
    try:
        results, _ = await asyncio.wait_for(asyncio.gather(requests, meanwhile or asyncio.sleep(0)), timeout=within)
    finally:
        ticks.cancel()
    # Holds run in the runtime's tasks: wait for them (bounded by the 0.2 s deadline).
    deadline = time.monotonic() + 10
    while inflight(rt) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert inflight(rt) == 0, (behaviours, results)
    assert not rt.scheduler.routes["r"].waiting
    assert max(run.seen, default=0) <= slots, run.seen  # never more than the slots on one node
    assert len(run.ran) == len(set(run.ran)), run.ran  # nobody's work ran twice
    for b, res, m in zip(behaviours, results, moves, strict=True):
        expect = EXPECT[b]
        assert res == expect, (b, res, behaviours, results)
        check_moves(m)
        if b == "hang":
            assert (S_EXPIRED, S_RELEASED) in m, m
        if b.startswith("hold"):
            assert (S_HELD, S_DETACHED) in m, m


async def _tick(rt: Runtime) -> None:
    while True:
        await asyncio.sleep(0.01)
        rt.wake()
