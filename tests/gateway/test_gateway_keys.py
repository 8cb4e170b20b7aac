"""Gateway API keys: minting, digests in the settings, the key ring and reloads (fake clock)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fleet.core.apikeys import digest, mint, parse_entry
from fleet.core.config import load_settings
from fleet.core.errors import AuthError, ConfigError
from fleet.gateway.auth import KeyRing, LiveSettings
from tests.support.fleet_harness import make_config, write_config


def with_keys(path: Path, project: str, entries: list[str]) -> None:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    data["projects"][project]["api_keys"] = entries
    write_config(path, data)


def test_a_minted_key_is_stored_as_its_digest_only() -> None:
    key, entry = mint()
    assert key.startswith("fk-") and len(key) > 40
    assert key not in entry and parse_entry(entry).digest == digest(key)
    assert parse_entry(mint("batch")[1]).band == "batch"
    with pytest.raises(ValueError):
        mint("urgent")


def test_the_key_ring_finds_the_project_and_band(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    key, entry = mint()
    batch_key, batch_entry = mint("batch")
    with_keys(config, "reports", [entry, batch_entry])
    ring = KeyRing(load_settings(config, env={}))
    caller = ring.caller(f"Bearer {key}")
    assert (caller.project, caller.band) == ("reports", "interactive")
    assert ring.caller(f"bearer {batch_key}").band == "batch"
    for header in (None, "", key, f"Basic {key}", "Bearer ", f"Bearer {key}x"):
        with pytest.raises(AuthError):
            ring.caller(header)


def test_a_malformed_entry_is_refused_at_load_naming_the_key(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with_keys(config, "triage", ["fk-plaintext-key"])
    with pytest.raises(ConfigError, match=r"projects\.triage\.api_keys"):
        load_settings(config, env={})


def test_a_reload_that_fails_keeps_the_keys_in_force(tmp_path: Path) -> None:
    config = make_config(tmp_path, gateway={"reload_check_s": 1})
    key, entry = mint()
    with_keys(config, "research", [entry])
    now = [0.0]
    live = LiveSettings(load_settings(config, env={}), config,
                        lambda path: load_settings(path, env={}), clock=lambda: now[0])
    good = config.read_text()
    config.write_text(good + "\nnot toml at all [[[\n")
    now[0] += 5
    assert live.current().caller(f"Bearer {key}").project == "research"
    new_key, new_entry = mint()
    config.write_text(good)
    with_keys(config, "research", [new_entry])
    live.request_reload()  # SIGHUP: no need to wait for the next mtime check
    assert live.current().caller(f"Bearer {new_key}").project == "research"
    with pytest.raises(AuthError):
        live.current().caller(f"Bearer {key}")


def test_fleet_keys_mint_prints_the_key_once_and_the_settings_line() -> None:
    out = subprocess.run([sys.executable, "-m", "fleet", "keys", "mint", "--project", "reports"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    key = out.split("shown once; give it to the project's client): ")[1].split()[0]
    assert f'api_keys = ["sha256:{digest(key)}"]' in out
    assert out.count(key) == 1


def test_a_reload_applies_new_keys_and_keeps_what_only_a_restart_changes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The backends, a project's weight and quota: what dispatchers, workers and gateways must
    agree on stays as it was until a restart (with a WARNING naming it); new API keys, a key's
    quota and the repeat cache take effect at once."""
    config = make_config(tmp_path, gateway={"reload_check_s": 1})
    live = LiveSettings(load_settings(config, env={}), config,
                        lambda path: load_settings(path, env={}), clock=lambda: 0.0)
    before = live.settings
    data = tomllib.loads(config.read_text(encoding="utf-8"))
    key, entry = mint()
    data["projects"]["research"]["api_keys"] = [entry]
    data["projects"]["research"]["weight"] = 7
    data["projects"]["research"]["quota"] = {"tokens_per_minute": 5000}
    data["projects"]["research"]["repeat_cache"] = {"enabled": True}
    data.setdefault("backend", {})["max_num_seqs"] = before.backend.max_num_seqs + 5
    write_config(config, data)
    live.request_reload()
    with caplog.at_level("WARNING", logger="fleet.gateway.auth"):
        assert live.current().caller(f"Bearer {key}").project == "research"
    after = live.settings
    assert after.backends == before.backends and after.backend == before.backend
    assert after.projects["research"].weight == before.projects["research"].weight
    assert after.projects["research"].quota == before.projects["research"].quota
    assert after.projects["research"].repeat_cache.enabled
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("backend", "projects.research.weight", "projects.research.quota"):
        assert name in warned
