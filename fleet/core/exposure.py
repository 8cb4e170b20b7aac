"""Start-up refusal of the example configuration's secrets on a broker others can reach.

The secrets of fleet/core/example.toml ship with the package, so anyone can sign jobs with them.
``refuse_public_secrets`` is what a worker, dispatcher or gateway calls before it takes work:

- a project whose secret is one of the example's (recognised by value, so a copy of the example
  under any name or path is recognised too) makes it raise ``PublicSecrets`` (E_AUTH) naming the
  projects - unless the broker is local;
- "local" means the process's parent started that broker itself: ``fleet up`` and ``fleet demo``
  start a private loopback redis-server and name its URL in ``LOCAL_BROKER_ENV`` in the environment
  of every child they spawn (fleet/local/processes.py). Only a marker naming the very broker in
  ``settings.broker_url`` counts, so a marker inherited from elsewhere blesses nothing else. On a
  local broker the refusal is a warning and the process runs on.

``warn_shared_broker`` is the other start-up check: a worker, dispatcher or gateway connected to
its broker as Redis's ``default`` user with every key and command (or to a Redis without ACLs)
logs one warning. There every holder of the broker URL - every project's producers - can read
and write every project's keys; the signatures and the workers' seal still keep a planted or
edited record from running anything, but not a client that reads others' results, deletes
their records or fills the queues. Isolation between projects needs the ACL users of
``fleet acl`` (docs/security.md). A warning, not a refusal: a single-tenant fleet, ``fleet up``
and the tests run as the default user on purpose; on a broker the process's parent started
itself (see below) it stays silent.

Not covered: secrets that are public for other reasons (a fleet.toml committed to a public
repository), or weak ones; the marker is an environment variable, so whoever starts the process
can set it - it stops accidents, not an operator.
"""

from __future__ import annotations

import functools
import logging
import os
import tomllib
from collections.abc import Mapping

import redis

from fleet.core.config import EXAMPLE_CONFIG, Settings
from fleet.core.errors import PublicSecrets
from fleet.core.redisconn import mask_url

log = logging.getLogger(__name__)

LOCAL_BROKER_ENV = "FLEET_LOCAL_BROKER"


@functools.cache
def example_secrets() -> frozenset[str]:
    data = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    return frozenset(project["secret"] for project in data.get("projects", {}).values())


def public_secret_projects(settings: Settings) -> list[str]:
    """The projects whose secret is one of the example configuration's."""
    public = example_secrets()
    return sorted(name for name, project in settings.projects.items() if project.secret in public)


def broker_is_local(settings: Settings, env: Mapping[str, str] | None = None) -> bool:
    """Did the parent of this process start ``settings.broker_url`` itself (``LOCAL_BROKER_ENV``)?"""
    values = os.environ if env is None else env
    marked = values.get(LOCAL_BROKER_ENV, "")
    return bool(marked) and marked == settings.broker_url


def refuse_public_secrets(settings: Settings, *, local_broker: bool, role: str) -> None:
    """Raise ``PublicSecrets`` when projects run on the example's secrets on a broker that is not
    local; on a local one, log a warning instead."""
    public = public_secret_projects(settings)
    if not public:
        return
    names = ", ".join(public)
    if local_broker:
        log.warning("projects %s use the example configuration's public secrets; fine on this private "
                    "broker, but write your own fleet.toml before accepting real jobs", names)
        return
    raise PublicSecrets(
        f"{role} cannot start: projects {names} use the example configuration's public secrets and the "
        f"broker {mask_url(settings.broker_url)} was not started by fleet up or fleet demo; "
        "give every project its own secret in fleet.toml")


def unrestricted_default_user(client: redis.Redis) -> bool:
    """Is ``client`` Redis's ``default`` user with every key and every command, or on a Redis that
    has no ACLs at all (before 6.0)?"""
    try:
        if client.acl_whoami() != "default":
            return False
        user = client.acl_getuser("default")
    except redis.exceptions.NoPermissionError:
        return False  # a default user without ACL rights is a restricted one
    except redis.ResponseError:
        return True  # no ACL command: everyone has every right
    keys, categories = (user or {}).get("keys"), (user or {}).get("categories")
    return isinstance(keys, list) and "~*" in keys and isinstance(categories, list) and (
        "+@all" in categories)


def warn_shared_broker(settings: Settings, client: redis.Redis, *, local_broker: bool,
                       role: str) -> bool:
    """Log a warning (and return True) when this process reaches a broker others share as the
    all-powerful default user; see the module docstring."""
    if local_broker or not unrestricted_default_user(client):
        return False
    log.warning("%s connected to %s as the Redis default user with every right: anyone holding "
                "this broker URL reads and writes every project's jobs and results; give each "
                "process and project its own user (fleet acl, docs/security.md)",
                role, mask_url(settings.broker_url))
    return True
