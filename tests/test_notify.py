"""kilolined.ops.notify: grouping, folding, filtering, per-channel delivery and rate limits (SPEC §8)."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fakes import FakeDiscord, FakeTelegram, FakeWebhookReceiver, verify_standard_webhook

from kilolined.core.config import DiscordConfig, NotifyConfig, TelegramConfig, WebhookTargetConfig
from kilolined.ops.notify import Notifier, truncate, utf16_len

TOKEN = "123456:ABC-secret-token"
SECRET = "whsec_" + base64.b64encode(b"s" * 32).decode()
FAST_RETRY = (0.05, 0.1, 0.2)


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token=TOKEN) as f:
        yield f


@pytest.fixture
async def hook() -> AsyncIterator[FakeWebhookReceiver]:
    async with FakeWebhookReceiver() as f:
        yield f


def make_cfg(
    tg: FakeTelegram | None = None,
    dc: FakeDiscord | None = None,
    hook: FakeWebhookReceiver | None = None,
    **kw: Any,
) -> NotifyConfig:
    kw.setdefault("group_sec", 0.1)
    return NotifyConfig(
        telegram=TelegramConfig(bot_token=TOKEN, chat_id="-1001234", api_base=tg.url) if tg else None,
        discord=DiscordConfig(webhook_url=dc.webhook_url) if dc else None,
        webhook=WebhookTargetConfig(url=hook.url(), secret=kw.pop("secret", SECRET)) if hook else None,
        **kw,
    )


@pytest.fixture
async def notifiers() -> AsyncIterator[list[Notifier]]:
    made: list[Notifier] = []
    yield made
    for n in made:
        await n.close(timeout=0.2)


async def started(made: list[Notifier], cfg: NotifyConfig, **kw: Any) -> Notifier:
    kw.setdefault("retry_backoff_sec", FAST_RETRY)
    n = Notifier(cfg, **kw)
    made.append(n)
    await n.start()
    return n


LINES = [
    ("node_down", "vast-8410", "✗ vast-8410 (Vast.ai #8410) down: connection reset (spot interrupted?)"),
    ("breaker_open", "vast-8410", "⚡ vast-8410 breaker OPEN after 3 failures"),
    ("failover", "vast-8410", "⚡ comfy failing over to runpod-b2 (12 queued)"),
]


async def test_events_raised_together_go_out_as_one_message_per_channel(
    tg: FakeTelegram, dc: FakeDiscord, notifiers: list[Notifier]
) -> None:
    n = await started(notifiers, make_cfg(tg, dc))
    for event, node, text in LINES:
        n.emit(event, text, node=node)
    (t,) = await tg.wait_for(1)
    (d,) = await dc.wait_for(1)
    await asyncio.sleep(0.3)  # and nothing else follows
    assert len(tg.messages) == 1 and len(dc.messages) == 1
    expected = "\n".join(text for _, _, text in LINES)
    assert t["text"] == expected and d["content"] == expected
    assert t["chat_id"] == "-1001234" and t["token"] == TOKEN
    assert t["json"]["disable_web_page_preview"] is True
    assert d["json"]["allowed_mentions"] == {"parse": []}
    assert n.stats["sent"] == 2 and n.stats["pending"] == 0


async def test_events_further_apart_than_group_sec_are_separate(tg: FakeTelegram, notifiers: list[Notifier]) -> None:
    n = await started(notifiers, make_cfg(tg, group_sec=0.1))
    n.emit("node_down", "a down", node="a")
    await tg.wait_for(1)
    n.emit("node_down", "b down", node="b")
    await tg.wait_for(2)
    assert [m["text"] for m in tg.messages] == ["a down", "b down"]


async def test_repeats_are_folded_into_the_next_message(tg: FakeTelegram, notifiers: list[Notifier]) -> None:
    now = [1000.0]
    n = await started(notifiers, make_cfg(tg, min_interval_sec=60), clock=lambda: now[0])
    n.emit("node_down", "vast-8410 down", node="vast-8410")
    await tg.wait_for(1)
    for _ in range(4):
        now[0] += 5
        n.emit("node_down", "vast-8410 down", node="vast-8410")
    n.emit("node_down", "runpod-b2 down", node="runpod-b2")  # another node is not folded
    await tg.wait_for(2)
    await asyncio.sleep(0.25)
    assert [m["text"] for m in tg.messages] == ["vast-8410 down", "runpod-b2 down"]
    assert n.stats["folded"] == 4
    now[0] += 60
    n.emit("node_down", "vast-8410 down again", node="vast-8410")
    (*_, last) = await tg.wait_for(3)
    assert last["text"] == "vast-8410 down again (…and 4 more)"
    # The count was reported once; the next one after the interval is plain again.
    now[0] += 61
    n.emit("node_down", "vast-8410 down once more", node="vast-8410")
    (*_, last) = await tg.wait_for(4)
    assert last["text"] == "vast-8410 down once more"


async def test_events_filter(tg: FakeTelegram, notifiers: list[Notifier]) -> None:
    n = await started(notifiers, make_cfg(tg, events=["node_down"]))
    n.emit("node_up", "a up", node="a")
    n.emit("breaker_closed", "a closed", node="a")
    n.emit("node_down", "a down", node="a")
    (m,) = await tg.wait_for(1)
    await asyncio.sleep(0.25)
    assert len(tg.messages) == 1 and m["text"] == "a down"
    assert n.stats["filtered"] == 2


async def test_telegram_429_waits_retry_after_and_emit_stays_non_blocking(
    tg: FakeTelegram, notifiers: list[Notifier]
) -> None:
    tg.rate_limit_next, tg.retry_after = 1, 1
    n = await started(notifiers, make_cfg(tg, group_sec=0))
    t0 = time.monotonic()
    for i in range(100):
        n.emit("node_down", f"node {i} down", node=f"n{i}")
    assert time.monotonic() - t0 < 0.1  # emit() only touches memory
    await tg.wait_for(1, timeout=5)
    elapsed = time.monotonic() - t0
    assert elapsed >= 0.8  # the fast backoff alone would retry after 0.05 s
    assert tg.requests >= 2


async def test_discord_429_honours_decimal_retry_after(dc: FakeDiscord, notifiers: list[Notifier]) -> None:
    dc.rate_limit_next, dc.retry_after = 1, 0.6
    n = await started(notifiers, make_cfg(dc=dc, group_sec=0))
    t0 = time.monotonic()
    n.emit("failover", "comfy failing over")
    (m,) = await dc.wait_for(1, timeout=5)
    assert time.monotonic() - t0 >= 0.5
    assert m["content"] == "comfy failing over"


async def test_server_errors_are_retried_with_backoff(tg: FakeTelegram, notifiers: list[Notifier]) -> None:
    tg.fail_next = 2
    n = await started(notifiers, make_cfg(tg, group_sec=0))
    n.emit("node_up", "a is back", node="a")
    (m,) = await tg.wait_for(1, timeout=5)
    assert m["text"] == "a is back" and tg.requests == 3
    assert n.stats["sent"] == 1 and n.stats["failed"] == 0


async def test_dead_telegram_does_not_delay_discord(
    tg: FakeTelegram, dc: FakeDiscord, notifiers: list[Notifier], caplog: pytest.LogCaptureFixture
) -> None:
    tg.down = True
    n = await started(notifiers, make_cfg(tg, dc), retry_backoff_sec=(0.1, 0.1, 0.1))
    with caplog.at_level(logging.DEBUG, logger="kilolined.ops.notify"):
        n.emit("node_down", "vast-8410 down", node="vast-8410")
        await dc.wait_for(1, timeout=2)
        n.emit("node_down", "runpod-b2 down", node="runpod-b2")
        await dc.wait_for(2, timeout=2)
        await asyncio.sleep(0.6)  # let Telegram's retries run out
    assert tg.messages == []
    assert tg.requests >= 2
    s = n.stats
    assert s["channels"]["discord"]["sent"] == 2
    assert s["channels"]["telegram"]["failed"] >= 1
    # Neither the bot token nor the Discord webhook token reaches a log line.
    assert "ABC-secret-token" not in caplog.text and "/api/webhooks/123/tok" not in caplog.text
    assert "telegram" in caplog.text


async def test_discord_404_stops_using_the_webhook(dc: FakeDiscord, notifiers: list[Notifier]) -> None:
    dc.gone = True
    n = await started(notifiers, make_cfg(dc=dc, group_sec=0))
    n.emit("node_down", "a down", node="a")
    await asyncio.sleep(0.3)
    n.emit("node_down", "b down", node="b")
    await asyncio.sleep(0.3)
    assert dc.requests == 1
    assert n.stats["channels"]["discord"]["disabled"] is True
    # A new webhook URL in the config revives the channel.
    dc.gone = False
    n.configure(
        make_cfg(dc=dc, group_sec=0, min_interval_sec=30).model_copy(
            update={"discord": DiscordConfig(webhook_url=dc.webhook_url + "?x=1")}
        )
    )
    n.emit("node_down", "c down", node="c")
    (m,) = await dc.wait_for(1)
    assert m["content"] == "c down"


async def test_generic_webhook_is_signed(hook: FakeWebhookReceiver, notifiers: list[Notifier]) -> None:
    n = await started(notifiers, make_cfg(hook=hook))
    n.emit("node_down", "vast-8410 down", node="vast-8410")
    n.emit("route_down", "comfy has no node", node=None)
    (d,) = await hook.wait_for(1)
    assert verify_standard_webhook(SECRET, d["headers"], d["body"])
    body = d["json"]
    assert body["type"] == "kiloline.alert"
    assert body["timestamp"].endswith("Z")
    assert body["events"] == [
        {"event": "node_down", "node": "vast-8410", "text": "vast-8410 down"},
        {"event": "route_down", "node": None, "text": "comfy has no node"},
    ]
    assert body["text"] == "vast-8410 down\ncomfy has no node"


async def test_generic_webhook_retries_with_the_same_id(hook: FakeWebhookReceiver, notifiers: list[Notifier]) -> None:
    hook.fail_next = 1
    n = await started(notifiers, make_cfg(hook=hook, group_sec=0))
    n.emit("reload_failed", "config reload failed: routes.comfy.nodes.0: unknown node")
    await hook.wait_for(1)
    first, second = hook.attempts
    assert first["headers"]["webhook-id"] == second["headers"]["webhook-id"]
    assert first["body"] == second["body"]
    assert verify_standard_webhook(SECRET, second["headers"], second["body"])


async def test_generic_webhook_without_secret_is_unsigned(hook: FakeWebhookReceiver, notifiers: list[Notifier]) -> None:
    n = await started(notifiers, make_cfg(hook=hook, secret=None, group_sec=0))
    n.emit("node_up", "a up", node="a")
    (d,) = await hook.wait_for(1)
    assert "webhook-signature" not in d["headers"] and "webhook-id" in d["headers"]


async def test_long_text_is_truncated_per_channel(tg: FakeTelegram, dc: FakeDiscord, notifiers: list[Notifier]) -> None:
    n = await started(notifiers, make_cfg(tg, dc, group_sec=0))
    n.emit("reload_failed", "😀" * 5000)  # astral characters: two UTF-16 units each
    (t,) = await tg.wait_for(1)
    (d,) = await dc.wait_for(1)
    assert 4000 < utf16_len(t["text"]) <= 4096 and t["text"].endswith("…")
    assert 1900 < utf16_len(d["content"]) <= 2000


def test_truncate_prefers_line_boundaries() -> None:
    text = "\n".join(f"line {i:03d} " + "x" * 20 for i in range(200))
    out = truncate(text, 2000)
    assert utf16_len(out) <= 2000
    assert out.endswith("\n…")
    assert all(line.startswith("line ") for line in out.split("\n")[:-1])
    assert truncate("short", 10) == "short"


async def test_hot_reload_switches_chat_and_removes_channels(
    tg: FakeTelegram, dc: FakeDiscord, notifiers: list[Notifier]
) -> None:
    n = await started(notifiers, make_cfg(tg, dc, group_sec=0))
    n.emit("node_down", "first", node="a")
    await tg.wait_for(1)
    await dc.wait_for(1)
    cfg = make_cfg(tg, group_sec=0)
    cfg = cfg.model_copy(update={"telegram": cfg.telegram.model_copy(update={"chat_id": 42})})  # type: ignore[union-attr]
    n.configure(cfg)
    n.emit("node_down", "second", node="b")
    (_, m) = await tg.wait_for(2)
    await asyncio.sleep(0.2)
    assert m["chat_id"] == 42 and m["text"] == "second"
    assert len(dc.messages) == 1
    assert "discord" not in n.stats["channels"]


async def test_outbox_is_bounded(tg: FakeTelegram, notifiers: list[Notifier]) -> None:
    tg.down = True
    n = await started(notifiers, make_cfg(tg, group_sec=0), max_outbox=3, retry_backoff_sec=(5,))
    for i in range(10):
        n.emit("node_down", f"{i}", node=str(i))
        await asyncio.sleep(0)  # let each group flush on its own
    await asyncio.sleep(0.1)
    s = n.stats
    assert s["pending"] <= 4  # three queued, one being retried
    assert s["dropped"] >= 6


async def test_emit_never_raises_and_close_is_quick(tg: FakeTelegram) -> None:
    tg.down = True
    n = Notifier(make_cfg(tg, group_sec=0.05), retry_backoff_sec=(10,))
    n.emit("node_down", "before start", node="a")  # no loop work yet: kept for start()
    await n.start()
    n.emit("not_an_event", "ignored")
    n.emit("node_down", None, node="b")  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    await n.close(timeout=0.2)
    assert time.monotonic() - t0 < 1.0
    n.emit("node_down", "after close", node="c")
    assert n.stats["pending"] == 0


async def test_close_sends_what_is_still_grouped(tg: FakeTelegram) -> None:
    n = Notifier(make_cfg(tg, group_sec=30), retry_backoff_sec=FAST_RETRY)
    await n.start()
    n.emit("failover", "comfy failing over to runpod-b2")
    await n.close(timeout=2)
    assert [m["text"] for m in tg.messages] == ["comfy failing over to runpod-b2"]


async def test_no_channels_is_fine() -> None:
    n = Notifier(NotifyConfig())
    await n.start()
    n.emit("node_down", "nobody listens", node="a")
    await n.close()
    assert n.stats["sent"] == 0


async def test_a_folded_repeat_still_goes_out_when_its_interval_ends(
    tg: FakeTelegram, notifiers: list[Notifier]
) -> None:
    # down, up, down within min_interval: the operator's last message must not be "up".
    n = await started(notifiers, make_cfg(tg, min_interval_sec=0.6, group_sec=0.05))
    n.emit("node_down", "a down", node="a")
    await tg.wait_for(1)
    n.emit("node_up", "a up", node="a")
    await tg.wait_for(2)
    n.emit("node_down", "a down again", node="a")
    n.emit("node_down", "a down, third time", node="a")
    (*_, last) = await tg.wait_for(3, timeout=5)
    assert last["text"] == "a down, third time (…and 1 more)"
    assert n.stats["folded"] == 2
