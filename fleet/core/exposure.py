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

from fleet.core.config import EXAMPLE_CONFIG, Settings, mask_url
from fleet.core.errors import PublicSecrets

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
