"""The lease scope (kilolined/scheduling/lease.py) on its own: no sockets, fake attempts, a real Runtime.
(tests/cluster/test_lease_cluster.py runs the same property on the Redis lease store.)

The property test drives many requests through LeaseScope with attempts that succeed, fail as a
node does, hang past the deadline, raise a bug, or are cancelled — at every await point — and
checks the invariants the product stands on: every slot comes back, no request is lost or run
twice, never more in flight than the slots, and every move of a scope's state is one its
transition table allows, ending released exactly once.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lease_props import BEHAVIOURS, Quiet, every_slot_comes_back, inflight, runtime

from kilolined.core.outcome import Failure
from kilolined.scheduling.lease import (
    S_DETACHED,
    S_EXPIRED,
    S_HELD,
    S_RELEASED,
    S_WAITING,
    TRANSITIONS,
    LeaseScope,
)
from kilolined.scheduling.queue import Lease


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=12), st.integers(1, 3))
def test_every_slot_comes_back_whatever_the_attempts_do(behaviours: list[str], slots: int) -> None:
    async def scenario() -> None:
        rt = runtime(slots=slots)
        await every_slot_comes_back(rt, behaviours, slots)
        await rt.stop()

    asyncio.run(scenario())


async def test_a_deadline_while_writing_to_the_client_is_not_a_node_failure() -> None:
    rt = runtime(slots=1, timeout=0.05)
    ticket = rt.admit("r", "k", 0)

    async def attempt(lease: Lease) -> str:
        return "up"

    with pytest.raises(Failure) as info:
        async with LeaseScope(rt, ticket, Quiet(), None) as scope:
            await scope.acquire(attempt)
            scope.writing = True  # a client that does not read
            await asyncio.sleep(5)
    assert info.value.type == "upstream_timeout"
    assert inflight(rt) == 0
    assert rt.scheduler.nodes["a"].last_error is None


async def test_a_deadline_runs_the_abort_cleanup_before_the_slot_is_freed() -> None:
    rt = runtime(slots=1, timeout=0.05)
    ticket = rt.admit("r", "k", 0)
    freed_before_cleanup: list[bool] = []

    async def attempt(lease: Lease) -> str:
        return "up"

    async def interrupt() -> None:
        await asyncio.sleep(0.02)
        freed_before_cleanup.append(inflight(rt) == 0)

    with pytest.raises(Failure):
        async with LeaseScope(rt, ticket, Quiet(), None) as scope:
            await scope.acquire(attempt)
            scope.on_abort(interrupt)
            await asyncio.sleep(5)
    assert freed_before_cleanup == [False]
    assert inflight(rt) == 0
    # The node kept the request past its deadline: that counts against the node.
    assert rt.scheduler.nodes["a"].last_error is not None


async def test_the_lease_that_arrives_as_its_client_leaves_is_given_back() -> None:
    rt = runtime(slots=1)
    first = rt.admit("r", "k", 0)  # takes the only slot
    second = rt.admit("r", "k", 0)

    async def attempt(lease: Lease) -> str:
        return "up"

    async def waiter() -> None:
        async with LeaseScope(rt, second, Quiet(), None) as scope:
            await scope.acquire(attempt)

    task = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    assert first.lease is not None
    rt.scheduler.release(first.lease, rt.clock(), None)
    rt.scheduler.dispatch(rt.clock())  # the second gets the lease ...
    task.cancel()  # ... in the same moment its client leaves
    with pytest.raises(asyncio.CancelledError):
        await task
    assert inflight(rt) == 0


async def test_the_state_table_refuses_a_move_it_does_not_list() -> None:
    rt = runtime(slots=1)
    scope = LeaseScope(rt, rt.admit("r", "k", 0), Quiet(), None)
    assert scope.state == S_WAITING
    for bad in (S_HELD, S_DETACHED, S_EXPIRED):  # a scope without a lease holds nothing
        with pytest.raises(AssertionError):
            scope._to(bad)
    scope._to(S_RELEASED)
    with pytest.raises(AssertionError):  # released is the end: nothing is given back twice
        scope._to(S_RELEASED)
    assert not TRANSITIONS[S_RELEASED]
    await rt.stop()
