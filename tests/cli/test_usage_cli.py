"""``fleet usage`` through typer's CliRunner, in process, on the test Redis: the ledger's figures as
a table, JSON and CSV, by hour, day, key and model; what it cannot show is one coded line, exit 2."""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import pytest
import redis
from rich.console import Console
from typer.testing import CliRunner

from fleet.cli.main import app
from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.keys import Keys
from fleet.core.usage import TurnUsage, UsageLedger
from tests.support.fleet_harness import make_config
from tests.support.testenv import TEST_REDIS_URL, delete_prefix


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    path = make_config(tmp_path, broker_url=TEST_REDIS_URL)
    monkeypatch.setenv("FLEET_CONFIG", str(path))
    monkeypatch.setenv("COLUMNS", "250")
    # the CLI's console is made at import and keeps a COLUMNS it saw then (pytest-xdist's
    # workers set 80): the table is drawn 250 wide whatever ran first
    monkeypatch.setattr("fleet.cli.main.console", Console(width=250))
    settings = load_settings(path, env={})
    yield settings
    delete_prefix(redis.Redis.from_url(TEST_REDIS_URL), settings.key_prefix)


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(app, ["usage", *args])


@pytest.mark.parametrize(("args", "says"), [
    (["--project", "nosuch"], "unknown project 'nosuch'"),
    (["--by", "week"], "--by must be one of hour, day, key, model"),
    (["--days", "0"], "--days must be more than 0"),
    (["--json", "--csv"], "--json and --csv: choose one"),
])
def test_what_it_cannot_show_is_one_coded_line(config, args: list[str], says: str) -> None:  # type: ignore[no-untyped-def]
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert result.output.strip().startswith(f"{Code.E_INPUT_INVALID.value} {says}")


def test_the_ledger_as_table_json_and_csv(config) -> None:  # type: ignore[no-untyped-def]
    now = time.time()
    client = redis.Redis.from_url(TEST_REDIS_URL)
    UsageLedger(client, Keys(config.key_prefix), config.usage).count([
        TurnUsage("reports", "j1", 1, 1, "OK", prompt_tokens=100, reasoning_tokens=20, answer_tokens=5,
                  ended_at=now),
        TurnUsage("reports", "j2", 2, 1, "E_THINK_LOOP", prompt_tokens=90, reasoning_tokens=300, cut=True,
                  ended_at=now),
        TurnUsage("triage", "g1", 3, 1, "OK", key="sha256:0123abcd", prompt_tokens=7, answer_tokens=2,
                  ended_at=now)])
    client.close()
    table = run("--by", "hour")
    assert table.exit_code == 0, table.output
    assert "Usage by hour" in table.output and "E_THINK_LOOP:1" in table.output
    rows = json.loads(run("--by", "key", "--json").output)
    assert [(r["project"], r["key"], r["requests"], r["prompt_tokens"]) for r in rows] == [
        ("reports", "queue", 2, 190), ("triage", "sha256:0123abcd", 1, 7)]
    assert rows[0]["loop_cut_tokens"] == 300 and rows[0]["codes"] == {"E_THINK_LOOP": 1, "OK": 1}
    lines = list(csv.DictReader(io.StringIO(run("--project", "triage", "--by", "model", "--csv").output)))
    assert [(r["model"], r["answer_tokens"], r["codes"]) for r in lines] == [("local", "2", "OK=1")]
    assert json.loads(run("--project", "translate", "--json").output) == []
