"""Token buckets (rate limits) and budgets per day or month, as pure logic with ``now`` passed in.

Budgets are the only state that touches disk, and only as counters (never payloads): a small
JSON file under ``server.state_dir`` written atomically, so a restart does not reset a day.

``LimitStore`` is where a request's limits are decided and its usage charged: ``LocalLimits``
(this gateway's buckets and counters, the default and the fast path) or the Redis store shared
by every gateway of a cluster (kilolined/cluster/limits.py). Callers never ask which one it is.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson

from kilolined.core.config import BudgetConfig, RateConfig


@dataclass
class Verdict:
    ok: bool
    limit: int
    remaining: int
    reset_sec: int  # seconds until the bucket is full again
    retry_after: int  # seconds until one token is available (0 if ok)


class TokenBucket:
    """``per_minute`` tokens refilled continuously up to ``capacity`` (the burst)."""

    def __init__(self, rate: RateConfig, now: float):
        self.rate = rate
        self.tokens = float(rate.capacity)
        self.stamp = now

    @property
    def per_sec(self) -> float:
        return self.rate.per_minute / 60.0

    def _refill(self, now: float) -> None:
        cap = self.rate.capacity
        if now > self.stamp:
            self.tokens = min(cap, self.tokens + (now - self.stamp) * self.per_sec)
        self.stamp = max(self.stamp, now)

    def take(self, now: float) -> Verdict:
        self._refill(now)
        cap = self.rate.capacity
        ok = self.tokens >= 1.0
        if ok:
            self.tokens -= 1.0
        missing = cap - self.tokens
        reset = math.ceil(missing / self.per_sec) if missing > 0 else 0
        retry = 0 if ok else max(1, math.ceil((1.0 - self.tokens) / self.per_sec))
        return Verdict(ok, cap, int(self.tokens), reset, retry)

    def refund(self) -> None:
        self.tokens = min(self.rate.capacity, self.tokens + 1.0)

    def reconfigure(self, rate: RateConfig, now: float) -> None:
        """Keep the level across a reload (clamped to the new capacity)."""
        self._refill(now)
        self.rate = rate
        self.tokens = min(self.tokens, float(rate.capacity))


class RateLimiter:
    """Buckets per (subject, route); subject is a key id or ``ip:<addr>`` on auth: none routes."""

    def __init__(self, max_anonymous: int = 100_000):
        self.buckets: dict[tuple[str, str], TokenBucket] = {}
        self.max_anonymous = max_anonymous

    def check(self, subject: str, route: str, rate: RateConfig, now: float) -> Verdict:
        b = self.buckets.get((subject, route))
        if b is None:
            if len(self.buckets) >= self.max_anonymous:
                self._prune(now)
            b = self.buckets[(subject, route)] = TokenBucket(rate, now)
        elif b.rate != rate:
            b.reconfigure(rate, now)
        return b.take(now)

    def _prune(self, now: float) -> None:
        # Full buckets carry no information: dropping them is invisible to clients.
        for b in self.buckets.values():
            b._refill(now)
        for k in [k for k, b in self.buckets.items() if b.tokens >= b.rate.capacity]:
            del self.buckets[k]

    def forget_except(self, keep: set[str]) -> None:
        """After a reload: drop buckets of keys that no longer exist (IP buckets stay)."""
        for k in [k for k in self.buckets if not k[0].startswith("ip:") and k[0] not in keep]:
            del self.buckets[k]


def spent_amount(amount: float) -> float:
    """An amount added to a budget: finite and ≥ 0 (anything else adds nothing)."""
    return amount if math.isfinite(amount) and amount > 0 else 0


def utc_day(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m-%d")


def utc_month(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m")


def period_label(period: str, wall: float) -> str:
    """The budget window ``wall`` falls in: ``2026-12-06`` (period ``day``) or ``2026-12`` (``month``)."""
    return utc_month(wall) if period == "month" else utc_day(wall)


def seconds_to_midnight(wall: float) -> int:
    d = dt.datetime.fromtimestamp(wall, dt.UTC)
    midnight = (d + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, math.ceil((midnight - d).total_seconds()))


def seconds_to_period_end(period: str, wall: float) -> int:
    """Until the budget window ends (a spent budget's Retry-After): midnight UTC, or the first of
    the next month at midnight UTC."""
    if period != "month":
        return seconds_to_midnight(wall)
    d = dt.datetime.fromtimestamp(wall, dt.UTC)
    first = d.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    nxt = (first + dt.timedelta(days=32)).replace(day=1)
    return max(1, math.ceil((nxt - d).total_seconds()))


def period_word(period: str) -> str:
    return "monthly" if period == "month" else "daily"


class Budgets:
    """Per-key counters for the key's current window (its budget's ``period``: the UTC day by
    default, or the UTC month): requests, tokens, GPU seconds."""

    FIELDS = ("requests", "tokens", "gpu_seconds")

    def __init__(self, state_dir: str | None, periods: dict[str, str] | None = None):
        self.path = Path(state_dir) / "budgets.json" if state_dir else None
        #: key id -> "month" for the keys whose budgets count per month (set at each config
        #: apply); every other key counts per UTC day
        self.periods: dict[str, str] = dict(periods or {})
        self.day = ""  # today's label (written to the file for a reader; each key has its own window)
        self._day_no = -1
        self._month = ""
        self.used: dict[str, dict[str, float]] = {}
        #: key id -> the window its ``used`` counts (a day or a month label)
        self.windows: dict[str, str] = {}
        #: tokens promised to dispatched requests whose usage has not arrived (memory only: a
        #: restart ends those requests too)
        self.reserved: dict[str, int] = {}
        self.dirty = False
        self._load()

    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            data = orjson.loads(self.path.read_bytes())
            day = str(data.get("day", ""))
            used = {k: {f: float(v.get(f, 0)) for f in self.FIELDS} for k, v in data["used"].items()}
            windows = data.get("windows") or {}
            # A file without windows counted every key per day, on its "day".
            self.windows = {k: str(windows.get(k, day)) for k in used}
            self.used, self.day = used, day
        except (OSError, ValueError, KeyError, AttributeError, TypeError):
            # A corrupt counter file must not stop the gateway; it costs at most one window of counts.
            self.day, self.used, self.windows = "", {}, {}

    def _roll(self, wall: float) -> None:
        # POSIX time has no leap seconds: wall // 86400 is the UTC day number, and cheap
        # (this runs several times per request); the labels are built only when it changes.
        day_no = int(wall // 86400)
        if day_no == self._day_no:
            return
        self._day_no = day_no
        self.day = utc_day(wall)
        self._month = self.day[:7]

    def label(self, key: str, wall: float) -> str:
        """The window the key's counters are in at ``wall``."""
        if int(wall // 86400) != self._day_no:
            self._roll(wall)
        return self._month if self.periods.get(key) == "month" else self.day

    def _counters(self, key: str, wall: float) -> dict[str, float] | None:
        """The key's counters for its current window; a past window's are dropped first."""
        u = self.used.get(key)
        if u is not None and self.windows.get(key) != self.label(key, wall):
            del self.used[key]
            self.windows.pop(key, None)
            self.dirty = True
            return None
        return u

    def usage(self, key: str, wall: float) -> dict[str, float]:
        u = self._counters(key, wall)
        return u if u is not None else dict.fromkeys(self.FIELDS, 0.0)

    def exhausted(self, key: str, budget: BudgetConfig | None, wall: float) -> str | None:
        """Which budget is spent, or None."""
        if budget is None:
            return None
        u = self.usage(key, wall)
        if budget.requests_per_day is not None and u["requests"] >= budget.requests_per_day:
            return "requests_per_day"
        if budget.tokens_per_day is not None and u["tokens"] >= budget.tokens_per_day:
            return "tokens_per_day"
        if budget.gpu_seconds_per_day is not None and u["gpu_seconds"] >= budget.gpu_seconds_per_day:
            return "gpu_seconds_per_day"
        return None

    def take_request(self, key: str, budget: BudgetConfig | None, wall: float) -> str | None:
        """Check and count one request in the same step (so N concurrent requests against a budget
        of B admit exactly min(N, B)); returns the spent budget's name instead when refused."""
        spent = self.exhausted(key, budget, wall)
        if spent is None:
            self.add(key, wall, requests=1)
        return spent

    def give_back_request(self, key: str, wall: float) -> None:
        """A request counted by take_request was refused later (bad body, full queue)."""
        u = self._counters(key, wall)
        if u is not None and u["requests"] >= 1:
            u["requests"] -= 1
            self.dirty = True

    def add(self, key: str, wall: float, *, requests: int = 0, tokens: int = 0, gpu_seconds: float = 0) -> None:
        u = self._counters(key, wall)
        if u is None:
            u = self.used[key] = dict.fromkeys(self.FIELDS, 0.0)
            self.windows[key] = self.label(key, wall)
        # Usage only ever spends: a negative or non-finite amount (a node's odd usage report, a
        # clock step) must never refill a budget. ``0 < x < inf`` is spent_amount's test inline
        # (False for zero, negatives, NaN and ±inf): each request adds here three times, and
        # most of those amounts are zero.
        if 0 < requests < math.inf:
            u["requests"] += requests
        if 0 < tokens < math.inf:
            u["tokens"] += tokens
        if 0 < gpu_seconds < math.inf:
            u["gpu_seconds"] += gpu_seconds
        self.dirty = True

    def reserve_tokens(self, key: str, budget: BudgetConfig | None, tokens: int, wall: float) -> int | None:
        """At dispatch: hold ``tokens`` of the key's token budget until ``release_tokens``.

        Returns what was reserved (0 without a token budget), or None when the reservation does
        not fit beside what was spent and what other dispatched requests hold: the request must
        not reach the node. So concurrent requests overshoot only by what a node generates past
        its reservation."""
        if budget is None or budget.tokens_per_day is None:
            return 0
        spent = self.usage(key, wall)["tokens"]
        held = self.reserved.get(key, 0)
        if spent + held + tokens > budget.tokens_per_day:
            return None
        self.reserved[key] = held + tokens
        return tokens

    def release_tokens(self, key: str, tokens: int) -> None:
        """The request's usage arrived (or it ended without any): its reservation is over."""
        if tokens <= 0:
            return
        left = self.reserved.get(key, 0) - tokens
        if left > 0:
            self.reserved[key] = left
        else:
            self.reserved.pop(key, None)

    def save(self) -> None:
        """Atomic write (temp file + rename) so a crash never leaves a half-written file."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Counters of a window that is over are dropped, not written (a key removed from the
        # config, or not seen since its window ended).
        current = {self.day, self._month}
        for k in [k for k, w in self.windows.items() if w not in current]:
            self.used.pop(k, None)
            del self.windows[k]
        data = orjson.dumps({"day": self.day, "used": self.used, "windows": self.windows})
        write_atomic(self.path, data)
        self.dirty = False


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` as ``path``, whole or not at all (temp file in its directory + rename): a crash
    mid-write leaves the previous file. The budget counters and the bill are written so."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


#: What ``LimitStore.take`` decided: the bucket's verdict (None: no rate applies) and the name of
#: the spent budget (None: the request was counted, or no key was given, or the bucket refused).
Taken = tuple[Verdict | None, str | None]


class LimitStore(Protocol):
    """Where a request's rate token and budget are taken and its usage is charged."""

    def take(self, subject: str, route: str, rate: RateConfig | None, key: str | None,
             budget: BudgetConfig | None, wall: float) -> Taken | Awaitable[Taken]:
        """The rate token of (subject, route), then, only if the bucket let it pass and a key is
        given, the key's daily request budget checked and counted in the same step. A store that
        decides without waiting answers plainly (the request's hot path stays synchronous); one
        that must ask another process returns an awaitable."""
        ...

    def give_back_request(self, key: str, wall: float) -> None:
        """A request counted by ``take`` was refused later (bad body, full queue)."""
        ...

    async def reserve_tokens(self, key: str, budget: BudgetConfig | None, tokens: int, wall: float) -> int | None:
        """At dispatch: hold ``tokens`` of the key's token budget (see Budgets.reserve_tokens)."""
        ...

    def release_tokens(self, key: str, tokens: int) -> None:
        """The request's reservation is over (its usage arrived, or it ended without any)."""
        ...

    def add(self, key: str, wall: float, *, tokens: int = 0, gpu_seconds: float = 0.0) -> None:
        """What a request spent."""
        ...

    async def spent(self, key: str, wall: float) -> dict[str, float]:
        """What the key spent of its budgets in its current window (requests, tokens, gpu_seconds)."""
        ...


class LocalLimits:
    """This gateway's own buckets and counters decide: every call is plain and in memory."""

    def __init__(self, limiter: RateLimiter, budgets: Budgets, clock: Callable[[], float]):
        self.limiter = limiter
        self.budgets = budgets
        self.clock = clock  # the buckets' clock (monotonic); budgets go by the wall clock

    def take(self, subject: str, route: str, rate: RateConfig | None, key: str | None,
             budget: BudgetConfig | None, wall: float) -> Taken:
        verdict = None
        if rate is not None:
            verdict = self.limiter.check(subject, route, rate, self.clock())
            if not verdict.ok:
                return verdict, None
        if key is None:
            return verdict, None
        return verdict, self.budgets.take_request(key, budget, wall)

    def give_back_request(self, key: str, wall: float) -> None:
        self.budgets.give_back_request(key, wall)

    async def reserve_tokens(self, key: str, budget: BudgetConfig | None, tokens: int, wall: float) -> int | None:
        return self.budgets.reserve_tokens(key, budget, tokens, wall)

    def release_tokens(self, key: str, tokens: int) -> None:
        self.budgets.release_tokens(key, tokens)

    def add(self, key: str, wall: float, *, tokens: int = 0, gpu_seconds: float = 0.0) -> None:
        self.budgets.add(key, wall, tokens=tokens, gpu_seconds=gpu_seconds)

    async def spent(self, key: str, wall: float) -> dict[str, float]:
        return dict(self.budgets.usage(key, wall))
