"""Token buckets and request budgets shared by every gateway of the cluster (one Lua script
each, so N concurrent requests spread over the gateways against a bucket or budget of B admit
exactly min(N, B)). While Redis is unreachable, this gateway's own limiter and counters decide.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import math
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kilolined.cluster import scripts
from kilolined.config import BudgetConfig, RateConfig
from kilolined.limits import Budgets, RateLimiter, Verdict

log = logging.getLogger("kilolined")


class SharedLimits:
    def __init__(self, redis: aioredis.Redis, prefix: str, limiter: RateLimiter, budgets: Budgets):
        self.prefix = prefix
        self.limiter = limiter
        self.budgets = budgets
        self._bucket = redis.register_script(scripts.BUCKET)
        self._take = redis.register_script(scripts.BUDGET_TAKE)
        self._give = redis.register_script(scripts.BUDGET_GIVE)
        self._tasks: set[asyncio.Task[Any]] = set()

    async def check(self, subject: str, route: str, rate: RateConfig, now: float) -> Verdict:
        per_sec = rate.per_minute / 60.0
        cap = rate.capacity
        try:
            ok, left = await self._bucket(args=[self.prefix, f"{subject}|{route}", per_sec / 1000, cap])
        except (RedisError, OSError) as e:
            log.warning("⚠ cluster: shared rate limit unavailable (%s): this gateway's bucket decides", e)
            return self.limiter.check(subject, route, rate, now)
        tokens = float(left)
        missing = cap - tokens
        reset = math.ceil(missing / per_sec) if missing > 0 else 0
        retry = 0 if ok else max(1, math.ceil((1.0 - tokens) / per_sec))
        return Verdict(bool(ok), cap, int(tokens), reset, retry)

    async def take_request(self, key: str, budget: BudgetConfig | None, wall: float) -> str | None:
        if budget is None:
            return None
        # Tokens and GPU seconds are counted here as before; the request count is the cluster's.
        spent = self.budgets.exhausted(key, budget.model_copy(update={"requests_per_day": None}), wall)
        if spent is not None or budget.requests_per_day is None:
            return spent
        try:
            taken = await self._take(args=[self.prefix, key, _day(wall), budget.requests_per_day])
        except (RedisError, OSError) as e:
            log.warning("⚠ cluster: shared budget unavailable (%s): this gateway's counter decides", e)
            return self.budgets.take_request(key, budget, wall)
        if not taken:
            return "requests_per_day"
        self.budgets.add(key, wall, requests=1)  # this gateway's share, for its own views
        return None

    def give_back_request(self, key: str, wall: float) -> None:
        self.budgets.give_back_request(key, wall)
        t = asyncio.get_running_loop().create_task(self._give_back(key, wall))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _give_back(self, key: str, wall: float) -> None:
        try:
            await self._give(args=[self.prefix, key, _day(wall)])
        except (RedisError, OSError):
            pass  # the day's count stays one high: safe (it refuses, never overshoots)


def _day(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m-%d")
