"""A node alone on its route, against its own history (docs/CONFIG.md "Slow nodes"): pure logic.

With no peer to compare with, a node is compared with its own baseline: the best of its hourly
levels over the last 7 days, and, until it has an hour of enough requests behind it, its level
since it started. It is judged at every request as the peer rule is: its EWMA ``drift`` × above
the baseline's level **and** the evidence of its samples (a one-sided CUSUM of log(sample ÷
baseline) less log(drift)) agrees, for ``evaluations`` requests in a row. A node that turns 2×
slower is so flagged within a few requests of the change, whatever its traffic per hour.

Two things keep noise quiet where a peer's median would have:
- the baseline learns only from requests that came while there was no evidence against the node,
  so the slowdown being judged does not raise the bar it is judged against;
- the evidence needed grows with the node's own noise (``NOISE_WEIGHT`` × the variance of its log
  samples): a CUSUM's false alarms depend on its threshold over the variance, and drift looks for
  differences (15–30 %) as small as σ-0.5 GPU timings make one request's.

Each hour is kept as the geometric means of its level and of its samples; an hour of fewer than
``HOUR_MIN`` × ``samples`` requests is too noisy on its own to be the best one (the minimum of
noisy hours is biased low), so a node serving fewer keeps its since-start baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HOUR = 3600.0
KEEP_HOURS = 7 * 24  # the baseline remembers this many hours
HOUR_MIN = 5  # × samples: the requests an hour needs to be a baseline of its own
NOISE_WEIGHT = 30.0  # evidence needed ≥ this × the variance of log samples (σ 0.5: 7.5; σ 0.1: the floor)


@dataclass(slots=True)
class Baseline:
    """One series' own history and the drift rule's evidence against it."""

    # since it started: the requests it learned from, their log levels, log samples and their squares
    n: int = 0
    level_logs: float = 0.0
    sample_logs: float = 0.0
    sample_squares: float = 0.0
    # the hour being filled: its index, requests and sums (of what it learned from)
    hour: int = -1
    hour_n: int = 0
    hour_level_logs: float = 0.0
    hour_sample_logs: float = 0.0
    #: full hours: (index, geometric mean of the level, geometric mean of the samples)
    hours: list[tuple[int, float, float]] = field(default_factory=list)
    evidence: float = 0.0  # the CUSUM of log(sample / baseline) - log(drift), floored at 0
    streak: int = 0  # consecutive drifting evaluations

    def best(self, now: float) -> tuple[float, float] | None:
        """(level, sample) of the baseline: the best full hour of the last 7 days, else since it started."""
        oldest = int(now // HOUR) - KEEP_HOURS
        recent = [(lv, sm) for h, lv, sm in self.hours if h >= oldest]
        if recent:
            return min(recent)
        if self.n == 0:
            return None
        return math.exp(self.level_logs / self.n), math.exp(self.sample_logs / self.n)

    def needed(self, floor: float) -> float:
        """The evidence a drifting evaluation needs: ``floor``, more for a noisy node."""
        n = self.n
        if n < 2:
            return floor
        mean = self.sample_logs / n
        var = max(0.0, self.sample_squares / n - mean * mean) * n / (n - 1)
        return max(floor, NOISE_WEIGHT * var)

    def judge(self, level: float, value: float, now: float, drift: float, floor: float,
              hour_min: int) -> bool:
        """One sample (``value``, the level after it): updates the evidence and the streak, and
        learns the sample if nothing spoke against the node before it. True: a drifting evaluation."""
        self._roll(now, hour_min)
        learn = self.evidence == 0.0
        base = self.best(now)
        drifting = False
        if base is not None:
            b_level, b_sample = base
            self.evidence = max(0.0, self.evidence + math.log(max(value, 1e-9) / b_sample) - math.log(drift))
            drifting = level > drift * b_level and self.evidence >= self.needed(floor)
        self.streak = self.streak + 1 if drifting else 0
        if learn:
            self.learn(level, value, now, hour_min)
        return drifting

    def back(self, level: float, now: float, drift: float) -> bool:
        """Back within ``drift`` of its baseline, with no evidence left against it."""
        base = self.best(now)
        return base is not None and level <= drift * base[0] and self.evidence == 0.0

    def learn(self, level: float, value: float, now: float, hour_min: int) -> None:
        """A sample the baseline learns from (the node had peers, or nothing spoke against it)."""
        if int(now // HOUR) != self.hour:
            self._roll(now, hour_min)
        lv, sm = math.log(max(level, 1e-9)), math.log(max(value, 1e-9))
        self.n += 1
        self.level_logs += lv
        self.sample_logs += sm
        self.sample_squares += sm * sm
        self.hour_n += 1
        self.hour_level_logs += lv
        self.hour_sample_logs += sm

    def _roll(self, now: float, hour_min: int) -> None:
        h = int(now // HOUR)
        if h == self.hour:
            return
        if self.hour_n >= hour_min:
            n = self.hour_n
            self.hours.append((self.hour, math.exp(self.hour_level_logs / n), math.exp(self.hour_sample_logs / n)))
            oldest = h - KEEP_HOURS
            if self.hours[0][0] < oldest:
                self.hours = [e for e in self.hours if e[0] >= oldest]
        self.hour, self.hour_n, self.hour_level_logs, self.hour_sample_logs = h, 0, 0.0, 0.0
