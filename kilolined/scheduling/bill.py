"""The bill: what each key spent, per route, model and UTC day (docs/FLEET.md#the-bill).

One row per (day, key, route, model) holds requests, prompt and completion tokens, GPU seconds
and their cost. Counters only, never a payload; kept in memory and, with ``server.state_dir``,
in ``usage.json`` beside the budget counters (written atomically, as they are).

Bounded: at most ``MAX_ROWS`` rows (the oldest days are dropped whole when a new row would pass
it; a day that fills it alone counts the rest on one ``(other)`` row), and at most
``MAX_MODELS`` model names per (day, key, route): the model is the client's
word, and a client naming a new model in every request must not push the rest of the bill out;
the names past it count as ``OTHER_MODEL``.

Pure: the time is passed in (``wall``, Unix seconds); the query helpers below take rows and give
rows, so /admin/usage and /v1/usage are the same code.
"""

from __future__ import annotations

import csv
import datetime as dt
import io
import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from kilolined.scheduling.limits import write_atomic

FIELDS = ("requests", "prompt_tokens", "completion_tokens", "gpu_seconds", "cost_usd")
DIMENSIONS = ("day", "key", "route", "model")
MAX_ROWS = 50_000
MAX_MODELS = 32
MAX_MODEL_CHARS = 200  # a model name longer than this is cut (it is the client's string)
OTHER_MODEL = "(other)"
NO_MODEL = "-"  # a request that names no model (ComfyUI, generic routes)
NO_KEY = "-"  # a request on an ``auth: none`` route

Row = tuple[str, str, str, str]  # (day, key, route, model)
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")  # ASCII digits only


def utc_day(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, dt.UTC).strftime("%Y-%m-%d")


def gpu_cost(gpu_seconds: float, price_per_hour: float | None) -> float:
    """What ``gpu_seconds`` on a GPU of ``price_per_hour`` dollars cost (0 when no price is known)."""
    if price_per_hour is None or not math.isfinite(price_per_hour) or price_per_hour <= 0:
        return 0.0
    return gpu_seconds * price_per_hour / 3600.0


def _amount(x: float) -> float:
    # As a budget's: an odd amount (negative, NaN, inf) adds nothing.
    return x if 0 < x < math.inf else 0.0


class Bill:
    def __init__(self, state_dir: str | None, *, max_rows: int = MAX_ROWS, max_models: int = MAX_MODELS):
        self.path = Path(state_dir) / "usage.json" if state_dir else None
        self.max_rows = max_rows
        self.max_models = max_models
        self.rows: dict[Row, list[float]] = {}
        self._models: dict[tuple[str, str, str], int] = {}  # (day, key, route) -> model rows
        self._day_no = -1
        self._day = ""
        self.dirty = False
        self._load()

    # --- counting -------------------------------------------------------------------------
    def _today(self, wall: float) -> str:
        day_no = int(wall // 86400)  # POSIX time has no leap seconds: the UTC day number
        if day_no != self._day_no:
            self._day_no, self._day = day_no, utc_day(wall)
        return self._day

    def add(self, wall: float, key: str | None, route: str, model: str | None, *, requests: int = 0,
            prompt_tokens: int = 0, completion_tokens: int = 0, gpu_seconds: float = 0.0,
            cost_usd: float = 0.0) -> None:
        row = self._row(self._today(wall), key or NO_KEY, route, (model or NO_MODEL)[:MAX_MODEL_CHARS])
        row[0] += _amount(requests)
        row[1] += _amount(prompt_tokens)
        row[2] += _amount(completion_tokens)
        row[3] += _amount(gpu_seconds)
        row[4] += _amount(cost_usd)
        self.dirty = True

    def _row(self, day: str, key: str, route: str, model: str) -> list[float]:
        r = self.rows.get((day, key, route, model))
        if r is not None:
            return r
        group = (day, key, route)
        if model != OTHER_MODEL and self._models.get(group, 0) >= self.max_models:
            return self._row(day, key, route, OTHER_MODEL)
        if len(self.rows) >= self.max_rows:
            self._drop_oldest_day(keep=day)
            overflow = (OTHER_MODEL, OTHER_MODEL, OTHER_MODEL)
            if len(self.rows) >= self.max_rows and (key, route, model) != overflow:
                # Today alone fills the bill: what does not fit is counted on one row of the day
                # (a group's own "(other)" model row too: only the day's overflow row goes past the cap).
                return self._row(day, OTHER_MODEL, OTHER_MODEL, OTHER_MODEL)
        r = self.rows[(day, key, route, model)] = [0.0] * len(FIELDS)
        self._models[group] = self._models.get(group, 0) + 1
        return r

    def _drop_oldest_day(self, keep: str) -> None:
        days = sorted({k[0] for k in self.rows if k[0] != keep})
        for day in days:
            if len(self.rows) < self.max_rows:
                return
            self._drop_day(day)

    def _drop_day(self, day: str) -> None:
        for k in [k for k in self.rows if k[0] == day]:
            del self.rows[k]
        for g in [g for g in self._models if g[0] == day]:
            del self._models[g]

    # --- reading --------------------------------------------------------------------------
    def select(self, first: str | None, last: str | None, key: str | None = None) -> Iterator[tuple[Row, list[float]]]:
        """Rows of the days ``first``..``last`` (inclusive, ``YYYY-MM-DD``; None: unbounded), of
        one key when given."""
        for k, v in self.rows.items():
            if (first is None or k[0] >= first) and (last is None or k[0] <= last) and (key is None or k[1] == key):
                yield k, v

    # --- persistence ------------------------------------------------------------------------
    def _load(self) -> None:
        if self.path is None or not self.path.exists():
            return
        try:
            data = orjson.loads(self.path.read_bytes())
            rows: dict[Row, list[float]] = {}
            for r in data["rows"]:
                day, key, route, model = (str(x) for x in r[:4])
                rows[(day, key, route, model)] = [float(x) for x in r[4:4 + len(FIELDS)]]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            # A corrupt file must not stop the gateway: it costs the bill's history, not the budgets.
            return
        self.rows = {}
        self._models = {}
        for (day, key, route, model), v in sorted(rows.items()):
            if len(v) == len(FIELDS):
                self._row(day, key, route, model)[:] = v

    def save(self) -> None:
        """Atomic write (temp file + rename), as the budget counters."""
        if self.path is None or not self.dirty:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = orjson.dumps({"fields": [*DIMENSIONS, *FIELDS], "rows": [[*k, *v] for k, v in self.rows.items()]})
        write_atomic(self.path, data)
        self.dirty = False


# --- queries: the same for /admin/usage and /v1/usage ----------------------------------------
@dataclass(frozen=True)
class Query:
    first: str | None
    last: str | None
    group_by: tuple[str, ...]


class BadQuery(ValueError):
    """A query parameter that cannot be used; the message names it."""


def parse_query(params: dict[str, str]) -> Query:
    """``from`` and ``to`` (UTC days ``YYYY-MM-DD``, inclusive, each optional) and ``group_by``
    (one or more of key, route, model, day, comma-separated; none: every dimension, one line per
    row kept)."""
    first, last = _day_param(params, "from"), _day_param(params, "to")
    if first is not None and last is not None and first > last:
        raise BadQuery(f"from ({first}) is after to ({last})")
    raw = params.get("group_by")
    group_by: tuple[str, ...]
    if raw is None:
        group_by = DIMENSIONS
    else:
        parts = tuple(p.strip() for p in raw.split(","))
        bad = [p for p in parts if p not in DIMENSIONS]
        if bad or not parts:
            raise BadQuery(f"group_by must be key, route, model or day (comma-separated), not {raw!r}")
        group_by = tuple(d for d in DIMENSIONS if d in parts)
    return Query(first, last, group_by)


def _day_param(params: dict[str, str], name: str) -> str | None:
    v = params.get(name)
    if v is None:
        return None
    try:
        if not _DAY.fullmatch(v):
            raise ValueError(v)
        dt.date.fromisoformat(v)
    except ValueError:
        raise BadQuery(f"{name} must be a UTC day as YYYY-MM-DD, not {v!r}") from None
    return v


def group(rows: Iterable[tuple[Row, list[float]]], by: tuple[str, ...]) -> list[dict[str, str | float]]:
    """Sums per value of the ``by`` dimensions, sorted by them."""
    idx = [DIMENSIONS.index(d) for d in by]
    sums: dict[tuple[str, ...], list[float]] = {}
    for k, v in rows:
        g = tuple(k[i] for i in idx)
        s = sums.get(g)
        if s is None:
            s = sums[g] = [0.0] * len(FIELDS)
        for i, x in enumerate(v):
            s[i] += x
    return [{**dict(zip(by, g, strict=True)), **_fields(s)} for g, s in sorted(sums.items())]


def total(rows: Iterable[tuple[Row, list[float]]]) -> dict[str, float]:
    """The sums of all ``rows`` (from the rows themselves, not from a grouping's rounded lines)."""
    s = [0.0] * len(FIELDS)
    for _, v in rows:
        for i, x in enumerate(v):
            s[i] += x
    return _fields(s)


def _fields(s: list[float]) -> dict[str, float]:
    # Counts are whole numbers; GPU seconds and dollars keep 6 decimals (a microsecond, a micro-dollar).
    return {"requests": int(s[0]), "prompt_tokens": int(s[1]), "completion_tokens": int(s[2]),
            "gpu_seconds": round(s[3], 6), "cost_usd": round(s[4], 6)}


def to_csv(rows: list[dict[str, str | float]], by: tuple[str, ...]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\r\n")  # RFC 4180
    w.writerow([*by, *FIELDS])
    for r in rows:
        w.writerow([r[c] for c in (*by, *FIELDS)])
    return out.getvalue()
