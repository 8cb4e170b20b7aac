"""Who is calling: per-project API keys (``Authorization: Bearer <key>``), rotated without restart.

The settings keep digests only (fleet/core/apikeys.py says why SHA-256 is enough). ``KeyRing`` maps
each digest to its project and band; ``LiveSettings`` holds the current settings and key ring and
loads the config file again when its mtime changes (checked at most every
``gateway.reload_check_s``, on the request path: no watcher thread) or at once on SIGHUP
(``request_reload``). A rotation is: add the new digest, let clients switch, remove the old one.

Failure cases:
- no ``Authorization`` header, not ``Bearer``, or a key no project has -> ``AuthError``
  (401 ``E_AUTH``); the key itself is never logged, only the first characters of its digest;
- a reload that fails (bad TOML, a bad entry, the file gone) keeps the settings in force and logs
  the ``ConfigError``; the next mtime change tries again. Settings other than keys and project
  defaults (Redis, backend, ports) are read again too, but only a restart applies them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fleet.core.apikeys import digest, parse_entry
from fleet.core.config import ProjectSettings, Settings
from fleet.core.errors import AuthError, ConfigError
from fleet.core.models import Band

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caller:
    project: str
    band: Band
    settings: ProjectSettings
    key_id: str  # the first characters of the key's digest, for logs


class KeyRing:
    def __init__(self, settings: Settings) -> None:
        self._by_digest: dict[str, tuple[str, Band]] = {}
        for name, project in settings.projects.items():
            for entry in project.api_keys:
                parsed = parse_entry(entry)
                self._by_digest[parsed.digest] = (name, parsed.band)
        self._settings = settings
        self._metrics = frozenset(parse_entry(e).digest for e in settings.gateway.metrics_keys)

    def __len__(self) -> int:
        return len(self._by_digest)

    def caller(self, authorization: str | None) -> Caller:
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("missing API key: send 'Authorization: Bearer <key>'")
        hashed = digest(key.strip())
        found = self._by_digest.get(hashed)
        if found is None:
            raise AuthError("invalid API key")
        project, band = found
        return Caller(project, band, self._settings.projects[project], hashed[:8])


    def metrics_reader(self, authorization: str | None) -> None:
        """Pass for a metrics key (``gateway.metrics_keys``); ``AuthError`` for anything else, a
        project's API key included: ``/metrics`` shows every project's figures."""
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise AuthError("/metrics needs a metrics key (gateway.metrics_keys): send "
                            "'Authorization: Bearer <key>'")
        if digest(key.strip()) not in self._metrics:
            raise AuthError("not a metrics key (gateway.metrics_keys)")


class LiveSettings:
    """The settings in force and their key ring, reloaded from ``path`` when it changes."""

    def __init__(self, settings: Settings, path: Path | None,
                 load: Callable[[Path], Settings], clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.keys = KeyRing(settings)
        self._path = path
        self._load = load
        self._clock = clock
        self._mtime = self._stat()
        self._checked_at = clock()
        self._forced = threading.Event()
        self._lock = threading.Lock()

    def _stat(self) -> float | None:
        if self._path is None:
            return None
        try:
            return os.stat(self._path).st_mtime_ns / 1e9
        except OSError:
            return None

    def request_reload(self) -> None:
        """For a SIGHUP handler: the next request reloads, whatever the mtime."""
        self._forced.set()

    def current(self) -> KeyRing:
        """The key ring, after a reload if the file changed (or SIGHUP asked for one)."""
        now = self._clock()
        due = now - self._checked_at >= self.settings.gateway.reload_check_s
        if self._path is not None and (due or self._forced.is_set()):
            with self._lock:
                self._checked_at = now
                mtime = self._stat()
                if self._forced.is_set() or mtime != self._mtime:
                    self._forced.clear()
                    self._mtime = mtime
                    self._reload()
        return self.keys

    def _reload(self) -> None:
        assert self._path is not None
        try:
            settings = self._load(self._path)
            waiting = restart_only(self.settings, settings)
            if waiting:
                settings = keep_restart_only(self.settings, settings)
            ring = KeyRing(settings)
        except (ConfigError, ValueError) as exc:
            log.error("config reload failed, keeping the settings in force: %s", exc)
            return
        if waiting:
            log.warning("config reload: %s change only with a restart of every process; the rest "
                        "(API keys, key quotas, the repeat cache, limits read per request) is in force in "
                        "this gateway now (workers keep theirs until they restart)", ", ".join(waiting))
        self.settings, self.keys = settings, ring
        log.info("config reloaded from %s: %d API keys", self._path, len(ring))


# What a gateway built its process around at start: the backends it streams to and its admission
# store (their limits, each project's weight, quota and model), the broker and keys, the workers'
# secret, the projects themselves.
# A reload keeps these as they were (``keep_restart_only``); changing them takes a restart of
# every process, since dispatchers, workers and gateways must agree on them.
RESTART_ONLY = ("backend", "backends", "broker_url", "key_prefix", "redis", "security", "admission")
RESTART_ONLY_PROJECT = ("weight", "quota", "model")


def restart_only(old: Settings, new: Settings) -> list[str]:
    """The settings ``new`` changes that only a restart applies (their names). A project added
    is one of them (no worker or admission store knows it yet); a project removed is not: its
    keys stop working at once."""
    changed = [name for name in RESTART_ONLY if getattr(old, name) != getattr(new, name)]
    for project, settings in new.projects.items():
        before = old.projects.get(project)
        if before is None:
            changed.append(f"projects.{project} (a new project)")
            continue
        for name in RESTART_ONLY_PROJECT:
            if getattr(before, name) != getattr(settings, name):
                changed.append(f"projects.{project}.{name}")
    return changed


def keep_restart_only(old: Settings, new: Settings) -> Settings:
    """``new`` with every restart-only setting as ``old`` has it, and without projects ``old``
    does not have."""
    projects = {name: p.model_copy(update={k: getattr(old.projects[name], k) for k in RESTART_ONLY_PROJECT})
                for name, p in new.projects.items() if name in old.projects}
    return new.model_copy(update={**{name: getattr(old, name) for name in RESTART_ONLY}, "projects": projects})
