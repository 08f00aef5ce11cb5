"""The simulated GPU's prompt cache: what llama.cpp's `cache_prompt` and `--cache-ram` do, in small.

A prompt is a list of tokens. The fake's tokenizer is whitespace: every word is one token, and
the first word of each message carries its role (`"user\\0Hello"`), so that the same words said by
another role, or cut into other messages, do not match. Word counts keep `usage.prompt_tokens`
what the fake always reported, and are easy to predict in a test.

The cache holds the token lists of the prompts (and replies) it served, least recently used
first, bounded by their total length. A request reuses the entry that shares the longest
leading run of tokens with it, as llama.cpp loads the most similar saved prompt into a slot.
While a request uses an entry, the entry is busy: a concurrent request cannot reuse it (llama.cpp
with `-no-kvu` moves a saved prompt into one slot; two slots do not share it). When a request
ends its tokens are saved, and every entry that is a prefix of them is dropped as obsolete.
Pure logic, no I/O: `openai.py` drives it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


def message_tokens(role: str, text: str) -> list[str]:
    """One message's tokens: its words, the first tagged with the role."""
    words = text.split()
    if words:
        words[0] = f"{role}\0{words[0]}"
    return words


def message_text(message: Any) -> str:
    """The text of a chat message: its string content, or its text parts joined by spaces."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(part["text"] for part in content
                        if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def prompt_tokens(messages: list[Any]) -> list[str]:
    """The prompt of a chat request as the fake's tokenizer sees it."""
    out: list[str] = []
    for message in messages:
        role = message.get("role") if isinstance(message, dict) else None
        out += message_tokens(role if isinstance(role, str) else "", message_text(message))
    return out


def common_prefix(a: list[str], b: list[str]) -> int:
    """How many leading tokens `a` and `b` share (binary search over slice equality: C-speed compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(eq=False)
class Entry:
    model: str
    tokens: list[str]
    busy: int = 0  # requests using it now


@dataclass
class Hit:
    """What a request reused: `cached` tokens of `entry` (None: nothing)."""

    cached: int
    entry: Entry | None = None


@dataclass
class PromptCache:
    """Saved prompts, least recently used first, at most `max_tokens` tokens in all (0: no cache)."""

    max_tokens: int
    _entries: OrderedDict[int, Entry] = field(default_factory=OrderedDict)
    _next: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(e.tokens) for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, model: str, tokens: list[str]) -> Hit:
        """The longest reusable prefix of `tokens`; the entry holding it is busy until `save`/`release`.

        At least one token is always computed, as llama.cpp does: a repeat of a cached prompt
        reports `len(tokens) - 1` cached."""
        best_key, best_n = 0, 0
        for key, entry in self._entries.items():
            if entry.busy or entry.model != model:
                continue
            n = common_prefix(entry.tokens, tokens)
            if n > best_n:
                best_key, best_n = key, n
        if not best_n:
            return Hit(0)
        entry = self._entries[best_key]
        entry.busy += 1
        self._entries.move_to_end(best_key)
        return Hit(min(best_n, max(len(tokens) - 1, 0)), entry)

    def release(self, hit: Hit) -> None:
        if hit.entry is not None and hit.entry.busy:
            hit.entry.busy -= 1

    def save(self, model: str, tokens: list[str], hit: Hit | None = None) -> None:
        """A request is done with `tokens`: keep them as the newest entry, drop what they contain."""
        if hit is not None:
            self.release(hit)
        if not tokens or len(tokens) > self.max_tokens:
            return
        for key, entry in list(self._entries.items()):
            if entry.model != model or entry.busy:
                continue
            if len(entry.tokens) <= len(tokens) and entry.tokens == tokens[:len(entry.tokens)]:
                del self._entries[key]  # obsolete: the new entry holds all of it
            elif len(entry.tokens) > len(tokens) and entry.tokens[:len(tokens)] == tokens:
                self._entries.move_to_end(key)  # already held in full by a longer one
                return
        self._next += 1
        self._entries[self._next] = Entry(model, list(tokens))
        total = self.tokens
        while total > self.max_tokens and self._entries:
            _, oldest = self._entries.popitem(last=False)
            total -= len(oldest.tokens)

    def forget(self, model: str | None = None) -> None:
        """Drop every entry (the process died), or those of one model (it was unloaded)."""
        for key, entry in list(self._entries.items()):
            if model is None or entry.model == model:
                del self._entries[key]
