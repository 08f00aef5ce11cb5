"""Both limit stores (kilolined/scheduling/limits.py ``LimitStore``) give the same answers: this gateway's
own buckets and counters (``LocalLimits``), and the cluster's on a real redis-server
(``SharedLimits``). Each scenario runs against both.

The Redis store writes usage and give-backs to Redis from one writer task, a moment later: where
a scenario depends on such a write, it polls for the answer with a generous deadline.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from kilolined.cluster.limits import SharedLimits
from kilolined.core.config import BudgetConfig, RateConfig
from kilolined.scheduling.limits import Budgets, LimitStore, LocalLimits, RateLimiter, Taken

from .harness import RedisServer, until

PREFIX = "kl-store:"
SLOW = RateConfig(per_minute=0.01, burst=2)  # two at once, then one per 100 minutes


@dataclass
class Store:
    name: str
    limits: LimitStore
    budgets: Budgets  # the store's local view (both keep one)
    redis: aioredis.Redis | None = None

    async def take(self, key: str | None, budget: BudgetConfig | None, rate: RateConfig | None = None,
                   subject: str = "alice") -> Taken:
        got = self.limits.take(subject, "gen", rate, key, budget, time.time())
        return got if isinstance(got, tuple) else await got

    async def eventually(self, what: str, pred: Callable[[], Awaitable[bool]]) -> None:
        """The local store answers at once; the Redis one once its writer has flushed."""
        await until(pred, what, timeout=20)

    async def redis_usage(self, key: str) -> dict[str, float]:
        assert self.redis is not None
        found = await self.redis.keys(f"{PREFIX}bu:{key}:*")
        raw = await self.redis.hgetall(found[0]) if found else {}
        return {k.decode(): float(v) for k, v in raw.items()}


@pytest.fixture(params=["local", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    limiter, budgets = RateLimiter(), Budgets(None)
    if request.param == "local":
        yield Store("local", LocalLimits(limiter, budgets, time.monotonic), budgets)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    r = aioredis.from_url(server.url)
    shared = SharedLimits(r, PREFIX, limiter, budgets, inst="inst-test", gateway_id="gw0", peers=lambda: [],
                          redis_up=lambda: True, clock=time.monotonic)
    try:
        yield Store("redis", shared, budgets, r)
    finally:
        await shared.stop()
        await r.aclose()


def test_the_local_store_decides_without_an_awaitable() -> None:
    """The request's hot path: check_limits stays a plain call unless a store must wait."""
    local = LocalLimits(RateLimiter(), Budgets(None), time.monotonic)
    got: Any = local.take("alice", "gen", SLOW, "alice", BudgetConfig(requests_per_day=5), time.time())
    assert isinstance(got, tuple) and got[0] is not None and got[0].ok and got[1] is None


async def test_a_bucket_refuses_past_its_burst_and_the_refused_request_is_not_counted(store: Store) -> None:
    budget = BudgetConfig(requests_per_day=10)
    for left in (1, 0):
        verdict, spent = await store.take("alice", budget, SLOW)
        assert verdict is not None and verdict.ok and verdict.remaining == left and verdict.limit == 2
        assert spent is None
    verdict, spent = await store.take("alice", budget, SLOW)
    assert verdict is not None and not verdict.ok and verdict.retry_after >= 1 and spent is None
    assert store.budgets.usage("alice", time.time())["requests"] == 2
    # Another subject has a bucket of its own.
    verdict, _ = await store.take("bob", budget, SLOW, subject="bob")
    assert verdict is not None and verdict.ok


async def test_without_a_rate_there_is_no_verdict_and_without_a_key_no_budget(store: Store) -> None:
    assert await store.take("alice", BudgetConfig(requests_per_day=1)) == (None, None)
    verdict, spent = await store.take(None, None, SLOW, subject="ip:127.0.0.1")
    assert verdict is not None and verdict.ok and spent is None
    assert store.budgets.usage("ip:127.0.0.1", time.time())["requests"] == 0


async def test_a_request_budget_admits_exactly_its_size_and_a_give_back_frees_one(store: Store) -> None:
    budget = BudgetConfig(requests_per_day=2)
    assert [(await store.take("alice", budget))[1] for _ in range(4)] == [None, None, "requests_per_day",
                                                                          "requests_per_day"]
    store.limits.give_back_request("alice", time.time())

    async def admitted() -> bool:  # a refused take counts nothing: polling is harmless
        return (await store.take("alice", budget))[1] is None

    await store.eventually("the given-back request is free again", admitted)
    assert (await store.take("alice", budget))[1] == "requests_per_day"


async def test_token_reservations_hold_what_is_promised_until_released(store: Store) -> None:
    budget = BudgetConfig(tokens_per_day=10)
    wall = time.time()
    assert await store.limits.reserve_tokens("alice", budget, 6, wall) == 6
    assert await store.limits.reserve_tokens("alice", budget, 6, wall) is None
    assert await store.limits.reserve_tokens("alice", budget, 4, wall) == 4
    assert await store.limits.reserve_tokens("alice", None, 1000, wall) == 0  # no token budget: nothing held
    store.limits.release_tokens("alice", 6)
    got: list[int | None] = []

    async def reserved() -> bool:
        got.append(await store.limits.reserve_tokens("alice", budget, 6, time.time()))
        return got[-1] is not None

    await store.eventually("the released tokens can be reserved again", reserved)
    assert got[-1] == 6


async def test_usage_spends_the_budget_and_an_odd_amount_never_refills_it(store: Store) -> None:
    """A node's negative or non-finite usage report adds nothing, in either store: the budget
    is spent by the 4 + 6 real tokens and stays spent."""
    budget = BudgetConfig(requests_per_day=100, tokens_per_day=10)
    wall = time.time()
    store.limits.add("alice", wall, tokens=4)
    store.limits.add("alice", wall, tokens=-50)
    store.limits.add("alice", wall, gpu_seconds=math.nan)
    store.limits.add("alice", wall, gpu_seconds=-3.0)
    store.limits.add("alice", wall, tokens=6)

    async def refused() -> bool:
        return (await store.take("alice", budget))[1] == "tokens_per_day"

    await store.eventually("the spent tokens refuse the next request", refused)
    assert store.budgets.usage("alice", time.time())["tokens"] == 10
    assert store.budgets.usage("alice", time.time())["gpu_seconds"] == 0
    if store.redis is not None:
        async def written() -> bool:
            return (await store.redis_usage("alice")).get("tokens") == 10

        await store.eventually("Redis holds the 10 tokens spent", written)
        assert (await store.redis_usage("alice")).get("gpu", 0) == 0


async def test_gpu_seconds_spend_their_own_budget(store: Store) -> None:
    budget = BudgetConfig(gpu_seconds_per_day=2.0)
    assert (await store.take("alice", budget))[1] is None
    store.limits.add("alice", time.time(), gpu_seconds=2.5)

    async def refused() -> bool:
        return (await store.take("alice", budget))[1] == "gpu_seconds_per_day"

    await store.eventually("the GPU seconds spent refuse the next request", refused)
    assert (await store.take("bob", budget))[1] is None  # another key's budget is untouched


async def test_a_month_budget_counts_across_the_days_of_its_month(store: Store) -> None:
    """``period: month``: one window from the 1st to the last day (UTC), here and in Redis alike."""
    store.budgets.periods["alice"] = "month"
    budget = BudgetConfig(requests_per_day=2, period="month")
    may3, may31, june1 = 1_904_040_000.0, 1_906_502_400.0 - 1, 1_906_502_400.0 + 1  # 2030-05-03, -05-31, -06-01

    async def take(wall: float) -> str | None:
        got = store.limits.take("alice", "gen", None, "alice", budget, wall)
        return (got if isinstance(got, tuple) else await got)[1]

    assert [await take(may3), await take(may31), await take(may31)] == [None, None, "requests_per_day"]
    assert (await store.limits.spent("alice", may31))["requests"] == 2
    assert await take(june1) is None  # a new month, a new budget
    assert (await store.limits.spent("alice", june1))["requests"] == 1
    if store.redis is not None:
        assert sorted(await store.redis.keys(f"{PREFIX}bu:alice:*")) == [f"{PREFIX}bu:alice:2030-05".encode(),
                                                                        f"{PREFIX}bu:alice:2030-06".encode()]
