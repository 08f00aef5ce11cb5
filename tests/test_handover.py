"""A freed slot's hand-over (kilolined/modes/runner.py, kilolined/scheduling/lease.py): the request that gets the
slot is started on its node before the request that freed it goes on with its own tail (writing
its answer, access log, metrics), so the node does not idle through that tail. No sockets: the
real Runtime, LeaseScope and runner with attempts that only write down when they ran."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from lease_props import Quiet, inflight, runtime

from kilolined.modes import runner
from kilolined.scheduling.lease import LeaseScope
from kilolined.scheduling.queue import Lease, Ticket
from kilolined.wire.proxy import Exchange


class Recorder:
    """An adapter whose node work is one line in ``events``."""

    def __init__(self, name: str, events: list[str]):
        self.name, self.events = name, events

    async def serve(self, rt: Any, scope: LeaseScope, ex: Any, sink: Any) -> None:
        await scope.acquire(self.attempt)
        scope.ok = True

    async def attempt(self, lease: Lease) -> str:
        self.events.append(f"{self.name} on {lease.node}")
        return "up"

    def named_model(self, ex: Any) -> str | None:
        return None


async def run(rt: Any, ticket: Ticket, name: str, events: list[str]) -> None:
    await runner.run(rt, ticket, cast(Exchange, None), cast(Any, Recorder(name, events)), Quiet(), None, "r")
    events.append(f"{name} goes on")


async def test_the_next_request_reaches_its_node_before_the_freed_slots_request_goes_on() -> None:
    rt = runtime(slots=1)
    events: list[str] = []
    one, two = rt.admit("r", "k", 0), rt.admit("r", "k", 0)  # the first takes the only slot
    second = asyncio.ensure_future(run(rt, two, "second", events))
    await asyncio.sleep(0)  # the second waits for the slot
    first = asyncio.ensure_future(run(rt, one, "first", events))
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert events[0] == "first on a"
    assert events.index("second on a") < events.index("first goes on")
    assert inflight(rt) == 0


async def test_a_release_with_nobody_waiting_hands_nothing_over() -> None:
    rt = runtime(slots=1)
    scope = LeaseScope(rt, rt.admit("r", "k", 0), Quiet(), None)
    async with scope:
        await scope.acquire(Recorder("only", []).attempt)
    assert not scope.handed_over
    assert inflight(rt) == 0
