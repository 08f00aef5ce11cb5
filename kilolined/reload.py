"""Config reload triggers: the file watcher, SIGHUP and POST /admin/reload all end in one place."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from watchfiles import awatch

from kilolined import systemd
from kilolined.config import ConfigError, load_config

if TYPE_CHECKING:
    from kilolined.runtime import Runtime

log = logging.getLogger("kilolined")

# A file is applied once it has been quiet this long: an editor or a script writing it in
# place, in pieces, leaves it valid-but-partial for a moment (docs/CONFIG.md, "Hot reload").
STABLE_SEC = 0.3
TICK_MS = 100  # while a change waits out its quiet period, the watcher looks at the file this often
IDLE_TICK_MS = 5000  # and this often while nothing happens (a write that an event missed)


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
            cfg, version = await asyncio.to_thread(load_config, rt.config_path)
            if version == rt.version and rt.last_error is None:
                return []
            warnings = rt.apply(cfg, version)  # a component may refuse it: ConfigError, nothing changed
        except ConfigError as e:
            rt.reload_failed(e.errors)
            return e.errors
        for w in warnings:
            log.warning("⚠ [reload] %s", w)
        log.info("✓ [reload] config %s applied (%s)", version[:12], reason)
        return []
    finally:
        systemd.ready(rt)


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

    Every relevant event, and every quiet tick whose stat differs from the last one (a write that
    landed before the watch was set up, or that an event missed), restarts the quiet period. When
    it has passed: has the sha256 of the bytes changed since the last good or last refused version?
    """
    assert rt.config_path is not None
    # watchfiles logs "N changes detected" at INFO for every batch: not the daemon's business.
    logging.getLogger("watchfiles").setLevel(logging.WARNING)
    target = Path(rt.config_path)
    dirs, relevant = watched_paths(rt.config_path)
    refused: str | None = None
    loop = asyncio.get_running_loop()
    seen: tuple[int, int, int] | None = None
    changed_at: float | None = loop.time()  # look once at start: a write may have landed already

    def concerns_config(_change: object, path: str) -> bool:
        return os.path.abspath(path) in relevant

    while not stop.is_set():
        # Two speeds: quick ticks only while a change waits out its quiet period. Ticking at
        # 100 ms all the time would wake a thread ten times a second on an idle gateway.
        quick = changed_at is not None
        # Each start watches what the path resolves to now: a ConfigMap swap removes the
        # directory the previous watch was on.
        dirs, now_relevant = watched_paths(rt.config_path)
        relevant = now_relevant | relevant
        # aclosing: a watch left by break closes its inotify handle now, not when collected.
        watch = awatch(*dirs, watch_filter=concerns_config, recursive=False, debounce=TICK_MS, step=20,
                       stop_event=stop, yield_on_timeout=True, rust_timeout=TICK_MS if quick else IDLE_TICK_MS)
        async with contextlib.aclosing(watch):
            async for changes in watch:
                now = loop.time()
                sig = _signature(target)
                if changes or sig != seen:
                    seen = sig
                    changed_at = now
                    relevant = watched_paths(rt.config_path)[1] | relevant  # a swapped symlink adds entries
                    if not quick:
                        break  # on to quick ticks (the stat check on the next tick sees what the gap missed)
                    continue
                if changed_at is None or now - changed_at < STABLE_SEC:
                    continue
                changed_at = None
                try:
                    digest = hashlib.sha256(target.read_bytes()).hexdigest()
                except OSError:
                    break  # mid-swap, or removed: keep the running config
                if digest == refused or (digest == rt.version and rt.last_error is None):
                    break  # nothing new (a file put back to the running version still clears last_error)
                try:
                    errors = await reload_from_file(rt, reason="file changed")
                except Exception:
                    log.exception("reload")
                    break
                refused = digest if errors else None
                break  # back to idle ticks
