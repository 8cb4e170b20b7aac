"""A real fleet for integration tests: simulator, dispatcher and worker as separate processes
on Redis database 15 under a private key prefix, configured by a generated fleet.toml."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import redis
import tomllib

from fleet.client import Client
from fleet.config import EXAMPLE_CONFIG, load_settings
from fleet.processes import LocalFleet

TEST_BROKER = "redis://127.0.0.1:6379/15"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def write_config(path: Path, data: dict[str, Any]) -> None:
    lines: list[str] = []
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    for name, table in tables:
        nested = {k: v for k, v in table.items() if isinstance(v, dict)}
        flat = {k: v for k, v in table.items() if not isinstance(v, dict)}
        if flat or not nested:
            lines.append(f"\n[{name}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in flat.items()]
        for sub, values in nested.items():
            lines.append(f"\n[{name}.{sub}]")
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def make_config(tmp: Path, **sections: dict[str, Any]) -> Path:
    data = tomllib.loads(EXAMPLE_CONFIG.read_text(encoding="utf-8"))
    data["broker_url"] = TEST_BROKER
    data["key_prefix"] = f"t-{uuid.uuid4().hex[:10]}:"
    data.setdefault("admission", {})["metrics_port"] = 0
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path = tmp / "fleet.toml"
    write_config(path, data)
    return path


class Harness:
    def __init__(self, config: Path, sim_speed: float = 50.0, sim_args: list[str] | None = None,
                 workers: int = 1, dispatchers: int = 1, concurrency: int = 40) -> None:
        self.settings = load_settings(config, env={})
        self.fleet = LocalFleet(self.settings, sim_speed=sim_speed, sim_args=sim_args or [],
                                workers=workers, dispatchers=dispatchers,
                                worker_concurrency=concurrency, config_path=str(config))

    def __enter__(self) -> Harness:
        self.fleet.start()
        self.backend_url = self.fleet.env["FLEET_BACKEND_URL"]
        self.settings = self.settings.model_copy(update={"backend": self.settings.backend.model_copy(
            update={"url": self.backend_url})})
        self.client = Client(self.settings)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.fleet.close()
        client = redis.Redis.from_url(TEST_BROKER)
        keys = list(client.scan_iter(match=f"{self.settings.key_prefix}*", count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start:start + 500])
        client.close()
