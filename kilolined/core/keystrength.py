"""How hard a clear-text key is to guess, in bits (docs/CONFIG.md#guessable-keys).

Pure. A key's length says little: ``aaaaaaaaaaaaaaaa``, ``1234567890123456`` and
``passwordpassword`` are 16 characters and none takes a guesser more than a few thousand tries.
The estimate charges each character the bits of the alphabet the key draws from (the classes it
uses: lower case, upper case, digits, the rest) unless a guesser would predict it, as zxcvbn and
the compressors do: a character that repeats the one before it, one that continues a run the two
before it began (``abc``, ``987``), a chunk of three or more that already occurred earlier in the
key (one symbol for the whole chunk), and a well-known word (one symbol for the word). A key
from ``kilolined keygen`` (``kl_`` + 32 random url-safe characters) is estimated at 200 bits or
more; the rule asks for MIN_KEY_BITS.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterable

#: the least a clear-text key's estimate may be: far above the repeated words, runs and single
#: characters that a guesser tries first (10-20 bits), below what random keys score (16 lower-case
#: letters 52-75, 16 hex digits 40-83, 16 base64 characters 68-105; of 16 hex digits a few in
#: 10,000, drawn nearly without letters, are refused), and far below ``kilolined keygen``'s 200
MIN_KEY_BITS = 48
#: the shortest chunk counted as a repeat of an earlier part of the key
MIN_REPEAT = 3
#: the shortest well-known word looked for inside a key (shorter ones occur by chance)
MIN_WORD = 4

_CLASSES = (frozenset(string.ascii_lowercase), frozenset(string.ascii_uppercase), frozenset(string.digits))
_ALNUM = frozenset().union(*_CLASSES)
_OTHER = 33  # the class of every other character: ASCII punctuation and space


def alphabet(key: str) -> int:
    """The size of the alphabet the key draws from: the classes of characters it uses."""
    chars = set(key)
    size = sum(len(c) for c in _CLASSES if chars & c) + (_OTHER if chars - _ALNUM else 0)
    return max(size, 2)


def _word_starts(lowered: str, words: Iterable[str]) -> dict[int, int]:
    """Where a well-known word begins in the key (lower-cased), and its length (the longest)."""
    found: dict[int, int] = {}
    for w in words:
        if len(w) < MIN_WORD:
            continue
        at = lowered.find(w)
        while at >= 0:
            found[at] = max(found.get(at, 0), len(w))
            at = lowered.find(w, at + 1)
    return found


def _repeat(key: str, i: int) -> int:
    """The length of the longest chunk at ``i`` (at least MIN_REPEAT) that begins earlier in the
    key too (it may run into itself, as ``ababab`` does); 0 if none."""
    n = 0
    while i + n < len(key) and key.find(key[i:i + n + 1], 0, i + n) >= 0:
        n += 1
    return n if n >= MIN_REPEAT else 0


def _predictable(key: str, i: int) -> bool:
    """The character at ``i`` repeats the one before it, or continues a run of +1 or -1 steps."""
    if i == 0:
        return False
    step = ord(key[i]) - ord(key[i - 1])
    return step == 0 or (abs(step) == 1 and i >= 2 and ord(key[i - 1]) - ord(key[i - 2]) == step)


def key_bits(key: str, words: Iterable[str] = ()) -> float:
    """The estimated bits a guesser needs for ``key`` (``words``: well-known words, charged as
    one symbol each)."""
    per = math.log2(alphabet(key))
    starts = _word_starts(key.lower(), words)
    bits, i = 0.0, 0
    while i < len(key):
        if i in starts:
            bits += per
            i += starts[i]
        elif (n := _repeat(key, i)):
            bits += per
            i += n
        else:
            bits += 0.0 if _predictable(key, i) else per
            i += 1
    return bits
