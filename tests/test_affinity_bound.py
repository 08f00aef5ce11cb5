"""The prefix index's work per request is bounded: at most 128 KiB and the first 256 entries of
``messages`` are indexed (docs/CONFIG.md#affinity), so a request made of thousands of tiny
messages, or of entries that are not messages at all, costs what 256 messages cost. Counted,
not timed: the Python lines ``KeyMemo.affinity`` runs."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

from kilolined.scheduling.affinity import MAX_INDEXED_MESSAGES, KeyMemo, canonical, chain, seed


def tiny(n: int, tag: str = "") -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"{tag}{i}"} for i in range(n)]}


def lines_run(memo: KeyMemo, data: dict[str, Any]) -> int:
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return trace

    sys.settrace(trace)
    try:
        memo.affinity("r", data, 256)
    finally:
        sys.settrace(None)
    return count


def test_many_tiny_messages_cost_what_the_first_ones_do() -> None:
    bounded = lines_run(KeyMemo(), tiny(MAX_INDEXED_MESSAGES, "a"))
    assert lines_run(KeyMemo(), tiny(10_000, "b")) < 1.1 * bounded  # 10,000 messages of ~12 bytes: 120 KiB
    assert lines_run(KeyMemo(), {"model": "m", "messages": [1] * 100_000}) < bounded  # not messages at all


def test_only_the_first_messages_are_indexed_and_remembered() -> None:
    memo = KeyMemo()
    long, longer = tiny(10_000), tiny(20_000)
    a, b = memo.affinity("r", long, 256), memo.affinity("r", longer, 256)
    assert a is not None and b is not None and a.keys == b.keys  # the same first 256 messages
    first = {"model": "m", "messages": long["messages"][:MAX_INDEXED_MESSAGES]}
    same_text = canonical(long) == canonical(first)  # (a bool: pytest would diff 120 KiB)
    assert same_text
    assert a.keys == chain(canonical(first), seed("r", "m"), 256)
    assert len(memo) <= MAX_INDEXED_MESSAGES + 1  # the model's step and one per message
