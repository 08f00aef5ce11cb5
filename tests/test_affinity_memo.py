"""The prefix keys as the gateway computes them (KeyMemo: recent messages remembered, the rest
hashed; PrefixIndex's shortcut for a chain recorded again) against docs/CONFIG.md#affinity's rule
written out plainly here: the same match counts, whatever is remembered."""

from __future__ import annotations

import hashlib
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from kilolined.scheduling.affinity import (
    MAX_INDEXED_BYTES,
    MAX_INDEXED_MESSAGES,
    KeyMemo,
    PrefixIndex,
    canonical,
    chain,
    prefix_affinity,
    seed,
)

# --- the rule, plainly ---------------------------------------------------------------------------


def plain_text(data: dict[str, Any]) -> bytes:
    """The model, NUL, the tools' JSON and NUL if any, then each chat message's role, NUL, its
    text parts in order, NUL; or a completion's prompt (its JSON if not a string); 128 KiB and the
    first 256 entries of ``messages`` at most."""
    model = data.get("model")
    text = (model if isinstance(model, str) else "").encode() + b"\0"
    if data.get("tools") is not None:
        text += orjson.dumps(data["tools"]) + b"\0"
    messages = data.get("messages")
    if isinstance(messages, list):
        for m in messages[:MAX_INDEXED_MESSAGES]:
            if not isinstance(m, dict):
                continue
            role, content = m.get("role"), m.get("content")
            text += (role if isinstance(role, str) else "").encode() + b"\0"
            if isinstance(content, str):
                text += content.encode()
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        text += part["text"].encode()
            text += b"\0"
    elif isinstance(data.get("prompt"), str):
        text += data["prompt"].encode()
    elif data.get("prompt") is not None:
        text += orjson.dumps(data["prompt"])
    return text[:MAX_INDEXED_BYTES]


def plain_keys(route: str, data: dict[str, Any], block: int) -> list[bytes]:
    """Key i: a hash of block i and key i-1, the first seeded by the route and the model."""
    model = data.get("model")
    prev = f"{route}\0{model if isinstance(model, str) else ''}".encode()
    text, keys = plain_text(data), []
    for i in range(0, len(text), block):
        prev = hashlib.sha256(prev + text[i:i + block]).digest()
        keys.append(prev)
    return keys


def plain_match(recorded: list[list[bytes]], keys: list[bytes]) -> int:
    held = {k for ks in recorded for k in ks}
    n = 0
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


# --- requests that share prefixes ------------------------------------------------------------------

texts = st.text(alphabet=st.sampled_from("ab\0é€\U0001f600 "), max_size=300)
contents = st.one_of(texts, st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                               st.just({"type": "image_url"})), max_size=3), st.none())
messages = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]),
                                  "content": contents})


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Requests where each is another one's messages, cut or carried on, on one or two models."""
    pool: list[list[Any]] = [draw(st.lists(messages, max_size=4))]
    out = []
    for _ in range(draw(st.integers(1, 6))):
        base = draw(st.sampled_from(pool))
        msgs = base[:draw(st.integers(0, len(base)))] + draw(st.lists(messages, max_size=3))
        pool.append(msgs)
        data: dict[str, Any] = {"model": draw(st.sampled_from(["m", "n"])), "messages": msgs}
        if draw(st.booleans()):
            data = {"model": data["model"], "prompt": draw(st.one_of(texts, st.lists(st.integers(0, 9), max_size=5)))}
        if draw(st.integers(0, 4)) == 0:
            data["tools"] = [{"type": "function", "name": draw(texts)}]
        out.append(data)
    return out


@settings(max_examples=150, deadline=None)
@given(conversations(), st.sampled_from([1, 3, 16, 64, 256]), st.integers(400, 6000))
def test_the_memos_keys_are_the_chain_of_the_canonical_text(reqs: list[dict[str, Any]], block: int,
                                                              memo_bytes: int) -> None:
    memo = KeyMemo(memo_bytes)  # small: entries are pushed out between requests
    for data in reqs * 2:  # each twice: the second time from what is remembered
        a = prefix_affinity("r", data, block, memo)
        want = chain(canonical(data), seed("r", data.get("model")), block)
        assert canonical(data) == plain_text(data)
        assert (a.keys if a is not None else ()) == want
        assert a is None or a.size == len(plain_text(data))
        assert memo._bytes <= memo_bytes


@settings(max_examples=150, deadline=None)
@given(conversations(), st.sampled_from([1, 16, 64]), st.lists(st.booleans(), min_size=12, max_size=12))
def test_match_counts_are_the_plain_rules(reqs: list[dict[str, Any]], block: int, again: list[bool]) -> None:
    memo, idx, recorded = KeyMemo(), PrefixIndex(), []
    for i, data in enumerate(reqs * 2):
        a = prefix_affinity("r", data, block, memo)
        keys = a.keys if a is not None else ()
        ref = plain_keys("r", data, block)
        assert len(keys) == len(ref)
        assert idx.match(keys) == plain_match(recorded, ref)
        idx.record(keys)
        recorded.append(ref)
        if again[i % len(again)]:  # recorded again at once: nothing may change
            idx.record(keys)
        assert idx.match(keys) == len(keys)


def test_a_message_like_a_remembered_one_is_hashed_for_itself() -> None:
    # Same role, length, head and tail as a remembered message, another middle: its own keys.
    memo = KeyMemo()
    one = {"model": "m", "messages": [{"role": "user", "content": "h" * 200 + "A" * 600 + "t" * 40}]}
    two = {"model": "m", "messages": [{"role": "user", "content": "h" * 200 + "B" * 600 + "t" * 40}]}
    a, b = prefix_affinity("r", one, 64, memo), prefix_affinity("r", two, 64, memo)
    assert a is not None and b is not None
    assert b.keys == chain(canonical(two), seed("r", "m"), 64)
    assert a.keys[:3] == b.keys[:3] and a.keys[3] != b.keys[3]  # "m\0user\0" and 200 h: three blocks alike


def test_a_prefix_sent_again_is_remembered_not_hashed() -> None:
    memo = KeyMemo()
    doc = {"role": "system", "content": "the document " * 2000}
    first = prefix_affinity("r", {"model": "m", "messages": [doc, {"role": "user", "content": "?"}]}, 256, memo)
    # A new parse of the same request: equal strings, other objects. The same keys, the same tuple.
    again = prefix_affinity("r", orjson.loads(orjson.dumps({"model": "m", "messages": [
        doc, {"role": "user", "content": "?"}]})), 256, memo)
    assert first is not None and again is not None and again.keys is first.keys
    # The next turn keeps the document's keys and adds its own.
    turn = prefix_affinity("r", {"model": "m", "messages": [doc, {"role": "user", "content": "?"},
                                                             {"role": "assistant", "content": "!"}]}, 256, memo)
    assert turn is not None and turn.keys[:len(first.keys) - 1] == first.keys[:-1]
    assert len(memo) == 4  # the model, the document, the question, the answer


def test_the_memo_holds_at_most_its_bytes() -> None:
    memo = KeyMemo(64 * 1024)
    for i in range(200):
        prefix_affinity("r", {"model": "m", "messages": [{"role": "user", "content": f"{i} " * 1000}]}, 256, memo)
    assert memo._bytes <= 64 * 1024 and 0 < len(memo) < 200
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 200_000}]}
    a = prefix_affinity("r", big, 256, memo)  # larger than the whole memo: keyed, then let go
    assert a is not None and a.keys == chain(canonical(big), seed("r", "m"), 256) and memo._bytes <= 64 * 1024


def test_a_chain_recorded_again_after_others_moves_back_to_the_front() -> None:
    a, b = tuple(range(10)), tuple(range(100, 110))
    idx = PrefixIndex(limit=15)
    idx.record(a)
    idx.record(b)  # a's deepest five go
    assert idx.match(a) == 5
    idx.record(a)  # back whole: now b's deepest go
    idx.record(a)
    assert idx.match(a) == 10 and idx.match(b) == 5
    idx.drop(a[3:])
    assert idx.match(a) == 3
    idx.record(a)
    assert idx.match(a) == 10
