"""The production start as docs/deployment.md writes it: every systemd unit in deploy/systemd and
every Procfile line runs a ``fleet`` command line that parses, and the units restart their
process whatever ends it."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleet.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
UNITS = sorted((ROOT / "deploy" / "systemd").glob("*.service"))


def parses(argv: list[str]) -> None:
    """The command line is one the ``fleet`` command accepts (its options checked, nothing run)."""
    result = CliRunner().invoke(app, [*argv, "--help"])
    assert result.exit_code == 0, (argv, result.output)


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(path)
    return parser


def test_one_unit_per_role() -> None:
    assert {p.stem for p in UNITS} == {"fleet-dispatcher", "fleet-infer", "fleet-prep",
                                       "fleet-collect", "fleet-gateway", "fleet-flower", "fleet-tools"}


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.stem)
def test_units_restart_always_and_read_the_environment_file(path: Path) -> None:
    service = unit(path)["Service"]
    assert service["Restart"] == "always"
    assert service["EnvironmentFile"] == "/etc/fleet/fleet.env"
    argv = shlex.split(service["ExecStart"].replace("%%", "%"))
    assert argv[0] == "/opt/fleet/.venv/bin/fleet"
    parses(argv[1:])


def test_procfile_lines_parse() -> None:
    for line in (ROOT / "Procfile").read_text().splitlines():
        name, _, command = line.partition(":")
        argv = [word for word in shlex.split(command) if "=" not in word or word.startswith("-")]
        assert argv[0] == "fleet", line
        parses(argv[1:])


def test_the_environment_file_example_names_real_settings() -> None:
    from fleet.core.config import load_settings

    names = [line.split("=", 1)[0] for line in (ROOT / "deploy" / "fleet.env.example").read_text()
             .splitlines() if line and not line.startswith("#")]
    assert set(names) == {"FLEET_CONFIG", "FLEET_BROKER_URL", "FLEET_BACKEND_URL"}
    load_settings(env={"FLEET_BROKER_URL": "redis://redis-host:6379/0",
                       "FLEET_BACKEND_URL": "http://gpu-host:8100"})
