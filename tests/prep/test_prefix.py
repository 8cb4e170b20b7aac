"""fleet/prep/prefix.py: the stable prefix report (whole KV blocks, the warning below one block) and
the typer command, run through typer's CliRunner with a real config file and a dead backend."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
import redis
import typer
from typer.testing import CliRunner

from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.keys import Keys
from fleet.core.models import Job, Message
from fleet.prep.prefix import check_prefix, prefix_command, prefix_warning, stable_prefix
from fleet.prep.tokens import TokenCounter
from tests.support.tokenize_stub import fake_tokenize  # one token per 4 characters, +3 per message


def counter_for(client: redis.Redis, prefix: str) -> TokenCounter:
    return TokenCounter(
        "http://backend",
        "local",
        client,
        Keys(prefix),
        transport=httpx.MockTransport(fake_tokenize),
    )


def test_short_prefix_has_no_whole_block_and_warns(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    cfg = load_settings(
        EXAMPLE_CONFIG,
        env={},
        projects={"triage": {"system_prompt": "Sort tickets by urgency. " * 20}},
    )
    report = check_prefix(cfg, "triage", counter_for(redis_client, key_prefix))
    assert report.exact and report.tokens == 3 + (25 * 20 + 3) // 4
    assert report.blocks == 0 and report.cacheable_tokens == 0
    assert report.warning and "shorter than one KV block (1072)" in report.warning
    assert "never hit" in report.warning


def test_long_prefix_counts_whole_blocks(redis_client: redis.Redis, key_prefix: str) -> None:
    glossary = "term: meaning of the term in this project. " * 250  # ~2,700 tokens here
    cfg = load_settings(EXAMPLE_CONFIG, env={}, projects={"reports": {"system_prompt": glossary}})
    report = check_prefix(cfg, "reports", counter_for(redis_client, key_prefix))
    assert report.tokens == 3 + (len(glossary) + 3) // 4
    assert report.blocks == report.tokens // 1072 == 2
    assert report.cacheable_tokens == 2144 and report.warning is None


def test_no_system_prompt_and_unknown_project(redis_client: redis.Redis, key_prefix: str) -> None:
    cfg = load_settings(EXAMPLE_CONFIG, env={})
    report = check_prefix(cfg, "assistant", counter_for(redis_client, key_prefix))
    assert report.tokens == 0 and report.warning and "no system_prompt" in report.warning
    with pytest.raises(KeyError, match="nope"):
        check_prefix(cfg, "nope", counter_for(redis_client, key_prefix))


def test_stable_prefix_keeps_one_copy_of_the_project_prompt() -> None:
    cfg = load_settings(EXAMPLE_CONFIG, env={}, projects={"triage": {"system_prompt": "P"}})
    job = Job(
        project="triage",
        messages=[
            Message(role="system", content="P"),
            Message(role="system", content="extra"),
            Message(role="user", content="q"),
            Message(role="system", content="late"),
        ],
    )
    assert [m.content for m in stable_prefix(cfg.projects["triage"], job)] == ["P", "extra"]
    assert prefix_warning(1072, 1072) is None
    assert "about 10 tokens" in (prefix_warning(10, 1072, exact=False) or "")


def test_prefix_command_prints_the_report(
    tmp_path: Path, redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    config = (
        f'broker_url = "{redis_url}"\nkey_prefix = "{key_prefix}"\n'
        f'[backend]\nurl = "http://127.0.0.1:{dead_port}"\n'
        '[projects.translate]\nsecret = "demo-secret-translate"\n'
        'system_prompt = "Translate faithfully."\n'
    )
    path = tmp_path / "fleet.toml"
    path.write_text(config, encoding="utf-8")
    monkeypatch.setenv("FLEET_CONFIG", str(path))
    app = typer.Typer()
    app.command("prefix")(prefix_command)
    app.command("other")(lambda: None)  # two commands, so "prefix" is a subcommand as in the CLI
    result = CliRunner().invoke(app, ["prefix", "translate"])
    assert result.exit_code == 0, result.output
    assert "stable prefix of project translate" in result.output
    assert "(estimate)" in result.output and "shorter than one KV block" in result.output
    unknown = CliRunner().invoke(app, ["prefix", "nope"])
    assert unknown.exit_code == 2 and "unknown project" in unknown.output
