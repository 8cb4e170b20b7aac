"""Every Redis client of the fleet is built here, from ``broker_url`` and ``[redis]``.

Two shapes of ``broker_url``, the same for Celery/kombu and for the fleet's own redis-py clients:

- ``redis://[user:password@]host:port/db``: one server (``rediss://`` for TLS);
- ``sentinel://[user:password@]host:port/db;sentinel://host:port;...``: Redis Sentinel, written
  as kombu takes it. Each ``;``-separated part names one Sentinel; the user, password and db of
  the first part are the master's (kombu reads them from there only, so a different db or
  password on another part is refused rather than silently ignored). ``[redis] master_name``
  names the monitored master and ``[redis] sentinel_password`` authenticates to the Sentinels.

A Sentinel client asks the Sentinels for the current master on every new connection and drops
its connections when the master it talks to turns read-only (a demoted master) or goes away, so
after a failover the next command reaches the new master: redis-py's ``SentinelConnectionPool``
does this; kombu uses the same pool through its ``sentinel`` transport
(``broker_transport_options`` from ``celery_transport_options``). Lua scripts need nothing
more: ``Script`` objects send EVALSHA and load the text on NOSCRIPT, which is what a promoted
replica answers for a script it never saw (fleet/core/lua.py).

A broker URL is printed or logged only as ``mask_url`` leaves it (its password ``***``), and a
Redis that does not answer is ``broker_unavailable``: one line naming it, masked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.sentinel import Sentinel

from fleet.core.errors import BrokerUnavailable

if TYPE_CHECKING:
    from fleet.core.config import Settings

SENTINEL_SCHEME = "sentinel"
# What a Redis that does not answer raises (``broker_unavailable`` turns it into one clear line).
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
# What a Redis that cannot serve right now raises: unreachable, still loading its data
# (BusyLoadingError is a ConnectionError), or a demoted master that went read-only (Sentinel,
# until the client finds the new one). A request that meets one can be sent again shortly.
UNAVAILABLE = (*UNREACHABLE, redis.ReadOnlyError)
DEFAULT_MASTER_NAME = "mymaster"  # Redis's own example name (sentinel.conf)
DEFAULT_SENTINEL_PORT = 26379
# Connections to the Sentinels themselves: a dead Sentinel must not hold up the next one.
_SENTINEL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class SentinelURL:
    """A parsed ``sentinel://...;sentinel://...`` broker URL."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None


def is_sentinel(url: str) -> bool:
    return url.strip().lower().startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel_url(url: str) -> SentinelURL:
    """The Sentinels, db and master credentials of a Sentinel broker URL; ValueError names what
    is wrong."""
    sentinels: list[tuple[str, int]] = []
    first: SentinelURL | None = None
    for part in (p.strip() for p in url.split(";") if p.strip()):
        parsed = urlsplit(part)
        if parsed.scheme.lower() != SENTINEL_SCHEME:
            raise ValueError(f"every part of a Sentinel URL starts with sentinel://, not {parsed.scheme}://")
        if not parsed.hostname:
            raise ValueError("a sentinel:// part names no host")
        sentinels.append((parsed.hostname, parsed.port or DEFAULT_SENTINEL_PORT))
        path = parsed.path.strip("/")
        if path and not path.isdigit():
            raise ValueError(f"the db of a Sentinel URL is a number, not {path!r}")
        this = SentinelURL((), int(path or 0), unquote(parsed.username) if parsed.username else None,
                           unquote(parsed.password) if parsed.password else None)
        if first is None:
            first = this
        elif (path and this.db != first.db) or (parsed.password and this.password != first.password):
            # kombu reads them from the first part only: a different one elsewhere would be ignored
            raise ValueError("the db and password of a Sentinel URL go on its first sentinel:// part")
    if first is None:
        raise ValueError("a Sentinel URL names no Sentinel")
    return SentinelURL(tuple(sentinels), first.db, first.username, first.password)


def _sentinel_args(url: str, sentinel_password: str,
                   kwargs: dict[str, Any]) -> tuple[SentinelURL, dict[str, Any], dict[str, Any]]:
    target = parse_sentinel_url(url)
    master = {"db": target.db, "username": target.username, "password": target.password, **kwargs}
    to_sentinels: dict[str, Any] = {"socket_timeout": _SENTINEL_TIMEOUT_S,
                                    "socket_connect_timeout": _SENTINEL_TIMEOUT_S}
    if sentinel_password:
        to_sentinels["password"] = sentinel_password
    return target, master, to_sentinels


def redis_from_url(url: str, master_name: str = DEFAULT_MASTER_NAME, sentinel_password: str = "",
                   **kwargs: Any) -> redis.Redis:
    """A redis-py client for ``url`` (either shape); ``kwargs`` go to its connections."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    target, master, to_sentinels = _sentinel_args(url, sentinel_password, kwargs)
    sentinel = Sentinel(list(target.sentinels), sentinel_kwargs=to_sentinels)
    return sentinel.master_for(master_name, redis_class=redis.Redis, **master)


def redis_client(settings: Settings, **kwargs: Any) -> redis.Redis:
    """The fleet's Redis (``settings.broker_url``) for this process."""
    return redis_from_url(settings.broker_url, settings.redis.master_name,
                          settings.redis.sentinel_password, **kwargs)


def async_redis_client(settings: Settings, **kwargs: Any) -> redis.asyncio.Redis:
    """The same as ``redis_client`` for asyncio code (the gateway)."""
    url = settings.broker_url
    if not is_sentinel(url):
        return redis.asyncio.Redis.from_url(url, **kwargs)
    target, master, to_sentinels = _sentinel_args(url, settings.redis.sentinel_password, kwargs)
    sentinel = AsyncSentinel(list(target.sentinels), sentinel_kwargs=to_sentinels)
    return sentinel.master_for(settings.redis.master_name, redis_class=redis.asyncio.Redis, **master)


def sentinel_target(settings: Settings) -> dict[str, str]:
    """The ``[redis]`` settings as keyword arguments of ``redis_from_url``."""
    return {"master_name": settings.redis.master_name,
            "sentinel_password": settings.redis.sentinel_password}


def celery_transport_options(settings: Settings) -> dict[str, Any]:
    """What kombu's Redis transport needs beyond the URL: the master's name and the Sentinels'
    password for a Sentinel URL, nothing for a plain one."""
    if not is_sentinel(settings.broker_url):
        return {}
    options: dict[str, Any] = {"master_name": settings.redis.master_name}
    if settings.redis.sentinel_password:
        options["sentinel_kwargs"] = {"password": settings.redis.sentinel_password}
    return options


def broker_unavailable(url: str, exc: BaseException) -> BrokerUnavailable:
    """E_BROKER_UNAVAILABLE in one line naming the broker (password masked): what producers and
    every CLI command show instead of a traceback."""
    return BrokerUnavailable(f"the broker at {mask_url(url)} does not answer ({type(exc).__name__}); "
                             "is Redis running, and is broker_url (FLEET_BROKER_URL) right?")


def mask_url(url: str) -> str:
    """``url`` with its password replaced by ``***``: the one form of a URL that is printed or logged.
    A Sentinel URL (``sentinel://...;sentinel://...``) is masked part by part."""
    if ";" in url:
        return ";".join(mask_url(part) for part in url.split(";"))
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # not a URL at all: print nothing of it
        return "<unparsable URL>"
    if password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    user = userinfo.partition(":")[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
