"""The test tree as docs/testing.md describes it: a test module imports shared helpers from
``tests.support`` only, never from another test module (whose fixtures and helpers would then
run, or break, with it)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    found |= {node.module for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    return found


def test_no_test_module_imports_another() -> None:
    offenders = {
        str(path.relative_to(TESTS)): sorted(m for m in imported_modules(path)
                                             if m.startswith("tests.") and not m.startswith("tests.support"))
        for path in TESTS.rglob("*.py") if "support" not in path.relative_to(TESTS).parts
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_check_sees_an_import_of_a_test_module(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text("from tests.prep.test_prepwatch import setup\nimport tests.support.waiting\n")
    assert imported_modules(module) == {"tests.prep.test_prepwatch", "tests.support.waiting"}
