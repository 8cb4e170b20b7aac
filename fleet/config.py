"""Settings: read in exactly one place, typed, units in the names, unknown keys rejected.

Where they come from, later wins:
  1. the defaults below (BRIEF.md's deployment);
  2. ``fleet.toml``: the file named by ``FLEET_CONFIG``, else ``./fleet.toml``, else the example
     shipped in the package (``fleet/example.toml``, five demo projects);
  3. ``FLEET_*`` environment variables. Top-level keys are ``FLEET_<KEY>`` (``FLEET_BROKER_URL``);
     keys of a section are ``FLEET_<SECTION>_<KEY>`` (``FLEET_BACKEND_URL``,
     ``FLEET_ADMISSION_LEASE_TTL_S``). ``FLEET_PROJECTS`` takes JSON.

An unknown key (in the file or as a ``FLEET_*`` variable) or a bad value raises ``ConfigError``
naming the key, e.g. ``backend.max_num_seqs: Input should be greater than 0``.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from fleet.errors import ConfigError

EXAMPLE_CONFIG = Path(__file__).with_name("example.toml")
ENV_PREFIX = "FLEET_"
# Variables with the prefix that are not settings keys.
_ENV_NOT_SETTINGS = {"FLEET_CONFIG"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendSettings(_Section):
    """One vLLM OpenAI-compatible server. Defaults are BRIEF.md's deployment."""

    url: str = "http://127.0.0.1:8100"
    model: str = "local"
    api_key: str = ""
    max_num_seqs: int = Field(32, gt=0)
    max_model_len: int = Field(262_144, gt=0)
    max_num_batched_tokens: int = Field(2048, gt=0)
    kv_pool_tokens: int = Field(530_000, gt=0)
    block_tokens: int = Field(1072, gt=0)
    long_prompt_tokens: int = Field(32_768, gt=0)
    max_long: int = Field(3, ge=1)


class AdmissionSettings(_Section):
    """Rate shaping in front of the backend (see schedulers/limits.py)."""

    kv_overcommit: float = Field(1.5, gt=0)
    prefill_tokens_per_s: float = Field(60_000.0, gt=0)
    prefill_burst_tokens: int = Field(262_144, gt=0)
    min_spacing_ms: float = Field(0.0, ge=0)
    lease_ttl_s: float = Field(30.0, gt=0)
    scrape_interval_s: float = Field(1.0, gt=0)
    scrape_stale_s: float = Field(5.0, gt=0)
    hold_on_waiting: bool = True
    kv_usage_hold: float = Field(0.95, gt=0, le=1)
    aging_s: float = Field(60.0, gt=0)
    metrics_port: int = Field(9810, ge=0)
    # How long the first job in fair order may be passed by smaller jobs while it does not fit
    # the KV budget or the prefill bucket (schedulers/limits.py); after that everyone waits.
    hol_bypass_s: float = Field(10.0, ge=0)
    # Longest blocking wait of an idle dispatcher; wakes are event-driven, this is a safety net.
    max_wait_s: float = Field(1.0, gt=0)
    # False: no /metrics scraping and no saturation gate (a backend without /metrics, tests).
    backend_gate: bool = True


class TimeoutSettings(_Section):
    connect_s: float = Field(5.0, gt=0)
    first_token_s: float = Field(300.0, gt=0)
    idle_s: float = Field(120.0, gt=0)
    attempt_s: float = Field(3600.0, gt=0)


class RetrySettings(_Section):
    max_attempts: int = Field(3, ge=1)
    backoff_base_s: float = Field(1.0, ge=0)
    backoff_max_s: float = Field(30.0, ge=0)
    budget_ratio: float = Field(0.2, ge=0)
    thinking_budget_ceiling: int = Field(32_768, gt=0)
    reask_invalid: int = Field(1, ge=0)


class WatcherSettings(_Section):
    """Loop watcher thresholds (fleet/loopwatch.py); defaults never cut normal reasoning."""

    enabled: bool = True
    min_period_chars: int = Field(8, gt=0)
    max_period_chars: int = Field(2048, gt=0)
    min_repeats: int = Field(3, ge=2)
    min_repeat_span_chars: int = Field(600, gt=0)
    key_chars: int = Field(32, ge=4)
    check_every_chars: int = Field(32, ge=1)
    max_period_candidates: int = Field(8, ge=1)
    paragraph_jaccard: float = Field(0.75, gt=0, le=1)
    similar_paragraphs: int = Field(4, ge=2)
    paragraph_window: int = Field(16, ge=2)
    min_paragraph_words: int = Field(16, ge=3)
    drop_numbers: bool = True
    stall_s: float = Field(60.0, gt=0)


class SecuritySettings(_Section):
    max_clock_skew_s: float = Field(300.0, gt=0)
    nonce_ttl_s: float = Field(900.0, gt=0)


class CollectSettings(_Section):
    allowed_roots: list[str] = Field(default_factory=list)
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(15.0, gt=0)
    max_bytes: int = Field(5_000_000, gt=0)
    max_redirects: int = Field(5, ge=0)


class ProjectSettings(_Section):
    weight: float = Field(1.0, gt=0)
    secret: str = Field(min_length=8)
    thinking_budget: int = Field(8000, ge=-1)
    content_reserve: int = Field(1024, gt=0)
    prompt_budget_tokens: int | None = Field(None, gt=0)
    allowed_tools: list[str] = Field(default_factory=list)
    response_schema: dict[str, Any] | None = None
    min_answer_chars: int = Field(1, ge=0)
    max_answer_chars: int | None = Field(None, gt=0)
    answer_pattern: str | None = None
    system_prompt: str | None = None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="forbid",
        frozen=True,
    )

    broker_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "fleet:"
    result_ttl_s: int = Field(7 * 24 * 3600, gt=0)
    events_ttl_s: int = Field(24 * 3600, gt=0)
    results_stream_maxlen: int = Field(100_000, gt=0)
    visibility_timeout_s: int = Field(4 * 3600, gt=0)
    backend: BackendSettings = BackendSettings()
    admission: AdmissionSettings = AdmissionSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    retry: RetrySettings = RetrySettings()
    watcher: WatcherSettings = WatcherSettings()
    security: SecuritySettings = SecuritySettings()
    collect: CollectSettings = CollectSettings()
    projects: dict[str, ProjectSettings] = Field(default_factory=dict)

    @field_validator("projects")
    @classmethod
    def _project_names(cls, value: dict[str, ProjectSettings]) -> dict[str, ProjectSettings]:
        for name in value:
            if not name.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"project name {name!r} must be letters, digits, - or _")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init kwargs carry the parsed TOML file; the environment overrides it.
        return (env_settings, init_settings)

    def project(self, name: str) -> ProjectSettings | None:
        return self.projects.get(name)


def config_path(env: dict[str, str] | None = None) -> Path:
    """Which file configures this process (``FLEET_CONFIG`` > ./fleet.toml > the example)."""
    env = os.environ if env is None else env
    if env.get("FLEET_CONFIG"):
        return Path(env["FLEET_CONFIG"])
    local = Path.cwd() / "fleet.toml"
    return local if local.exists() else EXAMPLE_CONFIG


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _unknown_env_keys(env: dict[str, str]) -> list[str]:
    known = set()
    for name, field in Settings.model_fields.items():
        known.add(ENV_PREFIX + name.upper())
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            known.update(f"{ENV_PREFIX}{name.upper()}_{sub.upper()}" for sub in annotation.model_fields)
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known | _ENV_NOT_SETTINGS)


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(root)"
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{key}: {message}")
    return "; ".join(lines)


def load_settings(
    path: Path | str | None = None,
    env: dict[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Read the settings. ``overrides`` (nested dicts) win over the file, below the environment."""
    env_map = dict(os.environ) if env is None else env
    file = Path(path) if path is not None else config_path(env_map)
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"config file {file} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file} is not valid TOML: {exc}") from exc
    unknown = _unknown_env_keys(env_map)
    if unknown:
        raise ConfigError(f"unknown settings in the environment: {', '.join(unknown)}")
    data = _merge(data, overrides)
    saved = os.environ.copy()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(f"{file}: {_describe(exc)}") from exc
    finally:
        if env is not None:
            os.environ.clear()
            os.environ.update(saved)
