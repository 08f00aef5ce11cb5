"""Config reload triggers: the file watcher, SIGHUP and POST /admin/reload all end in one place."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from pathlib import Path

from watchfiles import awatch

from kilolined.core.config import Config, ConfigError, load_config
from kilolined.ops import systemd
from kilolined.ops.runtime import Runtime, describe_changes

log = logging.getLogger("kilolined")

# A file is applied once it has been quiet this long: an editor or a script writing it in
# place, in pieces, leaves it valid-but-partial for a moment (docs/CONFIG.md, "Hot reload").
STABLE_SEC = 0.3
TICK_MS = 100  # the longest the watcher groups the file's events before it passes them on
IDLE_TICK_MS = 5000  # while nothing happens, a stat this often (a write that an event missed)
STUCK_WARN_SEC = 10  # a file that has not been quiet this long is logged (something keeps writing it)


async def reload_from_file(rt: Runtime, reason: str) -> list[str]:
    """Validate the whole file, then apply it atomically; returns the errors (empty = applied).

    Parsing and validation run in a thread: a large (or hostile) file must not stop the event
    loop, which keeps serving on the running config meanwhile.
    """
    if rt.config_path is None:
        return ["(file): the gateway was started without a config file"]
    systemd.reloading()
    try:
        try:
            cfg, version = await asyncio.to_thread(_load, rt.config_path)
            if version == rt.version and rt.last_error is None:
                return []
            warnings = rt.apply(cfg, version)  # a component may refuse it: ConfigError, nothing changed
        except ConfigError as e:
            rt.reload_failed(e.errors)
            return e.errors
        for w in warnings:
            log.warning("⚠ [reload] %s", w)
        log.info("✓ [reload] config %s applied (%s): %s", version[:12], reason, describe_changes(rt.last_changes))
        return []
    finally:
        systemd.ready(rt)


def _load(path: str) -> tuple[Config, str]:
    """load_config, where any failure is a refused reload: a file the loader chokes on must not
    answer 500 or kill the SIGHUP task. load_config reports every known failure itself; anything
    else is a bug, logged with its traceback, and still a config error to the operator."""
    try:
        return load_config(path)
    except ConfigError:
        raise
    except Exception as e:
        log.exception("✗ [reload] loading %s failed", path)
        raise ConfigError([f"{path}: cannot load: {type(e).__name__}: {e}"]) from None


def watched_paths(config_path: str) -> tuple[set[str], set[str]]:
    """(directories to watch, paths in them whose change concerns the config).

    The directory entry, not the inode: editors save by rename, which a watch on the file misses
    (watchfiles #127). A symlink is followed hop by hop, and every entry on the way counts — a
    ConfigMap's ``kiloline.yaml -> ..data/kiloline.yaml`` changes when ``..data`` is swapped.
    Nothing else in those directories (a log written next to the config) is relevant.
    """
    relevant: set[str] = set()
    p = os.path.abspath(config_path)
    for _ in range(40):  # as the kernel's own symlink-hop limit
        relevant.add(p)
        if not os.path.islink(p):
            break
        target = os.path.join(os.path.dirname(p), os.readlink(p))
        head = os.path.dirname(p)
        for part in Path(os.path.relpath(target, head)).parts[:-1]:  # directories on the way
            head = os.path.normpath(os.path.join(head, part))
            relevant.add(head)
        p = os.path.normpath(target)
    relevant.add(os.path.realpath(config_path))
    dirs = {os.path.dirname(r) for r in relevant if os.path.isdir(os.path.dirname(r))}
    return dirs, relevant


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


async def watch_config(rt: Runtime, stop: asyncio.Event) -> None:
    """Reload when the config file's bytes change and have then stayed the same STABLE_SEC.

    Two tasks: one turns the file's filesystem events into pokes, the other keeps the quiet-period
    clock. The clock is a plain deadline on the event loop, never an event: in a busy directory (a
    log or an editor's swap file written beside the config) the watcher sees events all the time,
    and a clock that needed a pause between them would never reach its deadline.
    """
    assert rt.config_path is not None
    # watchfiles logs "N changes detected" at INFO for every batch: not the daemon's business.
    logging.getLogger("watchfiles").setLevel(logging.WARNING)
    poke = Poke()
    halt = asyncio.Event()  # ends the event watch (its thread checks it every step)
    events = asyncio.create_task(_watch_events(rt.config_path, poke, halt), name="kiloline-config-events")
    try:
        await _quiet_clock(rt, Path(rt.config_path), poke, stop)
    finally:
        halt.set()
        events.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await events


async def _watch_events(config_path: str, poke: Poke, halt: asyncio.Event) -> None:
    """Set ``poke`` on every event that concerns the config (not on its neighbours' events)."""
    relevant: set[str] = set()

    def concerns_config(_change: object, path: str) -> bool:
        return os.path.abspath(path) in relevant

    while not halt.is_set():
        # Each start watches what the path resolves to now: a ConfigMap swap removes the
        # directory the previous watch was on.
        dirs, relevant = watched_paths(config_path)  # entries of earlier targets are not watched any more
        if not dirs:  # the config's directory itself is gone: the clock's stat sees it come back
            await asyncio.sleep(IDLE_TICK_MS / 1000)
            continue
        # yield_on_timeout: an idle gateway looks at where the symlinks lead every IDLE_TICK_MS.
        watch = awatch(*dirs, watch_filter=concerns_config, recursive=False, debounce=TICK_MS, step=20,
                       stop_event=halt, yield_on_timeout=True, rust_timeout=IDLE_TICK_MS)
        try:
            # aclosing: a watch left by break closes its inotify handle now, not when collected.
            async with contextlib.aclosing(watch):
                async for changes in watch:
                    if changes:
                        poke.set()
                    new_dirs, new_relevant = watched_paths(config_path)
                    relevant |= new_relevant  # a swapped symlink adds entries
                    if new_dirs != dirs:
                        break  # the path leads elsewhere now: watch there
        except OSError as e:  # a directory removed between the look and the watch: look again
            log.debug("config watch: %s", e)
            await asyncio.sleep(TICK_MS / 1000)


class Poke:
    """The watcher's "something happened" flag, waited on with a deadline by the quiet clock.

    A timer wakes an idle wait, not ``asyncio.timeout``: that one throws a cancellation into the
    waiting coroutine at every idle tick (two exceptions and their tracebacks each time)."""

    __slots__ = ("flag", "waiter")

    def __init__(self) -> None:
        self.flag = False
        self.waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self.flag = True
        _wake(self.waiter)

    async def wait(self, timeout: float) -> bool:
        """Whether it was set within ``timeout`` seconds (and clear it)."""
        if not self.flag:
            loop = asyncio.get_running_loop()
            waiter = self.waiter = loop.create_future()
            timer = loop.call_later(max(0.0, timeout), _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self.waiter = None
        was, self.flag = self.flag, False
        return was


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


async def _quiet_clock(rt: Runtime, target: Path, poke: Poke, stop: asyncio.Event) -> None:
    """Apply the file once it has been quiet STABLE_SEC: every poke, and every look whose stat
    differs from the last one (a write that landed before the watch was set up, or that an event
    missed), restarts the quiet period. Idle, it wakes every IDLE_TICK_MS for one stat."""
    loop = asyncio.get_running_loop()
    seen = _signature(target)
    quiet_since: float | None = loop.time()  # look once at start: a write may have landed already
    changing_since: float | None = None  # the first change not yet settled
    refused: str | None = None
    while not stop.is_set():
        wait = IDLE_TICK_MS / 1000 if quiet_since is None else quiet_since + STABLE_SEC - loop.time()
        poked = await poke.wait(wait)
        sig = _signature(target)
        now = loop.time()
        if poked or sig != seen:
            seen = sig
            quiet_since = now
            rt.config_changed()
            if changing_since is None:
                changing_since = now
            elif now - changing_since > STUCK_WARN_SEC:
                log.warning("⚠ [reload] %s has kept changing for %.0f s: it is applied once it is quiet for %g s",
                            rt.config_path, now - changing_since, STABLE_SEC)
                changing_since = now  # once per STUCK_WARN_SEC, not on every write
            continue
        if quiet_since is None or now - quiet_since < STABLE_SEC:
            continue
        quiet_since = changing_since = None
        refused = await _settle(rt, target, refused)


def _fingerprint(target: Path) -> str:
    """sha256 of the bytes, or the reason they cannot be read (so one failure is reported once)."""
    try:
        return hashlib.sha256(target.read_bytes()).hexdigest()
    except OSError as e:
        return f"unreadable: {e.errno}"


async def _settle(rt: Runtime, target: Path, refused: str | None) -> str | None:
    """The file has been quiet: reload it unless its bytes are the running or the last refused
    version. Returns what is refused now (None: nothing)."""
    seen = _fingerprint(target)
    if seen == refused or (seen == rt.version and rt.last_error is None):
        rt.config_settled()  # nothing new (a file put back to the running version still clears last_error)
        return refused
    try:
        errors = await reload_from_file(rt, reason="file changed")
    except Exception:
        log.exception("reload")
        rt.config_settled()
        return refused
    return seen if errors else None
