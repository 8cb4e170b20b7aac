"""Processes under a test's process: found through /proc, and killed by pid when a test fails."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[1])


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                parents[int(entry)] = stat[1]
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    stat = _proc_stat(pid)
    return stat is not None and stat[0] != "Z"


def kill_tree(process: subprocess.Popen) -> None:
    """A failed test's clean-up: the process and everything under it, by pid."""
    if process.poll() is not None:
        return
    left = descendants(process.pid)
    process.kill()
    process.wait()
    for pid in left:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
