"""``openai``: OpenAI-compatible servers (vLLM, llama.cpp, Ollama).

Streams pass through unbuffered; on the way we read ``usage`` into token budgets and metrics,
and time the first token. A stream's usage is asked of the node (``stream_options.include_usage``
is added to the body; what that added is cut out again for a client that did not ask for it);
llama.cpp's ``timings`` count when a server sends no usage; without either, each content chunk
counts as one token (an estimate: servers send one token per chunk by default).

Token budgets hold across concurrent and queued requests: at dispatch a request reserves its
estimated tokens (``estimate_tokens``) until its usage arrives, and one that does not fit fails
429 before it reaches the node. A node that refuses the gateway's own credentials (401/403) is a
node failure, never the client's: the client's key is not what the node saw.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

import orjson

from kilolined.adapters import continuation
from kilolined.adapters.base import Adapter, HttpAttempt, Tee
from kilolined.core.config import RouteConfig
from kilolined.core.outcome import Failure
from kilolined.core.rewrite import cost_of
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.affinity import (
    REUSED_AT_LEAST,
    SESSION,
    Affinity,
    KeyMemo,
    prefix_affinity,
    session_affinity,
)
from kilolined.scheduling.anthropic_body import chat_view, is_messages_path
from kilolined.scheduling.costs import choices, prompt_tokens
from kilolined.scheduling.lease import LeaseScope, Sink
from kilolined.scheduling.limits import period_word, seconds_to_period_end
from kilolined.scheduling.queue import Lease, Rejected
from kilolined.scheduling.speed import llm_samples
from kilolined.wire.proxy import Exchange, Observer
from kilolined.wire.upstream import UpstreamResponse

log = logging.getLogger("kilolined")
#: what a node answers when it refuses the gateway's credentials (its `headers`)
CREDENTIAL_STATUSES = frozenset((401, 403))

COMPLETION_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions")
# An SSE ``data:`` line's payload: the line may be indented (any blank but a line break) and its
# payload keeps its own blanks (JSON allows them; a CR of a CRLF line end is one).
_DATA_LINE = re.compile(rb"^[ \t\r\x0b\x0c]*data:(.*)$", re.M)
# A choice's delta whose first member is its text, as vLLM, llama.cpp and SGLang write every token
# (JSON from a serializer: no blanks, no key twice; a read with a ``\u`` escape is parsed, as a key
# may be spelled with one). Found with no backslash before it (its first quote then opens a key: a
# quote inside a string is escaped) and followed by anything but the closing quote, the text is not
# empty: the event is a content chunk, known without parsing it. Other shapes (Ollama's role first,
# reasoning, tool calls) are parsed.
_DELTA_CONTENT = b'"delta":{"content":"'


def _escaped(chunk: bytes | bytearray) -> bool:
    """The bytes hold a ``\\u`` escape: a key may be spelled with one (``"\\u0075sage"`` is
    ``"usage"`` to any JSON parser, the node's client included), so a search for a key's plain
    spelling proves nothing. The letters of ``usage`` and ``timings`` have no other escape."""
    return chunk.find(b"\\u") >= 0


def _null_usage(chunk: bytes, at: int) -> bool:
    """``"usage"`` occurs once in the chunk, as ``"usage":null`` (OpenAI's spelling on every token
    of a stream that asked for usage): nothing to read."""
    return chunk.startswith(b":null", at + 7) and chunk.find(b'"usage"', at + 7) < 0


def request_json(ex: Exchange) -> dict[str, Any] | None:
    """The client's body when it is a JSON object (shared, parsed once per exchange: read it,
    never change it; a rewrite for the node goes to ``ex.body_override``)."""
    data = ex.body_doc()
    return data if isinstance(data, dict) else None


def is_completion(ex: Exchange) -> bool:
    return ex.method == "POST" and ex.tail.split("?", 1)[0].endswith(COMPLETION_PATHS)


def wants_stream(ex: Exchange) -> bool:
    data = request_json(ex)
    return bool(data and data.get("stream") is True)


def _asks_usage(data: dict[str, Any]) -> bool:
    opts = data.get("stream_options")
    return isinstance(opts, dict) and opts.get("include_usage") is True


def flag_error(data: dict[str, Any]) -> str | None:
    """Why the body's stream switches are refused: ``stream`` and ``stream_options.include_usage``
    must be JSON's true or false (or null, or absent). The gateway reads them strictly and a
    lax server (vLLM's pydantic takes ``"true"`` and ``1``) would read a string or a number as
    true: it would stream without the usage the gateway asks for, and a token budget would count
    none of the prompt. OpenAI's API answers such a body 400 too."""
    if not _flag(data.get("stream")):
        return '"stream" must be true or false'
    opts = data.get("stream_options")
    if isinstance(opts, dict) and not _flag(opts.get("include_usage")):
        return '"stream_options.include_usage" must be true or false'
    return None


def _flag(v: Any) -> bool:
    return v is None or v is True or v is False


def gateway_added_usage(ex: Exchange) -> bool:
    """The usage chunk of this stream is ours (asked for by ``prepare``), not the client's."""
    data = request_json(ex)
    return bool(is_completion(ex) and data and data.get("stream") is True and not _asks_usage(data))


def affinity_of(ex: Exchange, route: str, cfg: RouteConfig, memo: KeyMemo | None = None) -> Affinity | None:
    """The request's affinity on a route that has one (docs/CONFIG.md#affinity): its session (the
    ``X-Session-Id`` header, else an OpenAI body's ``user``), or its prompt's prefix keys (``memo``,
    the scheduler's, spares hashing again the messages of a prefix seen before)."""
    if cfg.affinity == SESSION:
        sid: Any = ex.request.headers.get("X-Session-Id")
        if not sid and cfg.kind == "openai" and is_completion(ex):
            sid = (request_json(ex) or {}).get("user")
        return session_affinity(route, sid) if isinstance(sid, str) and sid else None
    if cfg.kind != "openai":
        return None
    data = request_json(ex) if is_completion(ex) else _messages_chat(ex)
    return prefix_affinity(route, data, cfg.affinity_block_bytes, memo) if data is not None else None


def _messages_chat(ex: Exchange) -> dict[str, Any] | None:
    """An Anthropic Messages request as the chat its prefix is indexed by (``system`` first)."""
    if ex.method != "POST" or not is_messages_path(ex.tail.split("?", 1)[0]):
        return None
    data = request_json(ex)
    return chat_view(data) if data is not None else None


def estimate_tokens(data: dict[str, Any]) -> int:
    """A request's tokens before it runs: the prompt's (costs.prompt_tokens: text, tools, token
    ids) plus, when max_tokens is given, that many for each completion it asks for (``n``)."""
    limit = data.get("max_completion_tokens", data.get("max_tokens"))
    extra = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
    return prompt_tokens(data) + extra * choices(data, strict=False)


#: The most tokens one answer's usage may count (a node claiming more is clamped to it): far
#: beyond any context window, small enough that a counter stays exact.
MAX_USAGE_TOKENS = 100_000_000


def usage_count(v: Any) -> int | None:
    """A token count a node reported, as a sane integer in [0, MAX_USAGE_TOKENS]; None when it is
    not a number. A negative count would refill a token budget and run the counter backwards."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else MAX_USAGE_TOKENS if v > 0 else 0
    return max(0, min(MAX_USAGE_TOKENS, math.ceil(v)))


class UsageStripper:
    """Cuts what the gateway added to an SSE stream whose client did not ask for usage: the
    ``usage`` of the usage-only chunk (``"choices": []``), and the chunk itself when nothing but
    OpenAI's envelope is left of it. What else the node put there stays: llama.cpp moves its
    ``timings`` onto that chunk when asked for usage. Every other byte passes as it came, flushed
    per line."""

    __slots__ = ("buf", "drop_blank")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.drop_blank = False

    def feed(self, chunk: bytes) -> bytes:
        # ``find``, not ``in``: bytes' ``in`` tries its operand as an integer first, and builds and
        # drops a formatted TypeError per call, as dear as the search (the per-token path).
        if (not self.buf and not self.drop_blank and chunk.find(b'"usage"') < 0 and chunk.endswith(b"\n")
                and not _escaped(chunk)):
            return chunk  # the common case: no usage in sight, whole lines
        self.buf += chunk
        *lines, rest = self.buf.split(b"\n")
        self.buf = bytearray(rest)
        out = bytearray()
        for line in lines:
            if self.drop_blank and not line.strip():
                self.drop_blank = False  # the blank line that ended the dropped event
                continue
            self.drop_blank = False
            kept = _without_usage(line[5:]) if line.startswith(b"data:") else None
            if kept is None:
                out += line + b"\n"
            elif kept:
                out += b"data: " + kept + (b"\r\n" if line.endswith(b"\r") else b"\n")
            else:
                self.drop_blank = True
        return bytes(out)

    def flush(self) -> bytes:
        rest, self.buf = bytes(self.buf), bytearray()
        return rest


#: what every chunk of a stream carries (OpenAI's, and the servers' own): a usage-only chunk that
#: holds nothing more is the gateway's alone, and goes whole
ENVELOPE = frozenset(("id", "object", "created", "model", "system_fingerprint", "service_tier", "obfuscation",
                      "choices", "usage"))


def _without_usage(payload: bytes | bytearray) -> bytes | None:
    """A data payload as the client gets it: None when it is not a usage-only chunk (it passes as
    it came); else the chunk without its ``usage``, or b"" when only the envelope would be left."""
    if payload.find(b'"usage"') < 0 and not _escaped(payload):
        return None
    try:
        ev = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(ev, dict) and ev.get("choices") == [] and isinstance(ev.get("usage"), dict)):
        return None
    if ENVELOPE.issuperset(ev):
        return b""
    del ev["usage"]
    return orjson.dumps(ev)


class StreamParser(Observer):
    """Reads usage and counts content chunks, from either a JSON body or an SSE stream."""

    # How a stream's first bytes begin (else the answer is one body, read whole when it is done).
    stream_starts: tuple[bytes, ...] = (b"data:", b":", b"event:", b"error:")

    def __init__(self, on_chunk: Any = None):
        self.first_at: float | None = None
        self.chunks = 0
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None  # llama.cpp's, on its last chunk
        self.buf = bytearray()
        self.stream: bool | None = None
        self.on_chunk = on_chunk
        self.strip: UsageStripper | None = None  # set by relay_tap: pass_on cuts the usage chunk too

    def feed(self, chunk: bytes) -> None:
        self.pass_on(chunk)

    def pass_on(self, chunk: bytes) -> bytes:
        """``feed``, returning what the client gets: the chunk, less the usage chunk ``strip``
        cuts out (see ``relay_tap``).

        The per-token path: one whole standard content event in the read (``data: {…}`` and the
        blank line that ends it), nothing held back, no usage or timings in its bytes (and no
        ``\\u`` escape that could spell them). It is
        counted from its bytes, with no JSON parse (``_DELTA_CONTENT``); a read of several whole
        events takes it event by event; any other read takes the full path (``_feed``), which
        parses every data payload."""
        # (A slice compare, not startswith: bytes' methods parse their arguments as a tuple.)
        if (self.stream and not self.buf and chunk[:5] == b"data:" and chunk[-1] == 10
                and chunk.find(b"\n") == len(chunk) - 2 and (i := chunk.find(_DELTA_CONTENT)) > 5
                and chunk[i - 1] != 92 and chunk[i + 20] != 34 and chunk.find(b'"timings"') < 0
                and ((u := chunk.find(b'"usage"')) < 0 or _null_usage(chunk, u))
                and chunk.find(b"\\u") < 0):  # _escaped, inline: the per-token path
            if self.first_at is None:
                self.first_at = time.monotonic()
            self.chunks += 1
            if self.on_chunk is not None:
                self.on_chunk(self.chunks)
            strip = self.strip
            if strip is None:
                return chunk
            if not strip.buf:
                strip.drop_blank = False  # a data line is not the blank line it was waiting for
                return chunk
            return strip.feed(chunk)
        if self.stream and not self.buf and chunk[-2:] == b"\n\n" and chunk.find(b"\n\n") < len(chunk) - 2:
            # Several whole events in one read (the node wrote faster than the gateway read):
            # each takes the path above on its own (a raw blank line only ever ends an event).
            return b"".join([self.pass_on(event + b"\n\n") for event in chunk.split(b"\n\n")[:-1]])
        self._feed(chunk)
        return chunk if self.strip is None else self.strip.feed(chunk)

    def _whole_lines(self, chunk: bytes) -> tuple[bytes, int]:
        """A stream's read, the line an earlier read split joined on in front, and where its last
        ended line ends (the rest waits for the next read). An answer that is not a stream (told by
        how it begins: ``stream_starts``) is held whole (to 8 MiB) for ``done``: nothing to read yet."""
        if self.stream is None:
            self.stream = chunk.lstrip().startswith(self.stream_starts)
        if not self.stream:
            if len(self.buf) < 8 * 1024 * 1024:
                self.buf += chunk
            if self.first_at is None:
                self.first_at = time.monotonic()
            return chunk, 0
        # Only a line split across two reads is buffered.
        if self.buf:
            self.buf += chunk
            chunk = bytes(self.buf)
            self.buf.clear()
        end = chunk.rfind(b"\n") + 1
        if end < len(chunk):
            self.buf += chunk[end:]
        return chunk, end

    def _count_content(self) -> None:
        """One content chunk: the first one's time is the first token's."""
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.chunks += 1
        if self.on_chunk is not None:
            self.on_chunk(self.chunks)

    def _answer_body(self) -> dict[str, Any] | None:
        """The answer's JSON object when it was one body, not a stream (held whole in ``buf``)."""
        if self.stream or not self.buf:
            return None
        try:
            body = orjson.loads(bytes(self.buf))
        except orjson.JSONDecodeError:
            return None
        return body if isinstance(body, dict) else None

    def _feed(self, chunk: bytes) -> None:
        chunk, end = self._whole_lines(chunk)
        if not end:
            return
        # The ``data:`` payloads of the ended lines are found by one regex pass in C (blank lines,
        # comments and other fields never reach Python) and each is parsed as it stands (JSON
        # allows the blanks around it).
        loads, bad = orjson.loads, orjson.JSONDecodeError
        for payload in _DATA_LINE.findall(chunk, 0, end):
            try:
                ev = loads(payload)
            except bad:
                continue  # [DONE], or not JSON
            if ev.__class__ is not dict:
                continue
            if "usage" in ev and ev["usage"].__class__ is dict:
                self.usage = ev["usage"]
            if "timings" in ev and ev["timings"].__class__ is dict:
                self.timings = ev["timings"]
            choices = ev.get("choices")
            if choices.__class__ is list and choices and _has_content(choices):
                self._count_content()

    def done(self, ok: bool) -> None:
        body = self._answer_body()
        if body is not None and isinstance(body.get("usage"), dict):
            self.usage = body["usage"]
        if body is not None and isinstance(body.get("timings"), dict):
            self.timings = body["timings"]

    def prompt_split(self) -> tuple[int, int] | None:
        """(prompt tokens the node reused from its cache, prompt tokens it computed); None when it
        did not say. llama.cpp's ``timings`` (``cache_n``, ``prompt_n``) first, else the OpenAI
        ``usage.prompt_tokens_details.cached_tokens`` of ``prompt_tokens``."""
        t = self.timings
        if t:
            cached, computed = usage_count(t.get("cache_n")), usage_count(t.get("prompt_n"))
            if cached is not None and computed is not None:
                return cached, computed
        u = self.usage
        details = u.get("prompt_tokens_details") if u else None
        if u and isinstance(details, dict):
            cached, prompt = usage_count(details.get("cached_tokens")), usage_count(u.get("prompt_tokens"))
            if cached is not None and prompt is not None:
                return min(cached, prompt), max(0, prompt - cached)
        return None

    def token_split(self) -> tuple[int, int]:
        """(prompt, completion) tokens of the answer, for the bill: the usage's ``prompt_tokens``
        and ``completion_tokens`` (``input_tokens``/``output_tokens`` in Anthropic's words), else
        llama.cpp's timings, else the content chunks as completion; what a usage gives only as a
        total is completion past its prompt. Bounded as ``tokens``."""
        u = self.usage
        if u:
            prompt = usage_count(u.get("prompt_tokens", u.get("input_tokens"))) or 0
            completion = usage_count(u.get("completion_tokens", u.get("output_tokens")))
            if completion is None:
                completion = max(0, (usage_count(u.get("total_tokens")) or 0) - prompt)
        elif self.timings:
            t = self.timings
            prompt = (usage_count(t.get("cache_n")) or 0) + (usage_count(t.get("prompt_n")) or 0)
            completion = usage_count(t.get("predicted_n")) or 0
        else:
            prompt, completion = 0, self.chunks
        return min(MAX_USAGE_TOKENS, prompt), min(MAX_USAGE_TOKENS, completion)

    def tokens(self) -> int:
        """The answer's tokens: usage, else llama.cpp timings, else content chunks; never negative
        and never more than MAX_USAGE_TOKENS, whatever the node claims."""
        if self.usage:
            total = usage_count(self.usage.get("total_tokens"))
            if total is not None:
                return total
            parts = [usage_count(self.usage.get(k)) for k in ("prompt_tokens", "completion_tokens")]
            return min(MAX_USAGE_TOKENS, sum(p for p in parts if p is not None))
        if self.timings:
            # llama.cpp: prompt_n counts only the tokens not served from its cache.
            parts = [usage_count(self.timings.get(k)) for k in ("cache_n", "prompt_n", "predicted_n")]
            return min(MAX_USAGE_TOKENS, sum(p for p in parts if p is not None))
        return self.chunks


def relay_tap(obs: Observer | None, strip: UsageStripper | None) -> Callable[[bytes], bytes]:
    """What a relay calls with each piece of a stream: ``obs`` reads it, and the client gets what
    it returns (the piece, less the usage chunk ``strip`` cuts out). A parser does both in one
    call (``StreamParser.pass_on``)."""
    if isinstance(obs, StreamParser) and obs.strip in (None, strip):
        obs.strip = strip
        return obs.pass_on
    feed = obs.feed if obs is not None else None
    cut = strip.feed if strip is not None else None

    def tap(chunk: bytes) -> bytes:
        if feed is not None:
            feed(chunk)
        return cut(chunk) if cut is not None else chunk

    return tap


class UsageObserver(StreamParser):
    """Feeds token budgets, kiloline_tokens_total and kiloline_ttft_seconds; and what the node
    says it reused of the prompt, kiloline_prompt_tokens_total and the prefix index's correction."""

    def __init__(self, rt: Runtime, route: str, key: str | None, dispatched: float,
                 scope: LeaseScope | None = None):
        super().__init__()
        self.rt, self.route, self.key = rt, route, key
        self.dispatched = dispatched
        self.scope = scope  # told the answer's speed (speed.py) when it ends
        self.lease = scope.lease if scope is not None else None  # told what the node reused (affinity.py)

    def done(self, ok: bool) -> None:
        super().done(ok)
        if self.lease is not None:
            self._reuse(self.lease)
            price = self.lease.target.node.price_per_mtok
            if price is not None:  # a hosted API's bill (docs/CONFIG.md#overflow)
                self.lease.ticket.usd = cost_of(self.token_split(), price)
        if ok and self.scope is not None:
            elapsed = self.rt.clock() - self.dispatched
            # a JSON answer's first byte is its last: only a stream tells the time to first token
            first = max(0.0, self.first_at - self._dispatched_wall()) if self.stream and self.first_at else None
            self.scope.samples = llm_samples(elapsed, first, self.usage, self.timings) or None
        tokens = self.tokens()
        if self.lease is not None:
            self.lease.ticket.tokens = self.token_split()  # charged to the bill with the lease's GPU time
        if self.first_at is not None:
            self.rt.metrics.ttft.labels(self.route).observe(max(0.0, self.first_at - self._dispatched_wall()))
        if tokens:
            self.rt.metrics.tokens.labels(self.route, self.key or "-").inc(tokens)
            if self.key is not None:
                self.rt.limits.add(self.key, time.time(), tokens=tokens)

    def _reuse(self, lease: Lease) -> None:
        split = self.prompt_split()
        if split is None:
            return
        cached, computed = split
        t = lease.ticket
        t.cached = cached
        m = self.rt.metrics
        m.prompt_tokens.labels(self.route, lease.node, "true").inc(cached)
        m.prompt_tokens.labels(self.route, lease.node, "false").inc(computed)
        a = t.affinity
        missed = cached < REUSED_AT_LEAST * (cached + computed)
        if a is not None and a.node == lease.node and a.predicted_hit() and missed:
            # The index said the node holds most of this prompt; the node says it held almost none.
            self.rt.scheduler.mispredicted(lease.node, a)
            m.mispredictions.labels(self.route, lease.node).inc()

    def _dispatched_wall(self) -> float:
        # dispatched is on the runtime clock; convert to time.monotonic's frame.
        return time.monotonic() - (self.rt.clock() - self.dispatched)


def _has_content(choices: list[Any]) -> bool:
    """A choice with generated text: a delta's content, tool calls or reasoning, or a legacy
    completion's ``text``."""
    for c in choices:
        if c.__class__ is not dict:
            continue
        d = c.get("delta")
        if d.__class__ is dict and (d.get("content") or d.get("tool_calls") or d.get("reasoning_content")):
            return True
        if c.get("text"):
            return True
    return False


def progress_reporter(sink: Sink, total: int) -> Callable[[int], None]:
    """A parser's ``on_chunk`` for a streamed job's step_progress: ``n`` chunks of ``total``, told
    to the sink each time the whole percent changes."""
    last = [-1]

    def on_chunk(n: int) -> None:
        pct = min(100, n * 100 // total)
        if pct != last[0]:
            last[0] = pct
            sink.progress(n, total)

    return on_chunk


class OpenAIAdapter(Adapter):
    kind = "openai"

    def prepare(self, ex: Exchange) -> None:
        if not is_completion(ex):
            return
        data = request_json(ex)
        if data is None:
            raise Rejected(400, "bad_request", "body must be a JSON object")
        refused = flag_error(data)
        if refused is not None:
            raise Rejected(400, "bad_request", refused)
        if gateway_added_usage(ex):
            # Without it a stream tells no prompt tokens (the SDK's default): budgets would not hold.
            opts = data.get("stream_options")
            ex.body_override = orjson.dumps({**data, "stream_options": {**(opts if isinstance(opts, dict) else {}),
                                                                          "include_usage": True}})

    def estimate(self, ex: Exchange) -> int:
        """The request's tokens before it runs, reserved from the key's token budget."""
        data = request_json(ex) if is_completion(ex) else None
        return estimate_tokens(data) if data is not None else 0

    async def serve(self, rt: Runtime, scope: LeaseScope, ex: Exchange, sink: Sink) -> None:
        attempt = OpenAIAttempt(scope, ex, self.estimate(ex))
        try:
            up = await scope.acquire(attempt)
            # A stream may go on on another node if its node fails mid-answer (continuation.py).
            await continuation.deliver(rt, scope, ex, sink, up, lambda: self.observer(rt, ex, scope, sink), attempt)
        finally:
            # The usage (if any) was counted when the answer ended: the promise is over.
            attempt.unreserve()

    def observer(self, rt: Runtime, ex: Exchange, scope: LeaseScope, sink: Sink) -> Observer | None:
        if not is_completion(ex):
            return None
        usage = UsageObserver(rt, rt.route_label(scope.route), scope.key, scope.dispatched_at, scope)
        return Tee(usage, self._progress(ex, sink)) if sink.reports_progress else usage

    def named_model(self, ex: Exchange) -> str | None:
        data = request_json(ex)
        model = data.get("model") if data is not None else None
        return model if isinstance(model, str) else None

    @staticmethod
    def _progress(ex: Exchange, sink: Sink) -> Observer | None:
        """step_progress of a streamed job: generated chunks against max_tokens."""
        data = request_json(ex) or {}
        total = data.get("max_tokens") or data.get("max_completion_tokens")
        if not isinstance(total, int) or total <= 0 or not data.get("stream"):
            return None
        return StreamParser(progress_reporter(sink, total))


class OpenAIAttempt(HttpAttempt):
    """One try on a node: the token budget's reservation first, then the request.

    The reservation is re-checked at every dispatch (a queued request may find the budget spent
    by the ones ahead of it) and taken once. 401/403 from the node mean the gateway's key for
    it is wrong: a node failure (breaker, re-queue to another node, 502), logged loudly.
    """

    __slots__ = ("estimate", "key", "reserved")
    credential_statuses = CREDENTIAL_STATUSES

    def __init__(self, scope: LeaseScope, ex: Exchange, estimate: int):
        super().__init__(scope, ex)
        self.key, self.estimate = scope.key, estimate
        self.reserved: int | None = None

    async def _reserve(self) -> None:
        if self.reserved is not None or self.key is None:
            return
        kcfg = self.rt.cfg.keys.get(self.key)
        budget = kcfg.budget if kcfg else None
        wall = time.time()
        got = await self.rt.limits.reserve_tokens(self.key, budget, self.estimate, wall)
        if got is None:
            period = budget.period if budget is not None else "day"
            raise Failure("budget_exhausted", f"{period_word(period)} budget tokens_per_day cannot hold this request "
                          f"(about {self.estimate} tokens)", 429, retry_after=seconds_to_period_end(period, wall))
        self.reserved = got

    def unreserve(self) -> None:
        if self.reserved and self.key is not None:
            self.rt.limits.release_tokens(self.key, self.reserved)
        self.reserved = None

    async def __call__(self, lease: Lease) -> UpstreamResponse:
        await self._reserve()
        return await super().__call__(lease)
