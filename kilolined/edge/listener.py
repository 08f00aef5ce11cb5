"""Accepting client connections, at most ``server.max_connections`` at once (docs/SECURITY.md).

At the limit the gateway stops accepting instead of accepting and closing: new connections
wait in the kernel's backlog (the SYN is answered, nothing is read) and are taken as soon as
one closes — so ``/healthz`` and admitted work keep being served on a busy box and the
process never runs out of file descriptors (HAProxy's ``maxconn`` works the same way).

asyncio has no "pause accepting" call: a server closed with ``Server.close()`` closes its
socket. So each listening socket is owned here and every asyncio server gets a ``dup()`` of
it: closing that server stops the accepting and leaves the socket (and its backlog) open, and
a new server on a new dup resumes.
"""

from __future__ import annotations

import asyncio
import resource
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

# File descriptors kept for everything but client connections: sockets to the nodes (one per
# request in flight, plus idle keep-alive ones), health checks, Redis, webhooks and notifiers,
# the listening sockets, log and state files. A quarter of a small limit.
FD_RESERVE = 512


@dataclass(frozen=True, slots=True)
class FdPlan:
    """What the open-files limit (RLIMIT_NOFILE) allows: the soft limit to run with and the
    client connections that fit in it beside the reserve."""

    old_soft: int
    soft: int
    hard: int
    max_connections: int  # server.max_connections, or fewer when the hard limit is too low
    wanted: int  # server.max_connections as configured

    @property
    def raised(self) -> bool:
        return self.soft > self.old_soft

    @property
    def clamped(self) -> bool:
        return self.max_connections < self.wanted


def fd_plan(wanted: int, soft: int, hard: int) -> FdPlan:
    """Pure: the soft limit rises toward the hard one as far as ``wanted`` connections and the
    reserve need (HAProxy raises its ``ulimit-n`` for ``maxconn`` the same way); what still does
    not fit is taken off the connections, never off the reserve."""
    need = wanted + FD_RESERVE
    new_soft = soft
    if need > soft:
        new_soft = need if hard == resource.RLIM_INFINITY or hard >= need else hard
    usable = new_soft - min(FD_RESERVE, new_soft // 4)
    return FdPlan(soft, new_soft, hard, max(1, min(wanted, usable)), wanted)


def raise_fd_limit(wanted: int) -> FdPlan:
    """Apply ``fd_plan`` to this process; a refused raise (a container's seccomp, say) plans again
    with the limit as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    plan = fd_plan(wanted, soft, hard)
    if plan.raised:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (plan.soft, hard))
        except (ValueError, OSError):
            plan = fd_plan(wanted, soft, soft)
    return plan


class ConnectionGate:
    """Counts open client connections against a limit; calls ``pause`` on reaching it and
    ``resume`` when the count falls below it again. Pure bookkeeping."""

    def __init__(self, limit: Callable[[], int], pause: Callable[[], None], resume: Callable[[], None]):
        self.limit = limit  # read at each change: a reload's new value applies at once
        self.count = 0
        self.paused = False
        self._pause = pause
        self._resume = resume

    def opened(self) -> None:
        self.count += 1
        if not self.paused and self.count >= self.limit():
            self.paused = True
            self._pause()

    def closed(self) -> None:
        self.count -= 1
        if self.paused and self.count < self.limit():
            self.paused = False
            self._resume()


def listen_sockets(host: str, port: int, backlog: int) -> list[socket.socket]:
    """Bound, listening sockets for ``host:port``, one per address it resolves to (as asyncio's
    ``create_server`` does; IPv6 sockets are IPv6-only, as there)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, type_, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            s = socket.socket(family, type_, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(backlog)
            s.setblocking(False)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


class Listener:
    """One listening socket whose accepting can be paused and resumed."""

    def __init__(self, sock: socket.socket, factory: Callable[[], asyncio.Protocol], ssl_context: ssl.SSLContext | None,
                 backlog: int):
        self.sock = sock
        self._factory = factory
        self._ssl = ssl_context
        self._backlog = backlog
        self._server: asyncio.Server | None = None
        self._want = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def serving(self) -> bool:
        return self._server is not None

    async def start(self) -> None:
        self._want = True
        await self._reconcile()

    def pause(self) -> None:
        self._want = False
        if self._task is None and self._server is not None:
            self._server.close()  # at once: the connection over the limit must not be accepted
            self._server = None

    def resume(self) -> None:
        self._want = True
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._reconcile())

    async def _reconcile(self) -> None:
        try:
            while not self._closed and (self._server is not None) != self._want:
                if self._want:
                    self._server = await asyncio.get_running_loop().create_server(
                        self._factory, sock=self.sock.dup(), ssl=self._ssl, backlog=self._backlog)
                else:
                    if self._server is not None:  # always: the loop's condition
                        self._server.close()
                    self._server = None
        finally:
            self._task = None

    def close(self) -> None:
        """Stop for good: the listening socket itself is closed (its backlog is refused)."""
        self._closed = True
        self._want = False
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            self._server.close()
            self._server = None
        self.sock.close()
