"""The config watcher's Poke: the quiet clock's wait with a deadline, woken by a timer.

An idle tick must end the wait as "not poked" without a cancellation thrown into the waiting
coroutine (asyncio.timeout did that every IDLE_TICK_MS), and a poke must never be lost.
"""

from __future__ import annotations

import asyncio

import pytest

from kilolined.ops.reload import Poke


def test_a_poke_before_the_wait_is_seen_and_cleared() -> None:
    async def go() -> tuple[bool, bool]:
        poke = Poke()
        poke.set()
        first = await poke.wait(60)  # returns at once: no deadline involved
        second = await poke.wait(0)
        return first, second

    assert asyncio.run(go()) == (True, False)


def test_a_poke_during_the_wait_ends_it() -> None:
    async def go() -> bool:
        poke = Poke()
        asyncio.get_running_loop().call_soon(poke.set)
        return await poke.wait(60)

    assert asyncio.run(go()) is True


def test_the_deadline_ends_the_wait_as_not_poked() -> None:
    async def go() -> tuple[bool, int]:
        poke = Poke()
        got = await poke.wait(0.01)
        task = asyncio.current_task()
        assert task is not None
        return got, task.cancelling()

    assert asyncio.run(go()) == (False, 0)


def test_a_cancel_from_outside_still_ends_the_wait_and_leaves_no_waiter() -> None:
    async def go() -> Poke:
        poke = Poke()
        task = asyncio.create_task(poke.wait(60))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return poke

    poke = asyncio.run(go())
    assert poke.waiter is None
    poke.set()  # a poke after the cancelled wait is kept for the next one
    assert asyncio.run(poke.wait(0)) is True
