"""sd_notify over $NOTIFY_SOCKET with a plain datagram socket (no libsystemd needed).

Unset NOTIFY_SOCKET makes every call a no-op, so the daemon behaves the same outside systemd.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kilolined.ops.runtime import Runtime


def notify(message: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr or addr[0] not in "/@":
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]  # Linux abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(message.encode())
        return True
    except OSError:
        return False


def status_line(rt: Runtime) -> str:
    now = rt.clock()
    routes = [r for n, r in rt.scheduler.routes.items() if not n.startswith("adhoc:") and not r.retired]
    nodes = [n for k, n in rt.scheduler.nodes.items() if not k.startswith("adhoc:") and not n.retired]
    up = sum(1 for n in nodes if n.available(now))
    queued = sum(len(r.waiting) for r in routes)
    return f"{len(routes)} routes, {up}/{len(nodes)} nodes up, {queued} queued"


def ready(rt: Runtime) -> None:
    notify(f"READY=1\nSTATUS={status_line(rt)}")


def reloading() -> None:
    # systemd ≥ 253 (Type=notify-reload) needs both fields in ONE datagram.
    notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


def stopping() -> None:
    notify("STOPPING=1")


def watchdog_interval() -> float | None:
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None


async def watchdog_loop(rt: Runtime) -> None:
    """WATCHDOG=1 every WATCHDOG_USEC/2, with the status line; stalls of the loop are what it catches."""
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        notify(f"WATCHDOG=1\nSTATUS={status_line(rt)}")
        await asyncio.sleep(interval)
