"""Config reload triggers: the file watcher, SIGHUP and POST /admin/reload all end in one place."""

from __future__ import annotations

import asyncio
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
        except ConfigError as e:
            rt.reload_failed(e.errors)
            return e.errors
        if version == rt.version and rt.last_error is None:
            return []
        for w in rt.apply(cfg, version):
            log.warning("⚠ [reload] %s", w)
        log.info("✓ [reload] config %s applied (%s)", version[:12], reason)
        return []
    finally:
        systemd.ready(rt)


async def watch_config(rt: Runtime, stop: asyncio.Event) -> None:
    """Watch the config's directory, not the file: editors save by rename, which a watch on the
    file's inode would miss (watchfiles #127); a ConfigMap swaps a symlink in the directory."""
    from watchfiles import awatch

    assert rt.config_path is not None
    target = Path(rt.config_path)
    directory = target.parent.resolve()

    def relevant(_change: object, path: str) -> bool:
        p = Path(path)
        # Anything touching the file, its symlink target or a ConfigMap's ..data link.
        return p.name == target.name or p.name.startswith("..") or p == Path(os.path.realpath(target))

    async for _changes in awatch(directory, watch_filter=relevant, recursive=False, debounce=300, step=50,
                                 stop_event=stop):
        try:
            await reload_from_file(rt, reason="file changed")
        except Exception:
            log.exception("reload")
