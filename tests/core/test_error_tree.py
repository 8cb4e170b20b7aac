"""The error tree drawn in fleet/core/errors.py's docstring is the module's class hierarchy: every
exception class defined there is drawn exactly once, under its real parent, and nothing else is.

The drawing is read by column: a root name stands alone on its line, a child is ``+-- Name`` and
its parent is the nearest line above whose name starts left of that ``+--``. Continuation lines
(text only, or ``|``) carry no name and are skipped."""

from __future__ import annotations

import inspect
import re

from fleet.core import errors

_NODE = re.compile(r"\+-- (\w+)")
_ROOT = re.compile(r"^(\s+)(\w+)\s")


def _drawing() -> list[str]:
    """The docstring's lines from the root class down to the first blank line."""
    lines = (errors.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if _ROOT.match(line))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def drawn_tree() -> list[tuple[str, str | None]]:
    """(class name, parent name or None for the root) per drawn node, in drawing order."""
    nodes: list[tuple[str, str | None]] = []
    above: list[tuple[int, str]] = []  # (column of the name, name) of the open branches
    for line in _drawing():
        node = _NODE.search(line)
        if node is None:
            root = _ROOT.match(line)
            if root is not None and not above and "|" not in line:
                above.append((root.end(1), root.group(2)))
                nodes.append((root.group(2), None))
            continue
        branch = node.start()
        while above and above[-1][0] >= branch:
            above.pop()
        assert above, f"a branch with nothing above it: {line!r}"
        nodes.append((node.group(1), above[-1][1]))
        above.append((node.start(1), node.group(1)))
    return nodes


def defined_classes() -> dict[str, type[BaseException]]:
    return {name: cls for name, cls in inspect.getmembers(errors, inspect.isclass)
            if cls.__module__ == errors.__name__ and issubclass(cls, BaseException)}


def test_the_drawing_parses_into_one_tree() -> None:
    nodes = drawn_tree()
    assert [name for name, parent in nodes if parent is None] == ["FleetError"]
    assert len(nodes) > 20  # the whole drawing was read, not its first lines


def test_every_error_class_is_drawn_exactly_once() -> None:
    names = [name for name, _ in drawn_tree()]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert twice == [], f"drawn more than once: {twice}"
    assert sorted(names) == sorted(defined_classes()), "the drawing and the classes differ"


def test_every_error_class_is_drawn_under_its_parent() -> None:
    classes = defined_classes()
    for name, parent in drawn_tree():
        base = classes[name].__bases__[0]
        real = base.__name__ if base.__module__ == errors.__name__ else None
        assert parent == real, f"{name} is drawn under {parent}, its class derives from {base.__name__}"
