"""kilolined.scheduling.limits: token buckets and daily budgets, with a hand-made clock (SPEC §3.2)."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from kilolined.core.config import BudgetConfig, RateConfig
from kilolined.scheduling.limits import Budgets, RateLimiter, TokenBucket, seconds_to_midnight, utc_day


def wall(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: float = 0) -> float:
    return dt.datetime(y, mo, d, h, mi, tzinfo=dt.UTC).timestamp() + s


# --- token bucket -------------------------------------------------------------------------------


def test_bucket_burst_then_limited() -> None:
    b = TokenBucket(RateConfig(per_minute=60, burst=3), now=0)
    vs = [b.take(0) for _ in range(4)]
    assert [v.ok for v in vs] == [True, True, True, False]
    assert [v.remaining for v in vs] == [2, 1, 0, 0]
    assert all(v.limit == 3 for v in vs)
    assert vs[-1].retry_after == 1  # one token per second
    assert all(v.retry_after == 0 for v in vs[:3])


def test_bucket_refills_continuously() -> None:
    b = TokenBucket(RateConfig(per_minute=60, burst=3), now=0)
    for _ in range(3):
        b.take(0)
    assert not b.take(0.5).ok
    assert b.take(1.0).ok
    assert not b.take(1.0).ok
    # two seconds later, two tokens
    assert b.take(3.0).ok and b.take(3.0).ok and not b.take(3.0).ok


def test_bucket_never_exceeds_burst() -> None:
    b = TokenBucket(RateConfig(per_minute=60, burst=2), now=0)
    v = b.take(1000)
    assert v.ok and v.remaining == 1
    assert b.take(1000).ok
    assert not b.take(1000).ok


def test_retry_after_and_reset_for_a_slow_rate() -> None:
    b = TokenBucket(RateConfig(per_minute=6, burst=2), now=0)  # one token per 10 s
    b.take(0)
    v = b.take(0)
    assert v.ok and v.remaining == 0
    assert v.reset_sec == 20  # 2 tokens missing at 0.1/s
    v = b.take(0)
    assert not v.ok and v.retry_after == 10
    v = b.take(4)
    assert not v.ok and v.retry_after == 6
    assert v.reset_sec == 16


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    b = TokenBucket(RateConfig(per_minute=600, burst=1), now=0)  # one token per 0.1 s
    b.take(0)
    v = b.take(0.05)
    assert not v.ok and v.retry_after == 1 and isinstance(v.retry_after, int)


def test_burst_defaults_to_per_minute() -> None:
    rate = RateConfig(per_minute=30)
    assert rate.capacity == 30
    b = TokenBucket(rate, 0)
    assert sum(b.take(0).ok for _ in range(31)) == 30


def test_reset_brings_the_bucket_back_to_full() -> None:
    b = TokenBucket(RateConfig(per_minute=60, burst=5), now=0)
    for _ in range(5):
        v = b.take(0)
    assert v.reset_sec == 5
    v = b.take(5)
    assert v.ok and v.remaining == 4  # full again after reset_sec


def test_refund_gives_a_token_back() -> None:
    b = TokenBucket(RateConfig(per_minute=60, burst=1), now=0)
    b.take(0)
    b.refund()
    assert b.take(0).ok


def test_reconfigure_keeps_the_level() -> None:
    b = TokenBucket(RateConfig(per_minute=60, burst=10), now=0)
    for _ in range(8):
        b.take(0)
    b.reconfigure(RateConfig(per_minute=60, burst=20), now=0)
    v = b.take(0)
    assert v.ok and v.remaining == 1 and v.limit == 20  # 2 left before, not a fresh 20
    # lowering the burst clamps the level
    b2 = TokenBucket(RateConfig(per_minute=60, burst=10), now=0)
    b2.reconfigure(RateConfig(per_minute=60, burst=3), now=0)
    assert [b2.take(0).ok for _ in range(4)] == [True, True, True, False]


def test_rate_limiter_per_subject_and_route_and_reload_keeps_level() -> None:
    rl = RateLimiter()
    r1 = RateConfig(per_minute=60, burst=2)
    assert rl.check("alice", "gen", r1, 0).ok
    assert rl.check("alice", "gen", r1, 0).ok
    assert not rl.check("alice", "gen", r1, 0).ok
    assert rl.check("bob", "gen", r1, 0).ok  # another key
    assert rl.check("alice", "other", r1, 0).ok  # another route
    # a reload raising the rate keeps alice's empty bucket empty-ish
    r2 = RateConfig(per_minute=60, burst=10)
    v = rl.check("alice", "gen", r2, 0)
    assert not v.ok and v.limit == 10
    rl.forget_except({"bob"})
    assert ("alice", "gen") not in rl.buckets and ("bob", "gen") in rl.buckets


def test_rate_limiter_ip_buckets_survive_forget() -> None:
    rl = RateLimiter()
    rl.check("ip:1.2.3.4", "gen", RateConfig(per_minute=1, burst=1), 0)
    rl.forget_except(set())
    assert ("ip:1.2.3.4", "gen") in rl.buckets


def test_rate_limiter_prunes_only_full_buckets() -> None:
    rl = RateLimiter(max_anonymous=2)
    rate = RateConfig(per_minute=60, burst=1)
    rl.check("ip:a", "r", rate, 0)
    rl.check("ip:b", "r", rate, 0)
    # at t=100 both are full again and carry no information: pruning them is invisible
    rl.check("ip:c", "r", rate, 100)
    assert len(rl.buckets) <= 2
    assert rl.check("ip:a", "r", rate, 100).ok


# --- budgets ------------------------------------------------------------------------------------


def test_utc_day_and_seconds_to_midnight() -> None:
    w = wall(2024, 3, 9, 23, 59, 30)
    assert utc_day(w) == "2024-03-09"
    assert seconds_to_midnight(w) == 30
    assert seconds_to_midnight(wall(2024, 3, 9)) == 86400
    assert seconds_to_midnight(wall(2024, 3, 9, 23, 59, 59.9)) == 1


@pytest.mark.parametrize(
    ("budget", "use", "which"),
    [
        (BudgetConfig(requests_per_day=3), {"requests": 3}, "requests_per_day"),
        (BudgetConfig(tokens_per_day=1000), {"tokens": 1000}, "tokens_per_day"),
        (BudgetConfig(gpu_seconds_per_day=60), {"gpu_seconds": 60.0}, "gpu_seconds_per_day"),
    ],
)
def test_budget_exhaustion(budget: BudgetConfig, use: dict[str, float], which: str) -> None:
    b = Budgets(None)
    w = wall(2024, 5, 1, 12)
    field, amount = next(iter(use.items()))
    assert b.exhausted("alice", budget, w) is None
    b.add("alice", w, **{field: amount - (1 if field != "gpu_seconds" else 0.5)})  # type: ignore[arg-type]
    assert b.exhausted("alice", budget, w) is None
    b.add("alice", w, **{field: 1 if field != "gpu_seconds" else 0.5})  # type: ignore[arg-type]
    assert b.exhausted("alice", budget, w) == which
    assert b.exhausted("bob", budget, w) is None  # per key
    assert b.exhausted("alice", None, w) is None  # no budget configured: never exhausted


def test_budget_rolls_over_at_utc_midnight() -> None:
    b = Budgets(None)
    budget = BudgetConfig(requests_per_day=2)
    late = wall(2024, 5, 1, 23, 59, 59)
    b.add("alice", late, requests=2)
    assert b.exhausted("alice", budget, late) == "requests_per_day"
    next_day = wall(2024, 5, 2, 0, 0, 1)
    assert b.exhausted("alice", budget, next_day) is None
    assert b.usage("alice", next_day)["requests"] == 0


def test_budget_persists_to_state_dir_and_reloads(tmp_path: Path) -> None:
    state = tmp_path / "state" / "nested"
    w = wall(2024, 5, 1, 10)
    b = Budgets(str(state))
    b.add("alice", w, requests=3, tokens=120, gpu_seconds=4.5)
    b.save()
    files = list(state.iterdir())
    assert [f.name for f in files] == ["budgets.json"]  # no temp files left behind
    data = json.loads(files[0].read_text())
    assert data["day"] == "2024-05-01"
    b2 = Budgets(str(state))
    assert b2.usage("alice", w) == {"requests": 3, "tokens": 120, "gpu_seconds": 4.5}
    assert b2.exhausted("alice", BudgetConfig(requests_per_day=3), w) == "requests_per_day"
    # the next day after a restart: a fresh budget
    assert b2.usage("alice", wall(2024, 5, 2, 1))["requests"] == 0


def test_budget_file_holds_counters_only(tmp_path: Path) -> None:
    b = Budgets(str(tmp_path))
    b.add("alice", wall(2024, 5, 1), requests=1)
    b.save()
    data = json.loads((tmp_path / "budgets.json").read_text())
    assert set(data) == {"day", "used", "windows"}
    assert set(data["used"]["alice"]) == {"requests", "tokens", "gpu_seconds"}
    assert data["windows"] == {"alice": "2024-05-01"}


@pytest.mark.parametrize("garbage", [b"{not json", b"[1, 2, 3]", b'{"day": "x", "used": {"a": 5}}', b"", b"\xff\xfe"])
def test_corrupt_budget_file_is_tolerated(tmp_path: Path, garbage: bytes) -> None:
    (tmp_path / "budgets.json").write_bytes(garbage)
    b = Budgets(str(tmp_path))
    w = wall(2024, 5, 1)
    assert b.exhausted("alice", BudgetConfig(requests_per_day=1), w) is None
    b.add("alice", w, requests=1)
    b.save()
    assert Budgets(str(tmp_path)).usage("alice", w)["requests"] == 1


def test_save_without_state_dir_or_changes_writes_nothing(tmp_path: Path) -> None:
    Budgets(None).save()
    b = Budgets(str(tmp_path))
    b.save()
    assert not (tmp_path / "budgets.json").exists()


def test_token_reservations_bound_what_concurrent_requests_may_spend() -> None:
    b = Budgets(None)
    budget = BudgetConfig(tokens_per_day=100)
    wall = 1_800_000_000.0
    assert b.reserve_tokens("k", budget, 40, wall) == 40
    assert b.reserve_tokens("k", budget, 40, wall) == 40
    assert b.reserve_tokens("k", budget, 40, wall) is None  # 80 held: 40 more do not fit
    b.add("k", wall, tokens=30)  # the first one's usage arrived …
    b.release_tokens("k", 40)  # … and its reservation ends
    assert b.reserve_tokens("k", budget, 30, wall) == 30  # 30 spent + 40 held + 30 = 100 fits
    assert b.reserve_tokens("k", budget, 1, wall) is None
    assert b.reserve_tokens("other", budget, 100, wall) == 100  # per key
    assert b.reserve_tokens("k", None, 10**9, wall) == 0  # no budget: nothing to hold
    assert b.reserve_tokens("k", BudgetConfig(requests_per_day=5), 10**9, wall) == 0
    b.release_tokens("k", 40)
    b.release_tokens("k", 30)
    assert "k" not in b.reserved
