"""Lua scripts live in ``.lua`` files in a ``lua/`` folder beside the module that runs them, and
are registered once per Redis client or store, never per call.

Each file opens with a comment block: the KEYS it touches (every key it reads or writes is one
of them, as Redis Cluster requires), its ARGV and what it returns. A folder may hold a prelude of
helper functions (``prelude.lua`` in schedulers/store/lua/): ``Scripts(..., prelude=...)`` puts
it in front of each script's text, so the helpers are plain local functions of every script.
A script may also call other scripts of its folder (``Scripts(..., uses={"gateway": ("add",
...)})``): each named one comes before it as a local function of the upper-case name taking
``(KEYS, ARGV)`` (``ADD(keys, argv)``), its text unchanged, so composing scripts copies no Lua.

``register_script`` only computes the SHA1; redis-py sends EVALSHA and loads the text on the
first NOSCRIPT, so one ``Script`` object per client is all that is needed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

import redis
from redis.commands.core import Script


def source(package: str, name: str, prelude: str | None = None, uses: Iterable[str] = ()) -> str:
    """The text of ``<package>/lua/<name>.lua``, behind the scripts it ``uses`` (each as a local
    function ``NAME(KEYS, ARGV)``) and, first, ``<prelude>.lua`` of the same folder."""
    folder = resources.files(package) / "lua"

    def read(file: str) -> str:
        return (folder / f"{file}.lua").read_text(encoding="utf-8")

    parts = [read(prelude)] if prelude is not None else []
    parts += [f"local function {used.upper()}(KEYS, ARGV)\n{read(used)}\nend" for used in uses]
    return "\n".join([*parts, read(name)])


class Scripts:
    """The named scripts of one package's ``lua/`` folder, registered on one client."""

    def __init__(self, client: redis.Redis, package: str, names: Iterable[str],
                 prelude: str | None = None, uses: Mapping[str, Iterable[str]] | None = None) -> None:
        self.package = package
        self._scripts: dict[str, Script] = {
            name: client.register_script(source(package, name, prelude, (uses or {}).get(name, ())))
            for name in names
        }

    def __getitem__(self, name: str) -> Script:
        return self._scripts[name]

    def __iter__(self) -> Any:
        return iter(self._scripts.items())


_shared: weakref.WeakKeyDictionary[redis.Redis, dict[str, Scripts]] = weakref.WeakKeyDictionary()
_shared_lock = threading.Lock()


def shared(client: redis.Redis, package: str, names: Iterable[str]) -> Scripts:
    """``Scripts`` for code that holds a client but no long-lived object of its own (a prep
    claim per job, a retry budget per attempt): registered on the first call for that client,
    the same object afterwards."""
    with _shared_lock:
        per_client = _shared.setdefault(client, {})
        if package not in per_client:
            per_client[package] = Scripts(client, package, names)
        return per_client[package]
