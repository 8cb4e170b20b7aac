"""Opening a file under allowed roots so that nothing can lead out, whatever races the check.

``open_under(roots, path, setting)`` applies ``..`` to the path as written (it must stay inside
a root), then opens it one component at a time from the root's descriptor (``openat``), each
component with O_NOFOLLOW and every directory with O_DIRECTORY. No symlink is ever followed, so
one swapped in after any check cannot lead out: there is no separate check to race. The file
itself is opened with O_NONBLOCK, so a FIFO cannot block the opener waiting for a writer (the
caller refuses anything that fstat does not call a regular file). Every refusal is a
``PathRefused`` with a reason fit for the job's error message.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class PathRefused(Exception):
    """Why the path cannot be opened under the roots."""


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, forever.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def open_under(roots: list[Path], raw_path: str, setting: str) -> int:
    """A descriptor of the file at ``raw_path``, opened one component at a time from its root's
    descriptor, so no symlink is ever followed and none swapped in later can lead out."""
    path = Path(raw_path).expanduser()
    if not path.is_absolute():
        path = roots[0] / path
    lexical = Path(os.path.normpath(path))
    root = next((r for r in roots if lexical.is_relative_to(r)), None)
    if root is None:
        raise PathRefused(f"the path leads outside {setting}")
    parts = lexical.relative_to(root).parts
    if not parts:
        raise PathRefused("not a regular file")
    try:
        fd = os.open(root, _DIR_FLAGS)
        for part in parts[:-1]:
            fd = _open_step(fd, part, _DIR_FLAGS)
        return _open_step(fd, parts[-1], _FILE_FLAGS)
    except ValueError as exc:  # a NUL in the path
        raise PathRefused(f"cannot resolve the path ({exc})") from exc
    except OSError as exc:
        raise PathRefused(_describe_open_error(exc)) from exc


def _open_step(dir_fd: int, name: str, flags: int) -> int:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except NotADirectoryError as exc:  # O_DIRECTORY | O_NOFOLLOW on a symlink says only this
        if stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            raise OSError(errno.ELOOP, "symlink") from exc
        raise
    finally:
        os.close(dir_fd)


def _describe_open_error(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "the path goes through a symlink (never followed under collect.allowed_roots)"
    if exc.errno == errno.ENOENT:
        return "no such file"
    if exc.errno == errno.ENOTDIR:
        return "a component of the path is not a directory (or is a symlink)"
    return f"cannot open the file ({exc.strerror})"
