"""``fleet cache stats|clear``: the projects' exact-repeat caches (fleet/core/repeatcache.py,
docs/usage.md "Exact-repeat cache"), read and cleared on the operator's Redis user."""

from __future__ import annotations

from rich.table import Table

from fleet.core.config import Settings
from fleet.core.errors import InputInvalid
from fleet.core.keys import Keys
from fleet.core.redisconn import redis_client
from fleet.core.repeatcache import RepeatCache

STATS = ("entries", "bytes", "hits", "misses", "waits", "stores", "evictions")


def _cache(settings: Settings, project: str) -> RepeatCache:
    return RepeatCache(redis_client(settings), Keys(settings.key_prefix), project,
                       settings.projects[project].repeat_cache)


def stats_table(settings: Settings, projects: list[str]) -> Table:
    table = Table(title="exact-repeat caches")
    for column in ("project", "enabled", *STATS):
        table.add_column(column, justify="left" if column == "project" else "right")
    for project in projects:
        figures = _cache(settings, project).stats()
        enabled = "yes" if settings.projects[project].repeat_cache.enabled else "no"
        table.add_row(project, enabled, *(f"{figures[name]:,}" for name in STATS))
    return table


def clear(settings: Settings, project: str) -> int:
    """Drop every kept answer of ``project``; how many there were."""
    return _cache(settings, project).clear()


def projects_named(settings: Settings, project: str | None) -> list[str]:
    """``project`` (InputInvalid when the settings have none of that name), or every one."""
    if project is not None and settings.project(project) is None:
        raise InputInvalid(f"unknown project {project!r} (not in this configuration)")
    return [project] if project is not None else sorted(settings.projects)
