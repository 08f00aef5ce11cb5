"""kilolined.ops.webhooks: Standard Webhooks signing, delivery with retries, the SSRF guard."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import socket
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from fakes import FakeWebhookReceiver, verify_standard_webhook

from kilolined.ops import webhooks
from kilolined.ops.webhooks import (
    WebhookDeliverer,
    check_callback_url,
    new_msg_id,
    parse_retry_after,
    sign,
    signed_headers,
)

KEY = bytes(range(32))
SECRET = "whsec_" + base64.b64encode(KEY).decode()
FAST = [0.05, 0.05, 0.05, 0.05]


@pytest.fixture
async def receiver() -> AsyncIterator[FakeWebhookReceiver]:
    async with FakeWebhookReceiver() as r:
        yield r


@pytest.fixture
async def deliverer() -> AsyncIterator[WebhookDeliverer]:
    d = WebhookDeliverer(secret=SECRET, backoff_sec=FAST, timeout_sec=2)
    yield d
    await d.close(timeout=0.5)


# ---------------------------------------------------------------------------------------------
# Signing


def test_sign_matches_a_hand_computed_hmac() -> None:
    body = b'{"type":"job.completed","job_id":"j1"}'
    expected = base64.b64encode(hmac.new(KEY, b"msg_abc.1700000000." + body, hashlib.sha256).digest())
    assert sign(SECRET, "msg_abc", 1700000000, body) == "v1," + expected.decode()


def test_sign_reproduces_the_published_standard_webhooks_vector() -> None:
    sig = sign(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}'
    )
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def test_sign_accepts_an_unpadded_secret() -> None:
    unpadded = "whsec_" + base64.b64encode(b"k" * 31).decode().rstrip("=")
    expected = base64.b64encode(hmac.new(b"k" * 31, b"m.1.x", hashlib.sha256).digest()).decode()
    assert sign(unpadded, "m", 1, b"x") == "v1," + expected


def test_new_msg_id_is_unique_and_dot_free() -> None:
    ids = {new_msg_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(i.startswith("msg_") and "." not in i and len(i) >= 20 for i in ids)


def test_signed_headers() -> None:
    body = b"{}"
    h = signed_headers(SECRET, "msg_1", body, now=1700000000.9)
    assert h["webhook-id"] == "msg_1"
    assert h["webhook-timestamp"] == "1700000000"
    assert h["content-type"] == "application/json"
    assert h["webhook-signature"] == sign(SECRET, "msg_1", 1700000000, body)
    unsigned = signed_headers(None, "msg_1", body)
    assert "webhook-signature" not in unsigned
    assert abs(int(unsigned["webhook-timestamp"]) - time.time()) < 5


def test_verifier_in_fakes_rejects_tampering() -> None:
    # The test helper must be able to say no, or the delivery tests prove nothing.
    body = b'{"a":1}'
    h = signed_headers(SECRET, "msg_1", body)
    assert verify_standard_webhook(SECRET, h, body)
    assert not verify_standard_webhook(SECRET, h, body + b" ")
    assert not verify_standard_webhook("whsec_" + base64.b64encode(b"x" * 32).decode(), h, body)
    old = signed_headers(SECRET, "msg_1", body, now=time.time() - 3600)
    assert not verify_standard_webhook(SECRET, old, body)


def test_parse_retry_after() -> None:
    assert parse_retry_after(None) is None
    assert parse_retry_after("") is None
    assert parse_retry_after("3") == 3
    assert parse_retry_after("1.5") == 1.5
    assert parse_retry_after("-4") == 0
    assert parse_retry_after("soon") is None
    future = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 120))
    assert 100 < parse_retry_after(future) <= 121  # type: ignore[operator]


# ---------------------------------------------------------------------------------------------
# Delivery


async def test_delivery_is_signed_and_verifiable(receiver: FakeWebhookReceiver, deliverer: WebhookDeliverer) -> None:
    payload = {"type": "job.completed", "job_id": "j1", "result": {"ü": [1, 2]}}
    msg_id = deliverer.submit(receiver.url(), payload)
    (d,) = await receiver.wait_for(1)
    assert d["headers"]["webhook-id"] == msg_id
    assert d["headers"]["content-type"] == "application/json"
    assert verify_standard_webhook(SECRET, d["headers"], d["body"])
    assert d["json"] == payload
    assert d["body"] == orjson.dumps(payload)


async def test_submit_returns_at_once_and_keeps_a_given_id(
    receiver: FakeWebhookReceiver, deliverer: WebhookDeliverer
) -> None:
    receiver.delay_next, receiver.delay_sec = 1, 0.5
    t0 = time.monotonic()
    msg_id = deliverer.submit(receiver.url(), {"x": 1}, msg_id="msg_fixed")
    assert time.monotonic() - t0 < 0.1
    assert msg_id == "msg_fixed"
    (d,) = await receiver.wait_for(1)
    assert d["headers"]["webhook-id"] == "msg_fixed"


async def test_three_failures_then_success(receiver: FakeWebhookReceiver, deliverer: WebhookDeliverer) -> None:
    receiver.fail_next = 3
    msg_id = deliverer.submit(receiver.url(), {"n": 1})
    await receiver.wait_for(1)
    await asyncio.sleep(0.2)  # nothing more should arrive
    assert len(receiver.deliveries) == 1
    assert [a["status"] for a in receiver.attempts] == [500, 500, 500, 200]
    assert {a["headers"]["webhook-id"] for a in receiver.attempts} == {msg_id}
    # Each attempt carries its own timestamp and a signature valid for it.
    assert all(verify_standard_webhook(SECRET, a["headers"], a["body"]) for a in receiver.attempts)
    recs = [a for a in deliverer.attempts if a.msg_id == msg_id]
    assert [(a.attempt_no, a.status) for a in recs] == [(1, 500), (2, 500), (3, 500), (4, 200)]
    assert [a.next_wait for a in recs] == [0.05, 0.05, 0.05, None]
    assert all(a.url_host == "127.0.0.1" for a in recs)


async def test_gives_up_after_len_backoff_plus_one(receiver: FakeWebhookReceiver) -> None:
    receiver.status = 500
    d = WebhookDeliverer(secret=None, backoff_sec=[0.01, 0.01], timeout_sec=2)
    try:
        assert await d.deliver(receiver.url(), {"n": 1}) is False
        assert len(receiver.attempts) == 3
        assert "webhook-signature" not in receiver.attempts[0]["headers"]
    finally:
        await d.close()


async def test_retry_after_is_honoured(receiver: FakeWebhookReceiver, deliverer: WebhookDeliverer) -> None:
    receiver.fail_next, receiver.fail_status, receiver.retry_after = 1, 503, "1"
    deliverer.submit(receiver.url(), {"n": 1})
    await receiver.wait_for(1, timeout=5)
    first, second = receiver.attempts
    assert second["at"] - first["at"] >= 0.8  # the backoff alone would be 0.05 s


async def test_410_gone_stops(receiver: FakeWebhookReceiver, deliverer: WebhookDeliverer) -> None:
    receiver.status = 410
    assert await deliverer.deliver(receiver.url(), {"n": 1}) is False
    await asyncio.sleep(0.2)
    assert len(receiver.attempts) == 1


async def test_redirect_is_a_failure_and_not_followed(
    receiver: FakeWebhookReceiver, deliverer: WebhookDeliverer
) -> None:
    receiver.fail_next, receiver.fail_status = 1, 307
    assert await deliverer.deliver(receiver.url(), {"n": 1}) is True
    assert [a["path"] for a in receiver.attempts] == ["/hook", "/hook"]


async def test_timeout_is_retried(receiver: FakeWebhookReceiver) -> None:
    receiver.delay_next, receiver.delay_sec = 1, 1.0
    d = WebhookDeliverer(secret=SECRET, backoff_sec=FAST, timeout_sec=0.2)
    try:
        assert await d.deliver(receiver.url(), {"n": 1}) is True
        assert d.attempts[0].error == "timeout"
        assert len({a["headers"]["webhook-id"] for a in receiver.attempts}) == 1
    finally:
        await d.close()


async def test_connection_refused_is_retried_and_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    d = WebhookDeliverer(secret=SECRET, backoff_sec=[0.01], timeout_sec=1)
    url = f"http://127.0.0.1:{port}/hook?token=SECRET-TOKEN"
    with caplog.at_level(logging.INFO, logger="kilolined.ops.webhooks"):
        assert await d.deliver(url, {"n": 1}) is False
    await d.close()
    assert [a.attempt_no for a in d.attempts] == [1, 2]
    assert all(a.status is None and a.error for a in d.attempts)
    # Host only in logs: never the path, query or body.
    assert "SECRET-TOKEN" not in caplog.text and "/hook" not in caplog.text
    assert "127.0.0.1" in caplog.text


async def test_configure_applies_to_the_next_attempt(receiver: FakeWebhookReceiver) -> None:
    d = WebhookDeliverer(secret=SECRET, backoff_sec=[0.3], timeout_sec=2)
    new_secret = "whsec_" + base64.b64encode(b"n" * 32).decode()
    receiver.fail_next = 1
    try:
        d.submit(receiver.url(), {"n": 1})
        await receiver.wait_for_attempts(1)
        d.configure(secret=new_secret, backoff_sec=[0.01], timeout_sec=2)
        (delivery,) = await receiver.wait_for(1)
        assert verify_standard_webhook(new_secret, delivery["headers"], delivery["body"])
        assert not verify_standard_webhook(SECRET, delivery["headers"], delivery["body"])
    finally:
        await d.close()


async def test_close_drops_pending_retries_promptly(receiver: FakeWebhookReceiver) -> None:
    receiver.status = 500
    d = WebhookDeliverer(secret=SECRET, backoff_sec=[30, 30], timeout_sec=2)
    d.submit(receiver.url(), {"n": 1})
    await receiver.wait_for_attempts(1)
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    await d.close(timeout=1)
    assert time.monotonic() - t0 < 0.5
    assert d.pending == 0
    assert len(receiver.attempts) == 1


async def test_close_cancels_a_stuck_attempt_after_the_timeout(receiver: FakeWebhookReceiver) -> None:
    receiver.delay_next, receiver.delay_sec = 1, 5
    d = WebhookDeliverer(secret=SECRET, backoff_sec=[1], timeout_sec=10)
    d.submit(receiver.url(), {"n": 1})
    await receiver.wait_for_attempts(1)
    t0 = time.monotonic()
    await d.close(timeout=0.2)
    assert time.monotonic() - t0 < 1.5
    assert d.pending == 0


async def test_submit_with_a_bad_payload_does_not_raise(
    receiver: FakeWebhookReceiver, deliverer: WebhookDeliverer
) -> None:
    msg_id = deliverer.submit(receiver.url(), {"x": object()})
    assert msg_id.startswith("msg_")
    await asyncio.sleep(0.1)
    assert receiver.attempts == []


async def test_a_bad_secret_is_logged_not_raised(receiver: FakeWebhookReceiver) -> None:
    d = WebhookDeliverer(secret="whsec_!!!", backoff_sec=[], timeout_sec=1)
    try:
        assert await d.deliver(receiver.url(), {"n": 1}) is False
        assert receiver.attempts == []
        assert "secret" in (d.attempts[0].error or "")
    finally:
        await d.close()


async def test_connect_time_guard_refuses_private_literals(receiver: FakeWebhookReceiver) -> None:
    d = WebhookDeliverer(secret=SECRET, backoff_sec=[], timeout_sec=1, allow_private=False)
    try:
        assert await d.deliver(receiver.url(), {"n": 1}) is False
        assert receiver.attempts == []
        assert "loopback" in (d.attempts[0].error or "")
    finally:
        await d.close()


async def test_connect_time_guard_refuses_names_resolving_private(receiver: FakeWebhookReceiver) -> None:
    d = WebhookDeliverer(secret=SECRET, backoff_sec=[], timeout_sec=1, allow_private=False)
    try:
        assert await d.deliver(f"http://localhost:{receiver.port}/hook", {"n": 1}) is False
        assert receiver.attempts == []
    finally:
        await d.close()


# ---------------------------------------------------------------------------------------------
# SSRF guard

REFUSED = [
    "http://127.0.0.1/hook",
    "http://127.1/hook",
    "http://localhost:8080/hook",
    "http://10.0.0.1/",
    "http://172.16.5.4/",
    "http://192.168.1.1/",
    "http://169.254.169.254/latest/meta-data/",
    "http://100.100.100.200/",
    "http://[fd00:ec2::254]/",
    "http://[::1]/",
    "http://[fe80::1]/",
    "http://[fc00::1]/",
    "http://100.64.0.1/",
    "http://[::ffff:127.0.0.1]/",
    "http://[::ffff:169.254.169.254]/",
    "http://[2002:7f00:1::1]/",
    "http://0.0.0.0/",
    "http://[::]/",
    "http://224.0.0.1/",
    "http://240.0.0.1/",
]


@pytest.mark.parametrize("url", REFUSED)
async def test_private_targets_are_refused(url: str) -> None:
    reason = await check_callback_url(url, allow_private=False)
    assert reason is not None and reason


@pytest.mark.parametrize("url", REFUSED)
async def test_private_targets_allowed_when_configured(url: str) -> None:
    assert await check_callback_url(url, allow_private=True) is None


async def test_metadata_reason_is_specific() -> None:
    reason = await check_callback_url("http://169.254.169.254/", allow_private=False)
    assert reason is not None and "metadata" in reason


async def test_public_literals_pass_without_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_dns(*a: object, **k: object) -> None:
        raise AssertionError("an IP literal must not be resolved")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", no_dns)
    assert await check_callback_url("https://93.184.215.14/hook?x=1", allow_private=False) is None
    assert await check_callback_url("http://[2606:4700:4700::1111]:8443/", allow_private=False) is None


@pytest.mark.parametrize(
    "url", ["ftp://93.184.215.14/x", "file:///etc/passwd", "javascript:alert(1)", "http:///nohost", "nonsense"]
)
async def test_only_http_urls_with_a_host(url: str) -> None:
    assert await check_callback_url(url, allow_private=False) is not None
    assert await check_callback_url(url, allow_private=True) is not None


async def test_bad_port_is_refused() -> None:
    assert await check_callback_url("http://93.184.215.14:99999/", allow_private=False) is not None


async def test_any_private_answer_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_getaddrinfo(host: str, port: int, **kw: object) -> list[tuple[object, ...]]:
        assert host == "mixed.example"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.215.14", port)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port)),
        ]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
    reason = await check_callback_url("https://mixed.example/hook", allow_private=False)
    assert reason is not None and "10.1.2.3" in reason


async def test_public_name_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fake_getaddrinfo(host: str, port: int, **kw: object) -> list[tuple[object, ...]]:
        assert port == 443
        return [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("2606:2800:21f:cb07:6820:80da:af6b:8b2c", port, 0, 0))]

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fake_getaddrinfo)
    assert await check_callback_url("https://app.example.com/hook", allow_private=False) is None


async def test_unresolvable_host_gives_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    async def fail(*a: object, **k: object) -> None:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(asyncio.get_running_loop(), "getaddrinfo", fail)
    reason = await check_callback_url("https://nowhere.invalid/hook", allow_private=False)
    assert reason is not None and "resolve" in reason


def test_address_problem_names_the_category() -> None:
    import ipaddress

    cases = {
        "127.0.0.1": "loopback",
        "10.0.0.1": "private",
        "100.64.0.1": "CGNAT",
        "169.254.1.1": "link-local",
        "169.254.169.254": "metadata",
        "::ffff:10.0.0.1": "private",
        "64:ff9b::a00:1": "private",  # NAT64 of 10.0.0.1
        "93.184.215.14": None,
        "64:ff9b::5db8:d70e": None,  # NAT64 of a public address
    }
    for addr, want in cases.items():
        got = webhooks.address_problem(ipaddress.ip_address(addr))
        if want is None:
            assert got is None, addr
        else:
            assert got is not None and want in got, (addr, got)
