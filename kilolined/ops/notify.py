"""Operator alerts on Telegram, Discord and a generic signed webhook (docs/CONFIG.md#notify).

``Notifier.emit()`` is called from the request path and from health checks, so it only touches
in-memory state: it filters, folds repeats and collects events into a group; a timer turns the
group into one message per channel, and each channel has its own bounded outbox and worker task,
so a dead or rate-limited channel never delays another, nor anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
import orjson

from kilolined.core.config import DiscordConfig, NotifyConfig, TelegramConfig, WebhookTargetConfig
from kilolined.ops.webhooks import describe_error, new_msg_id, parse_retry_after, signed_headers

log = logging.getLogger("kilolined.ops.notify")

TELEGRAM_MAX_CHARS = 4096
DISCORD_MAX_CHARS = 2000
# One group holds at most this many lines; the rest are counted ("…and N more events"), so a
# storm of distinct events cannot grow a message (or memory) without bound.
MAX_GROUP_LINES = 50
# A server asking us to wait longer than this is asked again after this long.
MAX_RETRY_AFTER_SEC = 600.0
DEFAULT_BACKOFF_SEC = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
USER_AGENT = "KiloLine-Notify/1"


def utf16_len(text: str) -> int:
    # Telegram (and Discord's JS side) count UTF-16 code units, so astral characters count twice.
    return len(text.encode("utf-16-le")) // 2


def truncate(text: str, limit: int) -> str:
    """Cut ``text`` to at most ``limit`` UTF-16 units, never inside a character, marking the cut.

    A cut near the end prefers the last line break, so a grouped message loses whole lines.
    """
    if utf16_len(text) <= limit:
        return text
    suffix = "\n…"
    budget = limit - len(suffix)
    used = 0
    end = 0
    for i, ch in enumerate(text):
        used += 2 if ord(ch) > 0xFFFF else 1
        if used > budget:
            end = i
            break
    cut = text[:end]
    nl = cut.rfind("\n")
    if nl >= budget * 3 // 4:
        cut = cut[:nl]
    return cut.rstrip() + suffix


@dataclass
class Alert:
    """One outgoing message: the events of one group, shared by every channel."""

    events: list[tuple[str, str | None, str]]
    text: str
    created: float = field(default_factory=time.time)
    # One webhook-id per alert, so a receiver can de-duplicate our retries.
    msg_id: str = field(default_factory=new_msg_id)

    @functools.cached_property
    def webhook_body(self) -> bytes:
        # Serialised once: every attempt signs and sends the same bytes.
        ts = dt.datetime.fromtimestamp(self.created, dt.UTC).isoformat(timespec="seconds")
        return orjson.dumps(
            {
                "type": "kiloline.alert",
                "timestamp": ts.replace("+00:00", "Z"),
                "events": [{"event": e, "node": n, "text": t} for e, n, t in self.events],
                "text": self.text,
            }
        )

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0][:120]


class _Outcome(NamedTuple):
    ok: bool
    detail: str = ""
    retry_after: float | None = None
    permanent: bool = False  # retrying cannot help (bad request, bad token): drop this alert
    disable: bool = False  # the endpoint is gone: stop using the channel until reconfigured


async def _json_or_none(resp: aiohttp.ClientResponse) -> dict[str, Any] | None:
    try:
        data = orjson.loads(await resp.content.read(64 * 1024))
    except (TimeoutError, orjson.JSONDecodeError, aiohttp.ClientError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _float_or_none(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f >= 0 and f == f else None


class _Channel:
    """One destination: a bounded outbox drained by one worker task, with retries."""

    name = "channel"

    def __init__(self, notifier: Notifier, cfg: Any, max_outbox: int) -> None:
        self.notifier = notifier
        self.cfg = cfg
        self.queue: asyncio.Queue[Alert] = asyncio.Queue(maxsize=max_outbox)
        self.task: asyncio.Task[None] | None = None
        self.busy = False
        self.disabled = False
        self.counts = {"sent": 0, "failed": 0, "dropped": 0}

    # -- bookkeeping -----------------------------------------------------------------------
    def _bump(self, key: str, n: int = 1) -> None:
        self.counts[key] += n
        self.notifier._totals[key] += n

    def reconfigure(self, cfg: Any) -> None:
        self.cfg = cfg
        if self.disabled:
            log.info("[notify] %s reconfigured: sending again", self.name)
        self.disabled = False

    def offer(self, alert: Alert) -> None:
        if self.disabled:
            self._bump("dropped")
            return
        if self.queue.full():
            # The newest alert says more about the present than the oldest one does.
            self.queue.get_nowait()
            self.queue.task_done()
            self._bump("dropped")
            log.warning("[notify] %s outbox full: dropped the oldest alert", self.name)
        self.queue.put_nowait(alert)

    def start(self) -> None:
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run(), name=f"notify-{self.name}")

    def drop_pending(self) -> int:
        n = 0
        while not self.queue.empty():
            self.queue.get_nowait()
            self.queue.task_done()
            n += 1
        if n:
            self._bump("dropped", n)
        return n

    @property
    def pending(self) -> int:
        return self.queue.qsize() + (1 if self.busy else 0)

    def snapshot(self) -> dict[str, Any]:
        return {**self.counts, "pending": self.pending, "disabled": self.disabled}

    # -- the worker ------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            alert = await self.queue.get()
            self.busy = True
            try:
                await self._deliver(alert)
            except asyncio.CancelledError:
                raise
            except Exception:
                self._bump("failed")
                log.exception("[notify] %s: unexpected error while sending", self.name)
            finally:
                self.busy = False
                self.queue.task_done()

    async def _deliver(self, alert: Alert) -> None:
        backoff = self.notifier._backoff
        attempts = len(backoff) + 1
        for attempt in range(1, attempts + 1):
            if self.disabled:
                self._bump("dropped")
                return
            try:
                outcome = await self.send(self.notifier._get_session(), alert)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                outcome = _Outcome(False, describe_error(e))
            if outcome.ok:
                self._bump("sent")
                log.debug("[notify] %s: sent %r", self.name, alert.first_line)
                return
            if outcome.disable:
                self.disabled = True
                self._bump("failed")
                dropped = self.drop_pending()
                log.error(
                    "✗ [notify] %s: %s — channel disabled until the config changes (%d queued alerts dropped)",
                    self.name,
                    outcome.detail,
                    dropped,
                )
                return
            if outcome.permanent or attempt == attempts:
                self._bump("failed")
                why = "not retryable" if outcome.permanent else f"giving up after {attempt} attempts"
                log.error("✗ [notify] %s: %s — %s; dropped %r", self.name, outcome.detail, why, alert.first_line)
                return
            wait = backoff[attempt - 1]
            if outcome.retry_after is not None:
                # The server said exactly when; waiting longer than that only delays the alert.
                wait = min(outcome.retry_after, MAX_RETRY_AFTER_SEC)
            log.warning(
                "✗ [notify] %s: %s — retry %d/%d in %gs", self.name, outcome.detail, attempt, attempts - 1, wait
            )
            await asyncio.sleep(wait)

    async def send(self, session: aiohttp.ClientSession, alert: Alert) -> _Outcome:
        raise NotImplementedError

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.notifier._send_timeout)


class _Telegram(_Channel):
    name = "telegram"
    cfg: TelegramConfig

    def __init__(self, notifier: Notifier, cfg: TelegramConfig, max_outbox: int) -> None:
        super().__init__(notifier, cfg, max_outbox)
        # Set when Telegram says the group became a supergroup; cleared on reconfigure.
        self.migrated_chat_id: int | None = None

    def reconfigure(self, cfg: Any) -> None:
        super().reconfigure(cfg)
        self.migrated_chat_id = None

    async def send(self, session: aiohttp.ClientSession, alert: Alert) -> _Outcome:
        cfg = self.cfg
        # The token is part of the URL: this URL must never reach a log line.
        url = f"{cfg.api_base.rstrip('/')}/bot{cfg.bot_token}/sendMessage"
        chat_id = self.migrated_chat_id if self.migrated_chat_id is not None else cfg.chat_id
        payload = {
            "chat_id": chat_id,
            "text": truncate(alert.text, TELEGRAM_MAX_CHARS),
            "disable_web_page_preview": True,
        }
        async with session.post(url, json=payload, timeout=self._timeout(), allow_redirects=False) as resp:
            data = await _json_or_none(resp)
            if resp.status == 200 and (data is None or data.get("ok") is not False):
                return _Outcome(True)
            data = data or {}
            given = data.get("parameters")
            params = given if isinstance(given, dict) else {}
            desc = str(data.get("description") or resp.reason or "")[:200]
            detail = f"HTTP {resp.status} {desc}".strip()
            if resp.status == 429:
                ra = _float_or_none(params.get("retry_after"))
                if ra is None:
                    ra = parse_retry_after(resp.headers.get("Retry-After"))
                return _Outcome(False, detail, retry_after=ra)
            migrate = params.get("migrate_to_chat_id")
            if isinstance(migrate, int) and self.migrated_chat_id != migrate:
                self.migrated_chat_id = migrate
                log.warning(
                    "[notify] telegram: the chat moved to %s; sending there — update notify.telegram.chat_id",
                    migrate,
                )
                return _Outcome(False, detail, retry_after=0)
            # 400 (bad chat, bad text), 401 (bad token), 403 (bot kicked), 404: retrying won't help.
            permanent = 400 <= resp.status < 500
            return _Outcome(False, detail, permanent=permanent)


class _Discord(_Channel):
    name = "discord"
    cfg: DiscordConfig

    def __init__(self, notifier: Notifier, cfg: DiscordConfig, max_outbox: int) -> None:
        super().__init__(notifier, cfg, max_outbox)
        # Discord tells us when a bucket is empty; waiting it out avoids a 429 in the first place.
        self.not_before = 0.0

    async def send(self, session: aiohttp.ClientSession, alert: Alert) -> _Outcome:
        loop = asyncio.get_running_loop()
        if self.not_before > loop.time():
            await asyncio.sleep(self.not_before - loop.time())
        payload = {
            "content": truncate(alert.text, DISCORD_MAX_CHARS),
            # Alert text is ours but quotes node labels and route names: never ping anyone.
            "allowed_mentions": {"parse": []},
        }
        async with session.post(
            self.cfg.webhook_url, json=payload, timeout=self._timeout(), allow_redirects=False
        ) as resp:
            if resp.headers.get("X-RateLimit-Remaining") == "0":
                reset = _float_or_none(resp.headers.get("X-RateLimit-Reset-After"))
                if reset is not None:
                    self.not_before = loop.time() + min(reset, MAX_RETRY_AFTER_SEC)
            if resp.status in (200, 204):
                return _Outcome(True)
            data = await _json_or_none(resp) or {}
            detail = f"HTTP {resp.status} {str(data.get('message') or resp.reason or '')[:200]}".strip()
            if resp.status == 429:
                ra = parse_retry_after(resp.headers.get("Retry-After"))
                if ra is None:
                    ra = _float_or_none(data.get("retry_after"))
                return _Outcome(False, detail, retry_after=ra)
            if resp.status == 404:
                # Discord's rule: a webhook that answered 404 is deleted; hammering it risks a ban.
                return _Outcome(False, detail, disable=True)
            return _Outcome(False, detail, permanent=400 <= resp.status < 500)


class _Webhook(_Channel):
    name = "webhook"
    cfg: WebhookTargetConfig

    async def send(self, session: aiohttp.ClientSession, alert: Alert) -> _Outcome:
        body = alert.webhook_body
        try:
            headers = signed_headers(self.cfg.secret, alert.msg_id, body)
        except ValueError:
            return _Outcome(False, "notify.webhook.secret is not whsec_ base64", permanent=True)
        async with session.post(
            self.cfg.url, data=body, headers=headers, timeout=self._timeout(), allow_redirects=False
        ) as resp:
            if 200 <= resp.status < 300:
                return _Outcome(True)
            detail = f"HTTP {resp.status}"
            if resp.status == 410:
                # Standard Webhooks: 410 Gone means "disable this endpoint".
                return _Outcome(False, detail, disable=True)
            # Any other answer (3xx included: redirects are not followed) is retried.
            return _Outcome(False, detail, retry_after=parse_retry_after(resp.headers.get("Retry-After")))


_CHANNEL_TYPES: tuple[tuple[str, type[_Channel]], ...] = (
    ("telegram", _Telegram),
    ("discord", _Discord),
    ("webhook", _Webhook),
)


class Notifier:
    """Filters, folds and groups events, then hands one message per group to every channel."""

    def __init__(
        self,
        cfg: NotifyConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        session_factory: Callable[[], aiohttp.ClientSession] | None = None,
        max_outbox: int = 1000,
        retry_backoff_sec: Sequence[float] = DEFAULT_BACKOFF_SEC,
        send_timeout_sec: float = 10.0,
    ) -> None:
        self._cfg = cfg
        self._clock = clock
        self._session_factory = session_factory
        self._session: aiohttp.ClientSession | None = None
        self._max_outbox = max(1, max_outbox)
        self._backoff = [float(b) for b in retry_backoff_sec]
        self._send_timeout = send_timeout_sec
        self._totals = {"sent": 0, "failed": 0, "dropped": 0, "filtered": 0, "folded": 0}
        self._channels: dict[str, _Channel] = {}
        self._retired: list[asyncio.Task[None]] = []
        # (event, node) -> clock() of the last one let through, and how many were folded since.
        self._last_sent: dict[tuple[str, str | None], float] = {}
        self._folded: dict[tuple[str, str | None], int] = {}
        # A folded repeat still goes out once its interval ends (latest text), so that a node
        # flapping down/up/down never leaves "up" as the operator's last word.
        self._fold_text: dict[tuple[str, str | None], str] = {}
        self._fold_timers: dict[tuple[str, str | None], asyncio.TimerHandle] = {}
        self._prune_at = 1024
        self._group: list[tuple[str, str | None, str]] = []
        self._group_overflow = 0
        self._flush_handle: asyncio.Handle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._closed = False
        self._apply_channels(cfg)

    # -- configuration ---------------------------------------------------------------------
    def configure(self, cfg: NotifyConfig) -> None:
        """Hot reload: filters and intervals apply to the next emit; channels keep their outboxes."""
        self._cfg = cfg
        self._apply_channels(cfg)

    def _apply_channels(self, cfg: NotifyConfig) -> None:
        for name, cls in _CHANNEL_TYPES:
            sub = getattr(cfg, name)
            ch = self._channels.get(name)
            if sub is None:
                if ch is not None:
                    del self._channels[name]
                    ch.drop_pending()
                    if ch.task is not None:
                        ch.task.cancel()
                        self._retired.append(ch.task)
            elif ch is None:
                ch = cls(self, sub, self._max_outbox)
                self._channels[name] = ch
                if self._started and not self._closed:
                    ch.start()
            elif ch.cfg != sub:
                ch.reconfigure(sub)

    # -- the hot path ----------------------------------------------------------------------
    def emit(self, event: str, text: str, *, node: str | None = None) -> None:
        """Record an event for the operator. Synchronous and cheap; never raises."""
        try:
            self._emit(event, text, node)
        except Exception:
            log.exception("[notify] emit(%s) failed", event)

    def _emit(self, event: str, text: str, node: str | None) -> None:
        cfg = self._cfg
        if self._closed or not self._channels:
            return  # nobody to tell
        if event not in cfg.events:
            self._totals["filtered"] += 1
            return
        now = self._clock()
        key = (event, node)
        last = self._last_sent.get(key)
        if last is not None and now - last < cfg.min_interval_sec:
            self._folded[key] = self._folded.get(key, 0) + 1
            self._totals["folded"] += 1
            self._fold_text[key] = text or event
            if key not in self._fold_timers:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    return
                delay = max(0.0, last + cfg.min_interval_sec - now)
                self._fold_timers[key] = loop.call_later(delay, self._trailing, key)
            return
        timer = self._fold_timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        self._fold_text.pop(key, None)
        self._last_sent[key] = now
        folded = self._folded.pop(key, 0)
        text = text or event
        if folded:
            text = f"{text} (…and {folded} more)"
        if len(self._last_sent) > self._prune_at:
            self._prune(now, cfg.min_interval_sec)
        if len(self._group) < MAX_GROUP_LINES:
            self._group.append((event, node, text))
        else:
            self._group_overflow += 1
        self._schedule_flush()

    def _trailing(self, key: tuple[str, str | None]) -> None:
        self._fold_timers.pop(key, None)
        n = self._folded.pop(key, 0)
        text = self._fold_text.pop(key, None)
        if not n or text is None or self._closed:
            return
        self._last_sent[key] = self._clock()
        self._group.append((key[0], key[1], f"{text} (…and {n - 1} more)" if n > 1 else text))
        self._schedule_flush()

    def _prune(self, now: float, interval: float) -> None:
        # Keys past their interval fold nothing any more; folded counts are kept for the next message.
        self._last_sent = {k: t for k, t in self._last_sent.items() if now - t < interval}
        self._prune_at = max(1024, 2 * len(self._last_sent))

    def _schedule_flush(self) -> None:
        if self._flush_handle is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            return  # not inside the loop yet: start() schedules it
        if not self._started:
            # Emitting inside the running loop is as good as start(): alerts must not wait on it.
            self._started = True
            self._loop = loop
            for ch in self._channels.values():
                ch.start()
        delay = self._cfg.group_sec
        self._flush_handle = loop.call_later(delay, self._flush) if delay > 0 else loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        if not self._group:
            return
        events, self._group = self._group, []
        lines = [t for _, _, t in events]
        if self._group_overflow:
            lines.append(f"…and {self._group_overflow} more events")
            self._group_overflow = 0
        alert = Alert(events, "\n".join(lines))
        for ch in self._channels.values():
            ch.offer(alert)

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = True
        for ch in self._channels.values():
            ch.start()
        if self._group:
            self._schedule_flush()

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            if self._session_factory is not None:
                self._session = self._session_factory()
            else:
                self._session = aiohttp.ClientSession(
                    headers={"User-Agent": USER_AGENT}, cookie_jar=aiohttp.DummyCookieJar()
                )
        return self._session

    async def close(self, timeout: float = 2.0) -> None:
        """Send what is grouped or queued for up to ``timeout`` seconds, then stop every worker."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if self._started and not self._closed:
            self._flush()
        self._closed = True
        for timer in self._fold_timers.values():
            timer.cancel()
        self._fold_timers.clear()
        channels = list(self._channels.values())
        joins = [asyncio.ensure_future(ch.queue.join()) for ch in channels if ch.task is not None]
        if joins:
            _, late = await asyncio.wait(joins, timeout=timeout)
            for j in late:
                j.cancel()
        tasks = [ch.task for ch in channels if ch.task is not None] + self._retired
        in_flight = [ch for ch in channels if ch.busy]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._retired.clear()
        for ch in in_flight:
            ch._bump("dropped")
        for ch in channels:
            ch.task = None
            ch.busy = False
            n = ch.drop_pending() + (1 if ch in in_flight else 0)
            if n:
                log.warning("[notify] %s: %d alerts not sent at shutdown", ch.name, n)
        if self._session is not None and not self._session.closed:
            with contextlib.suppress(Exception):
                await self._session.close()
        self._session = None

    # -- introspection ---------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, Any]:
        """sent/failed/dropped count messages per channel; filtered/folded count emitted events."""
        return {
            **self._totals,
            "pending": sum(ch.pending for ch in self._channels.values()),
            "channels": {name: ch.snapshot() for name, ch in self._channels.items()},
        }
