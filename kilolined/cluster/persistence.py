"""``kilolined check`` in cluster mode: may this gateway use the Redis, and does it write its
memory to disk?

A Redis that refuses this gateway's credentials (``WRONGPASS``, ``NOAUTH``, an ACL without the
commands) or its TLS handshake is a configuration error: `check` exits 1 and `run` refuses to
start, because a gateway that goes on alone would take every slot and budget for itself.

Payloads and job results live in Redis' memory in cluster mode; with RDB snapshots (``save``)
or the append-only file on, they would reach Redis' disk, and KiloLine promises no payload on
disk. A warning, not an error: the config is valid either way (docs/CLUSTER.md).
"""

from __future__ import annotations

import ssl

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, AuthorizationError, RedisError, ResponseError
from yarl import URL

TIMEOUT_SEC = 3.0
FIX = 'set `save ""` and `appendonly no` in redis.conf (docs/CLUSTER.md)'


def persistence(save: str, appendonly: str) -> list[str]:
    """What writes to disk, from ``CONFIG GET save`` and ``CONFIG GET appendonly``."""
    on = []
    if save.strip():
        on.append(f'save "{save.strip()}"')
    if appendonly.strip().lower() == "yes":
        on.append("appendonly yes")
    return on


def shown(url: str) -> str:
    """The URL without its password."""
    try:
        return str(URL(url).with_password(None).with_user(None))
    except ValueError:
        return "the configured Redis"


def access_error(e: BaseException) -> str | None:
    """Why Redis refused this gateway, when that is the configuration's fault (credentials, ACL,
    TLS) rather than an outage that passes; None for an outage."""
    if isinstance(e, AuthenticationError):
        return f"it refused the credentials in cluster.redis_url ({e})"
    if isinstance(e, AuthorizationError) or (
            isinstance(e, ResponseError) and str(e).startswith(("NOAUTH", "WRONGPASS", "NOPERM"))):
        return f"it refused this gateway's commands ({e})"
    cause = e if isinstance(e, ssl.SSLError) else e.__cause__ or e.__context__
    if isinstance(cause, ssl.SSLError):
        return f"the TLS handshake failed ({cause.reason or cause})"
    return None


async def warnings(url: str, timeout: float = TIMEOUT_SEC) -> list[str]:
    """``warning:`` lines for the Redis at ``url`` (none when it keeps nothing on disk), or one
    ``error:`` line when it refuses this gateway (access_error)."""
    where = f"cluster.redis_url: Redis at {shown(url)}"
    r = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True)
    try:
        await r.ping()
        save = (await r.config_get("save")).get("save") or ""
        aof = (await r.config_get("appendonly")).get("appendonly") or ""
    except (RedisError, OSError) as e:
        why = access_error(e)
        if why is not None:
            return [f"error: {where}: {why}"]
        msg = str(e) or type(e).__name__
        return [f"warning: {where}: cannot read its persistence settings ({msg})"]
    finally:
        await r.aclose()
    on = persistence(save, aof)
    if not on:
        return []
    return [f"warning: {where} has persistence on ({', '.join(on)}): payloads and results it holds "
            f"reach its disk; {FIX}"]
