"""Config reload triggers: the file watcher, SIGHUP and POST /admin/reload all end in one place."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kilolined.config import ConfigError, load_config

if TYPE_CHECKING:
    from kilolined.runtime import Runtime

log = logging.getLogger("kilolined")


async def reload_from_file(rt: Runtime, reason: str) -> list[str]:
    """Validate the whole file, then apply it atomically; returns the errors (empty = applied)."""
    if rt.config_path is None:
        return ["(file): the gateway was started without a config file"]
    from kilolined import systemd

    systemd.reloading()
    try:
        try:
            cfg, version = load_config(rt.config_path)
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


async def watch_config(rt: Runtime, stop: asyncio.Event) -> None:
    """Reload when the config file's bytes change.

    Watch directories, not the file: editors save by rename, which a watch on the file's inode
    misses (watchfiles #127); a ConfigMap swaps a symlink in the directory; the file may be a
    symlink into another directory. Every event — and every quiet half second, which also
    covers a write that landed before the watch was set up — ends in the same cheap check:
    has the sha256 of the bytes changed since the last good or last refused version?
    """
    from watchfiles import awatch

    assert rt.config_path is not None
    target = Path(rt.config_path)
    dirs = {str(target.parent.resolve()), str(Path(os.path.realpath(target)).parent)}
    refused: str | None = None

    def relevant(_change: object, path: str) -> bool:
        return True  # the sha check below decides; directories hold few files

    async for _changes in awatch(*dirs, watch_filter=relevant, recursive=False, debounce=300, step=50,
                                 stop_event=stop, yield_on_timeout=True, rust_timeout=500):
        try:
            digest = hashlib.sha256(target.read_bytes()).hexdigest()
        except OSError:
            continue  # mid-swap, or removed: keep the running config
        if digest == refused or (digest == rt.version and rt.last_error is None):
            continue  # nothing new (a file put back to the running version still clears last_error)
        try:
            errors = await reload_from_file(rt, reason="file changed")
        except Exception:
            log.exception("reload")
            continue
        refused = digest if errors else None
