"""Token buckets and budgets shared by every gateway of the cluster.

Each decision is one Lua script (kilolined/cluster/scripts.py): a bucket's take; a request
budget checked and counted at once (with the token and GPU-second budgets checked in the same
step), so N concurrent requests spread over the gateways against a bucket or budget of B admit
exactly min(N, B); a token reservation checked against what the whole cluster spent and holds
reserved. What a request spent (its tokens, its GPU seconds) and the end of its reservation go to
Redis in order, one batch at a time, from one writer: usage and unreservation of one request land
in the same script, so a budget never looks emptier than it is between the two.

``SharedLimits`` is the cluster's ``limits.LimitStore``: the Runtime's ``limits`` in cluster mode.

While Redis is unreachable this gateway's own limiter and counters decide, each limit cut to
this gateway's share (kilolined/cluster/split.py) of what the cluster had left when Redis last
answered; what was spent meanwhile is written to Redis once it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kilolined.cluster import scripts
from kilolined.cluster.split import share
from kilolined.cluster.wire import Wire
from kilolined.core.config import BudgetConfig, RateConfig
from kilolined.scheduling.limits import Budgets, RateLimiter, Taken, Verdict, spent_amount
from kilolined.wire.tasks import cancel_until_done

log = logging.getLogger("kilolined")
RETRY_SEC = 1.0  # a batch Redis refused is sent again after this
FIELDS = ("requests", "tokens", "gpu_seconds")


@dataclass
class Seen:
    """A key's usage of one day as Redis last told it, beside this gateway's own at that moment."""

    day: str
    cluster: dict[str, float]
    local: dict[str, float]


def split_budget(budget: BudgetConfig, seen: Seen | None, local_now: dict[str, float], me: str,
                 others: list[str]) -> BudgetConfig:
    """The budget this gateway may spend alone, counted on its own counters: what it had spent
    when Redis last answered plus its share of what the cluster had left then. A key Redis never
    told about is taken as spent by this gateway alone so far (nothing better is known)."""
    cluster = seen.cluster if seen is not None else local_now
    local = seen.local if seen is not None else local_now
    k = len({me, *others})
    upd: dict[str, Any] = {}
    if budget.requests_per_day is not None:
        left = max(0, budget.requests_per_day - int(cluster["requests"]))
        upd["requests_per_day"] = int(local["requests"]) + share(left, me, others)
    if budget.tokens_per_day is not None:
        left = max(0, budget.tokens_per_day - int(cluster["tokens"]))
        upd["tokens_per_day"] = int(local["tokens"]) + share(left, me, others)
    if budget.gpu_seconds_per_day is not None:
        left_s = max(0.0, budget.gpu_seconds_per_day - cluster["gpu_seconds"])
        upd["gpu_seconds_per_day"] = local["gpu_seconds"] + left_s / k
    return budget.model_copy(update=upd)


def split_rate(rate: RateConfig, me: str, others: list[str]) -> RateConfig:
    """This gateway's part of a bucket: the refill split evenly, the burst as slots are (≥ 1)."""
    k = len({me, *others})
    return rate.model_copy(update={"per_minute": rate.per_minute / k,
                                   "burst": max(1, share(rate.capacity, me, others))})


class SharedLimits:
    def __init__(self, redis: aioredis.Redis, prefix: str, limiter: RateLimiter, budgets: Budgets, *,
                 inst: str, gateway_id: str, peers: Callable[[], list[str]], redis_up: Callable[[], bool],
                 clock: Callable[[], float], wire: Wire | None = None):
        self.prefix = prefix
        self._wire = wire  # the lease scripts' pipelined connection (cluster/wire.py), when there is one
        self.limiter = limiter
        self.budgets = budgets  # this gateway's own counters: its views, and the decision without Redis
        self.clock = clock  # the buckets' clock while Redis is down (monotonic)
        self.inst = inst
        self.gateway_id = gateway_id
        self.peers = peers  # the other gateways seen alive lately (the split)
        self.redis_up = redis_up
        self._redis = redis
        self._bucket = redis.register_script(scripts.BUCKET)
        self._take = redis.register_script(scripts.BUDGET_TAKE)
        self._reserve = redis.register_script(scripts.BUDGET_RESERVE)
        self._settle = redis.register_script(scripts.BUDGET_SETTLE)
        #: (key, day) -> [requests, tokens, gpu seconds, tokens unreserved] not yet in Redis
        self._pending: dict[tuple[str, str], list[float]] = {}
        self._held: dict[str, int] = {}  # tokens this gateway holds reserved in Redis, by key
        self._seen: dict[str, Seen] = {}
        self._wake = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._refresher: asyncio.Task[None] | None = None

    def _eval(self, script: Any, args: list[Any]) -> Awaitable[Any]:
        """A limit script, on the wire when there is one (one write, no pooled connection)."""
        if self._wire is not None:
            return self._wire.evalsha(script.script, [], args)
        return cast("Awaitable[Any]", script(args=args))

    # --- the request: its rate token, then its request budget --------------------------------
    async def take(self, subject: str, route: str, rate: RateConfig | None, key: str | None,
                   budget: BudgetConfig | None, wall: float) -> Taken:
        """As LocalLimits.take, with one bucket and one budget for every gateway."""
        verdict = None
        if rate is not None:
            verdict = await self.check(subject, route, rate, self.clock())
            if not verdict.ok:
                return verdict, None
        if key is None:
            return verdict, None
        return verdict, await self.take_request(key, budget, wall)

    # --- rate limits ------------------------------------------------------------------------
    async def check(self, subject: str, route: str, rate: RateConfig, now: float) -> Verdict:
        per_sec = rate.per_minute / 60.0
        cap = rate.capacity
        if not self.redis_up():
            return self.limiter.check(subject, route, split_rate(rate, self.gateway_id, self.peers()), now)
        try:
            ok, left = await self._eval(self._bucket, [self.prefix, f"{subject}|{route}", per_sec / 1000, cap])
        except (RedisError, OSError) as e:
            log.warning("⚠ cluster: shared rate limit unavailable (%s): this gateway's share of the bucket decides", e)
            return self.limiter.check(subject, route, split_rate(rate, self.gateway_id, self.peers()), now)
        tokens = float(left)
        missing = cap - tokens
        reset = math.ceil(missing / per_sec) if missing > 0 else 0
        retry = 0 if ok else max(1, math.ceil((1.0 - tokens) / per_sec))
        return Verdict(bool(ok), cap, int(tokens), reset, retry)

    # --- budgets: the request, checked with the others and counted at once ------------------
    async def take_request(self, key: str, budget: BudgetConfig | None, wall: float) -> str | None:
        if budget is None:
            return None
        day = self.budgets.label(key, wall)  # the key's budget window: a day or a month
        if self.redis_up():
            try:
                res = await self._eval(self._take, [self.prefix, key, day, _limit(budget.requests_per_day),
                                             _limit(budget.tokens_per_day), _limit(budget.gpu_seconds_per_day)])
            except (RedisError, OSError) as e:
                log.warning("⚠ cluster: shared budget unavailable (%s): this gateway's share decides", e)
            else:
                spent = _s(res[0])
                if spent:
                    self._note(key, day, res[1:4], wall)
                    return spent
                self.budgets.add(key, wall, requests=1)  # this gateway's part, for its own views
                self._note(key, day, res[1:4], wall)
                return None
        return self.budgets.take_request(key, self._split(key, budget, wall), wall)

    def give_back_request(self, key: str, wall: float) -> None:
        self.budgets.give_back_request(key, wall)
        self._queue(key, wall, requests=-1)

    # --- budgets: tokens reserved at dispatch, usage settled at the end ---------------------
    async def reserve_tokens(self, key: str, budget: BudgetConfig | None, tokens: int, wall: float) -> int | None:
        """As Budgets.reserve_tokens, against the cluster's spent and reserved tokens."""
        if budget is None or budget.tokens_per_day is None:
            return 0
        day = self.budgets.label(key, wall)
        if self.redis_up():
            call = asyncio.ensure_future(self._eval(self._reserve, [self.prefix, self.inst, key, day, tokens,
                                                             budget.tokens_per_day]))
            try:
                ok, spent, _held = await asyncio.shield(call)
            except asyncio.CancelledError:
                # The request is gone while Redis decided: a reservation it made there is given back.
                call.add_done_callback(lambda f: self._undo_reserve(f, key, tokens))
                raise
            except (RedisError, OSError) as e:
                log.warning("⚠ cluster: shared budget unavailable (%s): this gateway's share decides", e)
            else:
                seen = self._seen.get(key)
                if seen is not None and seen.day == day:
                    seen.cluster["tokens"] = max(seen.cluster["tokens"], float(spent))
                if not int(ok):
                    return None
                self._held[key] = self._held.get(key, 0) + tokens
                self.budgets.reserved[key] = self.budgets.reserved.get(key, 0) + tokens  # the local view
                return tokens
        return self.budgets.reserve_tokens(key, self._split(key, budget, wall), tokens, wall)

    def _undo_reserve(self, f: asyncio.Future[Any], key: str, tokens: int) -> None:
        if not f.cancelled() and f.exception() is None and int(f.result()[0]):
            self._queue(key, None, unreserve=tokens)

    def release_tokens(self, key: str, tokens: int) -> None:
        if tokens <= 0:
            return
        self.budgets.release_tokens(key, tokens)
        # A reservation made while Redis was down lives here only: what Redis holds goes first.
        held = self._held.get(key, 0)
        mine = min(held, tokens)
        if mine <= 0:
            return
        if held - mine > 0:
            self._held[key] = held - mine
        else:
            self._held.pop(key, None)
        self._queue(key, None, unreserve=mine)

    def add(self, key: str, wall: float, *, tokens: int = 0, gpu_seconds: float = 0.0) -> None:
        """What a request spent: counted here at once, in Redis by the writer."""
        self.budgets.add(key, wall, tokens=tokens, gpu_seconds=gpu_seconds)
        # As on this gateway's counters: usage only spends. A negative amount would refill the
        # cluster's budget, and a NaN would make Redis refuse every batch after it.
        tokens, gpu_seconds = int(spent_amount(tokens)), spent_amount(gpu_seconds)
        if tokens or gpu_seconds:
            self._queue(key, wall, tokens=tokens, gpu=gpu_seconds)

    async def spent(self, key: str, wall: float) -> dict[str, float]:
        """The cluster's count of the key's window; this gateway's own while Redis does not answer."""
        if self.redis_up():
            try:
                row = await self._redis.hmget(f"{self.prefix}bu:{key}:{self.budgets.label(key, wall)}",
                                              ["requests", "tokens", "gpu"])
            except (RedisError, OSError):
                pass
            else:
                return dict(zip(FIELDS, (float(_s(v or 0)) for v in row), strict=True))
        return dict(self.budgets.usage(key, wall))

    # --- the writer ---------------------------------------------------------------------------
    def _queue(self, key: str, wall: float | None, *, requests: int = 0, tokens: int = 0, gpu: float = 0.0,
               unreserve: int = 0) -> None:
        # An unreservation is not of a day: it joins the key's pending entry if it has one.
        day = self.budgets.label(key, wall) if wall is not None else next(
            (d for k, d in self._pending if k == key), self.budgets.windows.get(key, "-"))
        p = self._pending.setdefault((key, day), [0, 0, 0.0, 0])
        p[0] += requests
        p[1] += tokens
        p[2] += gpu
        p[3] += unreserve
        self._wake.set()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_loop())

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not await self._flush():
                await asyncio.sleep(RETRY_SEC)
                self._wake.set()

    async def _flush(self) -> bool:
        """One batch to Redis; False (the batch kept for the next try) when Redis did not take it."""
        batch, self._pending = self._pending, {}
        if not batch:
            return True
        if not self.redis_up():
            self._merge(batch)
            return False
        args: list[str | int | float] = [self.prefix, self.inst]
        for (key, day), (req, tok, gpu, un) in batch.items():
            args += [key, day, int(req), int(tok), repr(float(gpu)), int(un)]
        try:
            res = await self._eval(self._settle, args)
        except (RedisError, OSError) as e:
            log.warning("⚠ cluster: budget usage not written to Redis yet (%s): kept for the next try", e)
            self._merge(batch)
            return False
        for i, (key, day) in enumerate(batch):
            if day != "-":
                self._note(key, day, res[3 * i:3 * i + 3], None)
        return True

    def _merge(self, batch: dict[tuple[str, str], list[float]]) -> None:
        for k, v in batch.items():
            p = self._pending.setdefault(k, [0, 0, 0.0, 0])
            for i in range(4):
                p[i] += v[i]

    async def stop(self) -> None:
        """Shutdown: what is still pending goes to Redis (once, bounded), then the writer ends."""
        await cancel_until_done(self._refresher, self._writer)
        self._writer = None
        if self._pending:
            try:
                async with asyncio.timeout(2.0):
                    await self._flush()
            except TimeoutError:
                pass

    # --- the split while Redis is down ----------------------------------------------------------
    def start(self, keys: Callable[[], list[str]], period_sec: float) -> None:
        """Re-read the cluster's usage of ``keys()`` (the keys with a budget) every ``period_sec``,
        so a gateway that never served a key still knows what is left of it when Redis goes."""
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop(keys, period_sec))

    async def _refresh_loop(self, keys: Callable[[], list[str]], period_sec: float) -> None:
        while True:
            await asyncio.sleep(period_sec)
            if not self.redis_up():
                continue
            wall = time.time()
            names = keys()
            days = [self.budgets.label(key, wall) for key in names]
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for key, day in zip(names, days, strict=True):
                        pipe.hmget(f"{self.prefix}bu:{key}:{day}", "requests", "tokens", "gpu")
                    rows = await pipe.execute()
            except (RedisError, OSError):
                continue
            for key, day, row in zip(names, days, rows, strict=True):
                self._note(key, day, [v or 0 for v in row], wall)

    def _note(self, key: str, day: str, usage: list[Any], wall: float | None) -> None:
        """Remember the cluster's usage of the key and this gateway's own beside it."""
        if wall is not None:
            local: dict[str, float] | None = self.budgets.usage(key, wall)
            here: str | None = self.budgets.label(key, wall)
        else:
            local, here = self.budgets.used.get(key), self.budgets.windows.get(key)
        if local is None or here != day:
            return
        cluster = dict(zip(FIELDS, (float(_s(v) or 0) for v in usage), strict=True))
        self._seen[key] = Seen(day, cluster, dict(local))

    def _split(self, key: str, budget: BudgetConfig, wall: float) -> BudgetConfig:
        local_now = dict(self.budgets.usage(key, wall))
        seen = self._seen.get(key)
        if seen is not None and seen.day != self.budgets.label(key, wall):
            seen = None
        return split_budget(budget, seen, local_now, self.gateway_id, self.peers())


def _limit(v: float | None) -> str:
    return "-1" if v is None else repr(v)


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
