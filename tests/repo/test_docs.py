"""The README's layout matches the tree, the docs' links resolve, and the repository stands on its
own: nothing in it points at files outside it (the test corpora excepted, docs/testing.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FILE_NAME = re.compile(r"`([\w./-]+\.(?:py|toml|lua|md))`")
LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")
# Built from pieces so that this file does not name them itself.
OUTSIDE = ["BRIEF" + ".md", "ARCHITECTURE" + ".md", "VLLM_API" + ".md", "STYLE" + ".md", "seed" + "/"]
SHARED_OUTSIDE_CORPORA = re.compile(r"\.\./" + "shared(?!/corpora)")


def layout_rows() -> list[tuple[str, str]]:
    """(path, description) of each row of the README's Layout table."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            rows.append((cells[0].strip("`"), cells[1]))
    assert rows, "no Layout table in README.md"
    return rows


def test_every_package_directory_is_in_the_layout() -> None:
    named = {path.rstrip("/") for path, _ in layout_rows()}
    packages = {
        str(init.parent.relative_to(ROOT))
        for top in ("fleet", "schedulers")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    packages.discard("fleet")  # the rows are what it holds
    assert packages - named == set(), "package directories missing from README.md's Layout"


def test_every_path_in_the_layout_exists() -> None:
    missing = []
    for path, description in layout_rows():
        where = ROOT / path
        if not where.exists():
            missing.append(path)
            continue
        folder = where if where.is_dir() else where.parent
        missing += [f"{path} {name}" for name in FILE_NAME.findall(description)
                    if not (folder / name).exists()]
    assert missing == []


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to '-'."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_between_pages_resolve() -> None:
    broken = []
    for page in PAGES:
        for target, anchor in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            linked = page.parent / target if target else page
            if not linked.is_file() or (anchor and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)}: {target}#{anchor}")
    assert broken == []


def test_nothing_points_outside_the_repository() -> None:
    files = [*PAGES, *(p for top in ("fleet", "schedulers", "tests") for p in (ROOT / top).rglob("*")
                      if p.suffix in {".py", ".toml", ".lua", ".md"} and "__pycache__" not in p.parts)]
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        found += [f"{path.relative_to(ROOT)}: {word}" for word in OUTSIDE if word in text]
        found += [f"{path.relative_to(ROOT)}: {hit}" for hit in SHARED_OUTSIDE_CORPORA.findall(text)]
    assert found == []


def test_the_job_table_lists_every_accepted_field() -> None:
    from fleet.core.models import Job

    page = (ROOT / "docs" / "jobs.md").read_text(encoding="utf-8")
    table = page.split("## The Job", 1)[1].split("\n## ", 1)[0]
    named = {name for row in table.splitlines() if row.startswith("| `")
             for name in re.findall(r"`([a-z_]+)`", row.split("|")[1])}
    assert set(Job.model_fields) <= named, set(Job.model_fields) - named
