"""Settings: read in exactly one place, typed, units in the names, unknown keys rejected.

Where they come from, later wins:
  1. the defaults below (the deployment of docs/deployment.md);
  2. ``fleet.toml``: the file named by ``FLEET_CONFIG``, else ``./fleet.toml``, else the example
     shipped in the package (``fleet/core/example.toml``, five demo projects);
  3. ``FLEET_*`` environment variables. Top-level keys are ``FLEET_<KEY>`` (``FLEET_BROKER_URL``);
     keys of a section are ``FLEET_<SECTION>_<KEY>`` (``FLEET_BACKEND_URL``,
     ``FLEET_ADMISSION_LEASE_TTL_S``). ``FLEET_PROJECTS`` takes JSON.

An unknown key (in the file or as a ``FLEET_*`` variable) or a bad value raises ``ConfigError``
naming the key, e.g. ``backend.max_num_seqs: Input should be greater than 0``.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tomllib
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    IPvAnyNetwork,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from pydantic_settings.sources.utils import parse_env_vars

from fleet.core.apikeys import parse_entry
from fleet.core.errors import ConfigError
from fleet.core.redisconn import DEFAULT_MASTER_NAME, is_sentinel, parse_sentinel_url
from fleet.core.schema import check_pattern, check_schema

log = logging.getLogger(__name__)

EXAMPLE_CONFIG = Path(__file__).with_name("example.toml")
ENV_PREFIX = "FLEET_"
# Variables with the prefix that are not settings keys (FLEET_LOCAL_BROKER: fleet/core/exposure.py;
# FLEET_BENCH_REDIS_URL: the Redis a ``fleet bench`` run uses, fleet/bench/__init__.py).
_ENV_NOT_SETTINGS = {"FLEET_CONFIG", "FLEET_LOCAL_BROKER", "FLEET_BENCH_REDIS_URL"}
# The variables ``load_settings`` was given, for the environment source of the Settings being built
# in this thread; os.environ is never written, so other threads never see them.
_GIVEN_ENV: ContextVar[Mapping[str, str] | None] = ContextVar("fleet_given_env", default=None)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


MAX_BACKENDS = 32  # [[backends]] entries at most


class BackendSettings(_Section):
    """One vLLM OpenAI-compatible server. Defaults are docs/deployment.md's server. ``[backend]``
    is the one server of a fleet; a ``[[backends]]`` entry takes the same keys (docs/backends.md)."""

    name: str = Field("default", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """Name of the server in the fleet (logs, plans; later metrics labels and keys): letters,
    digits, ``_``, ``.`` or ``-``, unique among [[backends]]."""
    url: str = "http://127.0.0.1:8100"
    """Base URL of the vLLM OpenAI-compatible server (no /v1)."""
    model: str = "local"
    """The model name the fleet's requests to the server carry: the server's (first)
    --served-model-name; with served_model_names set and this left out, their first."""
    served_model_names: list[str] = Field(default_factory=list)
    """Every name the server answers to (vLLM's --served-model-name takes several, the first is the
    one its responses carry); empty: just ``model``. Jobs and gateway requests may name any of
    them; ``model`` must be one of them."""
    charge_per_token: float = Field(1.0, gt=0)
    """Fair-share tokens one token run on this server counts for (docs/backends.md, section 5):
    1.0 counts every backend's tokens alike; a small model's server set to its GPU time per token
    over the big model's leaves a project that sends its cheap steps there more of its share."""
    only_unfit_elsewhere: bool = False
    """Take only jobs no other backend can hold (prompt + output limit past their max_model_len,
    or a model only this one serves): a long-context tier whose short-prompt quality is worse.
    With one backend (all the fleet admits into today) no other can hold anything, so it takes
    every job either way; it steers routing once several are built (docs/backends.md)."""
    api_key: str = ""
    """Bearer token for the server, if it was started with --api-key."""
    max_num_seqs: int = Field(32, gt=0)
    """The server's --max-num-seqs: never more requests in flight than this."""
    max_model_len: int = Field(262_144, gt=0)
    """The server's --max-model-len: prompt + max_tokens must fit."""
    max_num_batched_tokens: int = Field(2048, gt=0)
    """The server's --max-num-batched-tokens (prefill chunk per step)."""
    kv_pool_tokens: int = Field(530_000, gt=0)
    """KV cache pool of the server in tokens (the deployment's: about 530K)."""
    block_tokens: int = Field(1072, gt=0)
    """KV block size in tokens (1,072 on the hybrid Qwen3-Next deployment)."""
    long_prompt_tokens: int = Field(32_768, gt=0)
    """A prompt above this many tokens counts as long."""
    max_long: int = Field(3, ge=1)
    """At most this many long prompts in flight at once."""
    prefill_tokens_per_s: float = Field(8_000.0, gt=0)
    """The server's prefill throughput, prompt tokens/s (about 8,000 on the deployment): how long
    a long prompt's prefill keeps every sequence beside it slow (admission.quiet_long_prefill)."""
    max_num_partial_prefills: int = Field(1, ge=1)
    """The server's --max-num-partial-prefills (vLLM's default 1: one prompt prefills at a time)."""
    max_long_partial_prefills: int = Field(1, ge=1)
    """The server's --max-long-partial-prefills (vLLM's default 1): long prompts prefilling side by
    side when max_num_partial_prefills > 1; so many long prefills may share one quiet window
    (admission.quiet_long_prefill)."""
    prefix_cache_s: float = Field(600.0, ge=0)
    """How long the fleet counts a prompt a project sent as still in the server's prefix cache
    (the uncached-token estimate of fleet/prep/cachehint.py; 0: never, every prompt counts whole)."""
    long_prefill_token_threshold: int = Field(0, ge=0)
    """The server's --long-prefill-token-threshold (vLLM's default 0: 4% of max_model_len when
    max_num_partial_prefills > 1); checked against the server by fleet plan, not used in admission."""

    @model_validator(mode="before")
    @classmethod
    def _model_from_names(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("served_model_names") and "model" not in data:
            return {**data, "model": data["served_model_names"][0]}
        return data

    @field_validator("served_model_names")
    @classmethod
    def _names_given(cls, value: list[str]) -> list[str]:
        if any(not name.strip() for name in value):
            raise ValueError("a served model name must not be empty")
        if len(set(value)) != len(value):
            raise ValueError("names a model twice")
        return value

    @model_validator(mode="after")
    def _model_is_served(self) -> BackendSettings:
        if self.served_model_names and self.model not in self.served_model_names:
            raise ValueError(f"model {self.model!r} is not one of served_model_names")
        return self

    @property
    def served_models(self) -> tuple[str, ...]:
        """The names the server answers to, ``model`` first."""
        rest = [name for name in self.served_model_names if name != self.model]
        return (self.model, *rest)


class AdmissionSettings(_Section):
    """Rate shaping in front of the backend (see schedulers/policy/limits.py)."""

    kv_overcommit: float = Field(1.5, gt=0)
    """Reserved KV (whole blocks of prompt + max_tokens) may reach pool x this; vLLM allocates lazily."""
    prefill_tokens_per_s: float = Field(60_000.0, gt=0)
    """Token bucket rate on admitted prompt tokens (prefill pacing)."""
    prefill_burst_tokens: int = Field(262_144, gt=0)
    """Token bucket size; a bigger prompt waits for a full bucket."""
    min_spacing_ms: float = Field(0.0, ge=0)
    """Minimum time between two admissions."""
    lease_ttl_s: float = Field(30.0, gt=0)
    """Lease lifetime; the worker renews every third of it; an expired lease re-queues the job."""
    scrape_interval_s: float = Field(1.0, gt=0)
    """How often a dispatcher scrapes the backend's /metrics and /health."""
    scrape_stale_s: float = Field(5.0, gt=0)
    """A scrape older than this holds admissions."""
    hold_on_waiting: bool = True
    """Hold admissions while vLLM reports waiting requests (two scrapes in a row)."""
    kv_usage_hold: float = Field(0.95, gt=0, le=1)
    """Hold admissions while vLLM's kv_cache_usage_perc is above this."""
    aging_s: float = Field(60.0, gt=0)
    """Waiting this long lifts a batch job into the interactive tier (no starvation)."""
    metrics_port: int = Field(9810, ge=0, le=65535)
    """Port of the dispatcher's Prometheus /metrics (0 = off). If another dispatcher on the host
    holds it, this one logs a warning and runs on without /metrics (the shared figures are the same)."""
    quiet_long_prefill: bool = True
    """While interactive work (the interactive band) is in flight or waiting, a long prefill (a
    prompt whose tokens expected to miss the prefix cache are above backend.long_prompt_tokens) is
    admitted only while at most short_beside_long_prefill short sequences are in flight (unless
    that drain costs more than it saves: short_job_s), and nothing but further long prefills (up
    to the server's max_long_partial_prefills) is admitted while the prefills run (uncached tokens
    / backend.prefill_tokens_per_s): a long prefill slows every sequence decoding beside it
    several fold. Batch work alone is never held for it. A long prompt kept waiting reserves its
    turn after hol_bypass_s, so it is not starved."""
    short_beside_long_prefill: int = Field(2, ge=0)
    """Short sequences in flight at most when a long prompt is admitted (quiet_long_prefill)."""
    short_job_s: float = Field(60.0, ge=0)
    """How long a short job runs at the backend, seconds (a typical one: about 1,000 reasoning and
    answer tokens at ~19 tok/s with 32 running). The drain before a long prefill is skipped when
    it would leave more slot-seconds idle than the prefill costs the short sequences beside it:
    (S - b)^2 x short_job_s / 2S against S x uncached tokens / backend.prefill_tokens_per_s (S
    short sequences in flight, b short_beside_long_prefill). 0: always drain."""
    hol_bypass_s: float = Field(10.0, ge=0)
    """How long smaller jobs may pass the first job in fair order while it does not fit the KV
    budget or the prefill bucket; after that everyone waits for it."""
    locality_lookahead: int = Field(1, ge=1, le=32)
    """How many of each queue's first jobs admission looks at: above 1, a queue offers the one of
    them whose cached prompt tokens are the most still expected in the server's prefix cache
    (ties: the first in line), not its first. Which project goes next and what each is charged do
    not change; a job can be passed only by later jobs of its own queue (docs/backends.md,
    section 6). 1: the first in line (off)."""
    locality_max_wait_s: float = Field(0.0, ge=0)
    """With locality_lookahead above 1: a queue whose first job has waited this long offers it,
    cached or not (a bound on the wait locality adds). 0: no bound."""
    max_wait_s: float = Field(1.0, gt=0, le=4)
    """Longest blocking wait of an idle dispatcher (wake-ups are events; this is a safety net).
    At most 4: the wait is a BLPOP, and redis-py 8's default 5 s socket timeout would cut a
    longer one with a TimeoutError."""
    worker_gate: bool = True
    """Hold admissions while no live inference worker consumes fleet.infer (worker heartbeats in
    Redis; fleet/worker/heartbeat.py). Turn off only for a fleet whose only door is the gateway."""
    backend_gate: bool = True
    """Scrape the backend's /metrics and /health and hold admissions when it is saturated."""
    on_server_mismatch: Literal["warn", "refuse"] = "warn"
    """What a dispatcher does when the server's block size, KV pool or max_model_len (read at start
    and whenever the backend comes back) disagree with [backend]: "warn" logs an error and goes
    on; "refuse" holds every admission until they agree (schedulers/serverinfo.py)."""


class TimeoutSettings(_Section):
    connect_s: float = Field(5.0, gt=0)
    """Connecting to the backend (E_CONNECT_TIMEOUT)."""
    first_token_s: float = Field(300.0, gt=0)
    """Request sent to first reasoning/content token (E_FIRST_TOKEN_TIMEOUT)."""
    idle_s: float = Field(120.0, gt=0)
    """Longest silence between two stream events (E_STREAM_STALLED)."""
    attempt_s: float = Field(3600.0, gt=0)
    """Whole attempt (E_UPSTREAM_TIMEOUT)."""


class RetrySettings(_Section):
    max_attempts: int = Field(3, ge=1)
    """Attempts per job in all (first + retries)."""
    backoff_base_s: float = Field(1.0, ge=0)
    """Full-jitter backoff: wait U(0, min(max, base x 2^(n-1)))."""
    backoff_max_s: float = Field(30.0, ge=0)
    """Cap of the backoff."""
    budget_ratio: float = Field(0.2, ge=0)
    """Retries may add at most this share of a project's first attempts."""
    thinking_budget_ceiling: int = Field(32_768, gt=0)
    """Adaptive retries never raise the thinking budget above this."""
    reask_invalid: int = Field(1, ge=0)
    """Re-asks with the validation error before E_OUTPUT_INVALID."""
    max_outage_returns: int = Field(10, ge=0)
    """Times a job goes back in line because the backend was unavailable, before it ends with
    that error (outage returns count apart from max_attempts and the retry budget)."""
    max_cut_returns: int = Field(3, ge=0)
    """Of those, times a backend may fail under the job's own request (its stream was open when
    the engine failed or went away) before the job ends with that error: a job that brings
    servers down is sent at most 1 + this many times. A job's first cut takes no retry-budget
    token (a crash cuts every job in flight, and the others' projects are not charged for it);
    each later one takes one from its project's, so a project's crashing jobs are bounded by its
    budget too."""


class WatcherSettings(_Section):
    """Loop watcher thresholds (fleet/infer/loopwatch.py); defaults never cut normal reasoning."""

    enabled: bool = True
    """Watch reasoning for loops and stalls."""
    min_period_chars: int = Field(8, gt=0)
    """Shortest repeating period looked for."""
    max_period_chars: int = Field(2048, gt=0)
    """Longest repeating period looked for (~512 tokens)."""
    min_repeats: int = Field(3, ge=2)
    """Repeats of a period at the tail that count as a loop."""
    min_repeat_span_chars: int = Field(600, gt=0)
    """...and the repeats must cover at least this many characters."""
    key_chars: int = Field(32, ge=4)
    """Length of the tail key searched for earlier occurrences."""
    check_every_chars: int = Field(32, ge=1)
    """Run the periodic check every this many new characters."""
    max_period_candidates: int = Field(8, ge=1)
    """Earlier occurrences of the key tried per check."""
    paragraph_jaccard: float = Field(0.75, gt=0, le=1)
    """Word-trigram Jaccard at which two paragraphs are near-duplicates."""
    similar_paragraphs: int = Field(4, ge=2)
    """This many similar paragraphs..."""
    paragraph_window: int = Field(16, ge=2)
    """...among the last this many paragraphs is a loop."""
    min_paragraph_words: int = Field(16, ge=3)
    """Shorter paragraphs are not compared."""
    drop_numbers: bool = True
    """Ignore numbers when comparing paragraphs."""
    repeat_share: float = Field(0.85, gt=0, le=1)
    """Share of the recent word k-grams already seen earlier in the reasoning that is a (template)
    loop; normal reasoning peaks at 0.76 on the real-trace corpus."""
    share_gram_words: int = Field(4, ge=2)
    """Words per k-gram for the repeated share (a kana, katakana or kanji run counts as a word)."""
    share_chunk_chars: int = Field(256, ge=16)
    """The repeated share is updated every this many characters..."""
    share_window_chunks: int = Field(16, ge=1)
    """...over the last this many updates (the recent window)."""
    share_min_grams: int = Field(300, ge=1)
    """No verdict on a recent window with fewer k-grams than this."""
    share_history_grams: int = Field(4096, ge=64)
    """The earlier reasoning is remembered as two generations of at most this many k-grams."""
    cycle_repeats: int = Field(5, ge=0)
    """A passage written this many times in a row (the first time included) is a (short-cycle)
    loop, whatever the length of the answer; 0 turns this detector off. The most repetitive of the 1,188 real
    normal traces reaches 3, generated Japanese reasoning 4 (``fleet bench loops``)."""
    cycle_passage_words: int = Field(30, ge=4)
    """The passage: the last this many word shingles..."""
    cycle_match: float = Field(0.8, gt=0, le=1)
    """...of which at least this share must have been written that often (the rest: edits)."""
    cycle_gram_words: int = Field(5, ge=1)
    """Words per shingle for the repetition count (numbers dropped, so changed numbers match)."""
    cycle_min_gap_words: int = Field(20, ge=1)
    """A shingle back within fewer words is not a new repetition (short periods: the exact
    detector's)."""
    cycle_max_gap_words: int = Field(300, ge=2)
    """A shingle back after more words starts a new count: repetitions must come in a row."""
    stall_s: float = Field(60.0, gt=0)
    """No new reasoning or content for this long is a stall."""

    @model_validator(mode="after")
    def _gaps_ordered(self) -> WatcherSettings:
        if self.cycle_min_gap_words >= self.cycle_max_gap_words:
            raise ValueError("cycle_min_gap_words must be less than cycle_max_gap_words")
        return self


class SecuritySettings(_Section):
    max_clock_skew_s: float = Field(300.0, gt=0)
    """A signed job's timestamp may be at most this far in the future of the worker's clock."""
    max_age_s: float = Field(24 * 3600.0, gt=0)
    """A signed job older than this when a prep worker picks it up is refused (a backlog or a
    prep outage shorter than this never turns genuine jobs into E_AUTH)."""
    nonce_ttl_s: float = Field(25 * 3600.0, gt=0)
    """Nonces are remembered this long; must cover max_age_s + max_clock_skew_s so that a
    replay is always either seen or too old."""
    worker_secret: str | None = Field(None, min_length=16)
    """The workers' own key (16+ characters, never given to producers): prep workers seal each
    prepared job with it and inference workers run only sealed jobs; gateways seal their
    requests' records and dispatchers check that seal before handing a grant to a gateway
    (fleet/core/seal.py). Workers, dispatchers and gateways do not start without it."""

    @model_validator(mode="after")
    def _nonce_outlives_age(self) -> SecuritySettings:
        if self.nonce_ttl_s < self.max_age_s + self.max_clock_skew_s:
            raise ValueError("nonce_ttl_s must be at least max_age_s + max_clock_skew_s")
        return self


class AclSettings(_Section):
    """``fleet acl``: the Redis users' passwords (docs/security.md); a user given none here gets a
    freshly generated one each time ``fleet acl`` runs."""

    passwords: dict[str, str] = Field(default_factory=dict)
    """Password per ACL user name (fleet-producer-<project>, fleet-worker, fleet-dispatcher,
    fleet-operator), 16+ characters; FLEET_ACL_PASSWORDS takes the same as JSON. Wins over
    password_file. Every process that reads fleet.toml learns what is written here: prefer
    password_file (acl.passwords in a fleet.toml others can read is a warning at load)."""
    password_file: Path | None = None
    """A file of "<user> <password>" lines (a line, or a word after the password, starting with #
    is a comment) that only ``fleet acl`` reads: keep the passwords in a secret store's file, mode
    600, instead of fleet.toml, and rotate by editing it."""

    @field_validator("passwords")
    @classmethod
    def _strong(cls, value: dict[str, str]) -> dict[str, str]:
        for user, password in value.items():
            problem = password_problem(password)
            if problem:
                raise ValueError(f"password of {user}: {problem}")
        return value


def password_problem(password: str) -> str:
    """Why ``password`` cannot be an ACL user's password ("" when it can)."""
    if len(password) < MIN_ACL_PASSWORD:
        return f"{len(password)} characters, at least {MIN_ACL_PASSWORD} needed"
    if any(c.isspace() for c in password):
        return "contains whitespace"
    return ""


MIN_ACL_PASSWORD = 16


class LimitsSettings(_Section):
    """Size caps on a job (fleet/core/limits.py), checked at submit and in prep before any work."""

    max_message_bytes: int = Field(4 * 1024 * 1024, gt=0)
    """The signed message as compact JSON: a 262K-token context is about 1 MB of text."""
    max_messages: int = Field(2000, gt=0)
    """Messages in one job."""
    max_metadata_bytes: int = Field(64 * 1024, gt=0)
    """The job's metadata as compact JSON (it travels with every record and envelope)."""
    max_sources: int = Field(64, gt=0)
    """Sources in one job."""
    max_source_text_bytes: int = Field(2 * 1024 * 1024, gt=0)
    """Inline text of all of a job's text sources together."""
    max_tools: int = Field(128, gt=0)
    """Tools in one job."""


class RoutingSettings(_Section):
    """How admission picks a backend for a job among those of its model that can take it
    (docs/backends.md, section 6)."""

    policy: Literal["fleet", "first_token", "least_loaded", "round_robin"] = "fleet"
    """``fleet``: the backend expected to hold the job's longest cached prefix, unless it is
    loaded past both imbalance thresholds, else the least loaded; ``first_token``: the backend
    expected to give its first token soonest, the prefill the fleet sent it and has not yet
    finished (at its prefill_tokens_per_s) plus this prompt's tokens that miss its cache there,
    with the same imbalance thresholds; ``least_loaded`` and ``round_robin`` are the benchmark's
    baselines."""
    balance_abs_seqs: int = Field(4, ge=0)
    """Load wins over the cached prefix when the prefix's backend has more than this many
    sequences in flight beyond the least loaded one ..."""
    balance_rel: float = Field(1.5, ge=1.0)
    """... and its load is above this multiple of the least loaded one's."""
    continue_cut_turns: Literal["restart", "continue"] = "restart"
    """A queue job's turn whose stream a backend cut (dropped, unavailable, an upstream error)
    after some reasoning: ``restart`` runs it again with a carry-over note of its conclusions;
    ``continue`` sends the same prompt with the reasoning so far to a backend of the same model
    (it may be another one) and the model thinks only the rest (docs/backends.md, section 7);
    with tools, the calls it then writes are read as vLLM's hermes parser reads them. A reasoning
    cut before 64 tokens, a backend whose chat template does not open ``<think>`` in its
    generation prompt, a turn that forces a tool call (``tool_choice`` required or named), a
    cut attempt that had begun writing a tool call and a prompt that changed restart instead.
    Gateway requests follow it too (``gateway.fail_over``)."""


class UsageSettings(_Section):
    """The usage ledger (fleet/core/usage.py, docs/usage.md): per project, key, model and hour."""

    retention_days: int = Field(35, gt=0, le=400)
    """How long a project's hourly usage counts are kept: the TTL of each hourly hash, set
    again at every write to it (so an hour is kept this long after its last turn ended)."""
    turn_marker_s: int = Field(86_400, gt=0)
    """How long the marker of a counted turn is kept (the SET NX that makes a count happen once,
    whatever retries resend it); a turn is counted within seconds of its end, so a day is ample."""


class CollectSettings(_Section):
    allowed_roots: list[str] = Field(default_factory=list)
    """Folders file sources may be read from (nothing outside; no symlinks followed under them)."""
    project_roots: dict[str, list[str]] = Field(default_factory=dict)
    """Per project: the only folders its file sources may be read from (instead of allowed_roots)."""
    allow_hosts: list[str] = Field(default_factory=list)
    """URL host names that may resolve to non-public addresses (loopback, private, link-local)."""
    allow_networks: list[IPvAnyNetwork] = Field(default_factory=list)
    """Non-public networks URL sources may reach anyway, e.g. "10.1.2.0/24"."""
    connect_timeout_s: float = Field(5.0, gt=0)
    """URL sources: connect timeout."""
    read_timeout_s: float = Field(15.0, gt=0)
    """URL sources: read timeout per read."""
    max_bytes: int = Field(5_000_000, gt=0)
    """A source larger than this fails (not truncated)."""
    max_redirects: int = Field(5, ge=0)
    """Redirects followed per URL source."""


class GatewaySettings(_Section):
    """``fleet gateway``: the OpenAI-compatible HTTP door into the same admission."""

    host: str = "127.0.0.1"
    """Address the gateway listens on."""
    port: int = Field(8300, ge=0, le=65535)
    """Port of the gateway (also serves /metrics); 0 = ``fleet up`` does not start one."""
    max_queue_wait_s: float = Field(30.0, gt=0)
    """A request not admitted within this long is answered 429 with Retry-After, which SDKs
    retry. 30 s: nothing is sent while a request waits, and common proxies cut a connection idle
    for 60 s; at the deployment's cap of 32 (a ~2,200-token answer at ~20 tokens/s per sequence
    holds its slot ~110 s) a slot frees every ~3.5 s, so a wait covers about eight releases."""
    keepalive_s: float = Field(5.0, gt=0)
    """How often an SSE ``: keep-alive`` comment goes out while nothing else does: while a
    ``loop_retry`` stream holds its reasoning back, and (with ``wait_keepalive``) while a
    streaming request waits for admission."""
    wait_keepalive: bool = False
    """Send keep-alive comments while a streaming request waits for admission, for proxies that
    cut idle connections. Off by default: the first comment sends the 200, so a wait that then
    ends is an error event inside it, which SDKs do not retry, instead of a 429 with
    Retry-After that they do."""
    reasoning_content: bool = False
    """Also send reasoning as ``reasoning_content``, for clients that expect vLLM's old name."""
    fail_over: int = Field(2, ge=0)
    """Times a request whose backend cut it (the stream dropped, the server went away or answered
    an upstream error) goes back through admission, to another backend of its model when there
    is one, before the client gets that error: while nothing of its answer reached the client the
    turn runs again, and a reasoning already streamed is continued where it stopped
    (``routing.continue_cut_turns = "continue"``; else the error ends the stream). 0: never."""
    reload_check_s: float = Field(1.0, gt=0)
    """How often the config file's mtime is checked for new API keys (SIGHUP reloads at once)."""
    chat_template_kwargs: list[str] = Field(default_factory=lambda: ["enable_thinking", "thinking"])
    """Keys a chat request's ``chat_template_kwargs`` may carry, each only as true or false (a
    switch of the template, never content or tools); any other key or value, or any key at all
    on a request with untrusted content, is 400 ``E_INPUT_INVALID`` (docs/gateway.md)."""
    exact_prompt_count: bool = True
    """Count each chat prompt with the backend's ``/tokenize`` (cached by content) as prep does;
    false: the character estimate, one backend round trip less per new prompt (docs/gateway.md)."""
    max_body_bytes: int = Field(8_000_000, gt=0)
    """Largest request body of /v1/chat/completions, /v1/tasks and /v1/batches, checked against Content-Length
    and counted while the body is read (413 ``E_TOO_LARGE`` above, before any parsing). The
    default holds a full 128k-token prompt even when every character is JSON-escaped."""
    broker_wait_s: float = Field(30.0, gt=0)
    """How long a task-event stream waits for a Redis that does not answer before it ends with an
    ``event: error`` carrying ``E_BROKER_UNAVAILABLE`` (a shorter outage is ridden out)."""
    files_ttl_s: int = Field(86_400, gt=0)
    """Uploaded files (/v1/files) and batches' output and error files are kept this long in
    Redis; a batch record (and its jobs' results) for its completion window
    (``batch_window_s``) and this long after."""
    max_file_bytes: int = Field(20_000_000, gt=0)
    """Largest file a project may upload (413 ``E_TOO_LARGE`` above)."""
    max_files: int = Field(100, gt=0)
    """Uploaded files a project may hold at once (within ``files_ttl_s``); an upload past it is
    413 ``E_TOO_LARGE``. A batch's output and error files are not counted (``max_batches``
    bounds them)."""
    max_batch_lines: int = Field(10_000, gt=0)
    """Most request lines in one batch's input file."""
    max_batches: int = Field(100, gt=0)
    """Batches a project may create within ``files_ttl_s``."""
    max_project_bytes: int = Field(200_000_000, gt=0)
    """Bytes of uploaded files a project may hold at once: an upload that would pass it is 413
    ``E_TOO_LARGE``; deleting files frees it. A batch's output and error files are read from its
    jobs' results, not stored again, and take none of it."""
    batch_window_s: int = Field(86_400, gt=0)
    """A batch's completion window (clients send ``"24h"``): lines not done by then are cancelled
    and the batch ends ``expired``."""
    batch_threads: int = Field(4, gt=0)
    """Threads for /v1/batches work (creating, reading, cancelling), apart from the ones chat
    requests use, so a large batch never holds up chat."""
    batch_create_stall_s: float = Field(60.0, gt=0)
    """A batch create that recorded no progress this long has died (the gateway was stopped half
    way): the next retrieve ends it, its lines not sent fail ``E_INTERNAL``, the rest go on."""
    metrics_keys: list[str] = Field(default_factory=list)
    """Keys that may read the gateway's ``/metrics``, as digests "sha256:<hex>" (``fleet keys
    mint``; Prometheus sends the key as a bearer token). ``/metrics`` shows every project's
    request counts, waits and tokens, so it answers only these keys: a project's API key, or no
    key, is 401 ``E_AUTH``; none set, ``/metrics`` is closed (docs/gateway.md)."""
    batch_calls_per_project: int = Field(2, gt=0)
    """Batch calls (create, retrieve, list, cancel, a result file's download from its first
    chunk to its last) one project may have in flight on those threads; one more is 429
    ``E_BUSY`` with ``Retry-After``, so one project can never hold every thread or queue work
    without bound. Counted per gateway process, not across the fleet: N gateway processes
    admit up to N times this many of a project's calls."""
    header_timeout_s: float = Field(10.0, gt=0)
    """A connection whose request headers are not complete this long after it opened (or after
    the first byte of a later request on a kept-alive connection) is answered 408 and closed; so
    is one still sending the body of a request already answered (a refused one), this long after
    the answer. No key is needed to hold a connection, so this bounds what anyone can."""
    idle_timeout_s: int = Field(5, gt=0)
    """A kept-alive connection with no request for this long is closed (uvicorn's
    ``timeout_keep_alive``)."""
    max_connections: int = Field(1024, gt=0)
    """Open client connections one gateway process holds; a new one past it is answered 503
    ``E_BUSY`` (Retry-After) and closed at once. Lowered at start, with a warning, where the
    process's open-file limit cannot hold it beside ``listen_backlog`` and its own files."""
    max_connections_per_address: int = Field(256, ge=0)
    """Open connections one client address may hold in one gateway process; past it a new one is
    answered 429 ``E_BUSY`` (Retry-After) and closed at once. 0 = no per-address cap: behind a
    reverse proxy every connection comes from the proxy's address, so set 0 (or at least the
    proxy's own connection limit) there and cap per client in the proxy (docs/gateway.md)."""
    listen_backlog: int = Field(512, gt=0)
    """The listen queue (connections the kernel completed, not yet accepted); also how many the
    gateway accepts in one burst before counting them."""
    connection_log_interval_s: float = Field(60.0, gt=0)
    """Connections closed by the limits above are logged the first time, then as one summary line
    per kind this often, never a line per connection."""

    @field_validator("metrics_keys")
    @classmethod
    def _metrics_digests(cls, value: list[str]) -> list[str]:
        for entry in value:
            if parse_entry(entry).band != "interactive" or entry.strip().count(":") != 1:
                raise ValueError("a metrics_keys entry is 'sha256:<64 lowercase hex>', no band")
        return value


class RedisSettings(_Section):
    """How every part reaches Redis when ``broker_url`` names Sentinels
    (``sentinel://host:port/db;sentinel://host:port``, kombu's form; fleet/core/redisconn.py), and
    what workers and dispatchers demand of the broker's Redis at start (docs/operations.md)."""

    master_name: str = Field(DEFAULT_MASTER_NAME, min_length=1)
    """The master the Sentinels monitor (``sentinel monitor <name> ...``)."""
    sentinel_password: str = ""
    """Password of the Sentinels themselves (their ``requirepass``); the master's is in broker_url."""

    on_unsafe: Literal["warn", "refuse"] = "warn"
    """A Redis without an append-only file (a restart loses queued jobs and results) or with a
    maxmemory-policy that evicts keys (jobs vanish silently): "warn" logs a WARNING and runs on,
    "refuse" does not start (E_BROKER_UNSAFE). A broker ``fleet up``/``fleet demo`` started
    itself is exempt."""


class ToolSettings(_Section):
    """A tool the fleet runs for a project's jobs (fleet/infer/tools.py)."""

    task: str = Field(min_length=1)
    """Name of the Celery task that runs it (imported by the tool workers: ``tool_imports``)."""
    description: str = ""
    """What the model is told the tool does."""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    """JSON Schema of the arguments; a call whose arguments fail it is not run."""
    queue: str | None = None
    """Celery queue of the tool's task (default: the project's tool queue, fleet.tools.<project>)."""
    timeout_s: float = Field(30.0, gt=0)
    """A call without a result after this many seconds ends E_TOOL_TIMEOUT (or goes back to the
    model, with ``on_error = "model"``)."""
    untrusted: bool = True
    """Its results are outside material: fenced, and the job's next turns go out without tools."""
    on_error: Literal["fail", "model"] = "fail"
    """A failing or timed-out call: end the job (E_TOOL_FAILED / E_TOOL_TIMEOUT) or hand the
    error to the model as the tool's result."""

    @field_validator("parameters")
    @classmethod
    def _usable_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_schema(value)
        return value

    def queue_for(self, project: str) -> str:
        return self.queue or f"fleet.tools.{project}"


class QuotaSettings(_Section):
    """What a project may spend (docs/usage.md, Quotas): enforced inside admission, so every
    dispatcher and gateway together never admit past it. Every limit 0 = none."""

    tokens_per_minute: int = Field(0, ge=0)
    """Cost (below) of the turns admitted in one UTC minute."""
    tokens_per_day: int = Field(0, ge=0)
    """Cost of the turns admitted in one UTC day."""
    tokens_per_month: int = Field(0, ge=0)
    """Cost of the turns admitted in one UTC calendar month."""
    requests_per_minute: int = Field(0, ge=0)
    """Turns (model requests) admitted in one UTC minute."""
    max_in_flight: int = Field(0, ge=0)
    """The project's turns running at once, on every backend together."""
    cost_prompt: float = Field(1.0, ge=0)
    """Cost of a prompt token that missed the prefix cache."""
    cost_cached: float = Field(1.0, ge=0)
    """Cost of a prompt token the server had cached (vLLM's ``cached_tokens``)."""
    cost_output: float = Field(1.0, ge=0)
    """Cost of an output token (reasoning and answer)."""
    over: Literal["wait", "refuse"] = "wait"
    """A turn that would pass the quota: waits in line until the window resets (keeping its
    place), or, when it is a new job or gateway request, is refused with E_QUOTA_EXCEEDED
    (gateway: 429 with Retry-After). A turn larger than a token limit is refused either way."""


class RepeatCacheSettings(_Section):
    """The project's exact-repeat cache (docs/usage.md, "Exact-repeat cache"): a gateway chat
    request or a queue job identical to an earlier one (what would go to vLLM, byte for byte but
    its request id and fence tag) is answered from the earlier answer, with no slot, no quota and
    no model turn."""

    enabled: bool = False
    """Off by default: a project opts in."""
    ttl_s: int = Field(3600, gt=0)
    """How long an answer is served again."""
    max_entries: int = Field(1000, gt=0)
    """Answers kept per project; the oldest go first."""
    max_entry_bytes: int = Field(256 * 1024, gt=0)
    """A larger answer is not kept (so a project's cache holds at most max_entries x this)."""
    sampled: bool = False
    """Serve repeats of requests that sample (temperature above 0 and no seed) too; off, only a
    request with temperature 0 or a fixed seed is served from the cache."""
    wait_s: float = Field(60.0, ge=0)
    """How long a request or queue job waits for an identical one already running to finish (no
    stampede); past it, it runs itself. A waiting queue job holds no slot and no worker."""


class ProjectSettings(_Section):
    weight: float = Field(1.0, gt=0)
    """Fair-share weight (tokens admitted are shared in proportion)."""
    model: str | None = None
    """Model a job of this project runs on when it names none; a backend must serve it. Unset:
    the backend's ``model``."""
    secret: str = Field(min_length=8)
    """HMAC secret the project's producers sign jobs with (8+ characters)."""
    thinking_budget: int = Field(8000, ge=-1)
    """Default thinking_token_budget (-1 = unlimited)."""
    content_reserve: int = Field(1024, gt=0)
    """Tokens reserved for the answer after thinking; max_tokens = budget + reserve."""
    prompt_budget_tokens: int | None = Field(None, gt=0)
    """Optional cap on prompt tokens, below what max_model_len allows."""
    allowed_tools: list[str] | None = None
    """Tool names this project may send; unset: every tool a request brings goes to the model
    (the client runs its own tools; a project with ``tools = "run"`` sends only its registry's).
    Set, it restricts them; what happens to the others is ``disallowed_tools``."""
    disallowed_tools: Literal["remove", "refuse"] = "remove"
    """A request's tools that ``allowed_tools`` does not name: removed (a warning in the task's
    warnings, the gateway's ``X-Fleet-Warnings`` header and its log), or refused
    (``E_TOOL_REJECTED`` naming the tool; the gateway answers 400)."""
    response_schema: dict[str, Any] | None = None
    """Default JSON Schema for answers (a job's own wins)."""
    min_answer_chars: int = Field(1, ge=0)
    """Text check: shortest acceptable answer."""
    max_answer_chars: int | None = Field(None, gt=0)
    """Text check: longest acceptable answer."""
    answer_pattern: str | None = None
    """Text check: a regular expression the answer must match."""
    system_prompt: str | None = None
    """Stable system prompt put first in every job (prefix-cache friendly)."""
    api_keys: list[str] = Field(default_factory=list)
    """Gateway keys of this project as digests, "sha256:<hex>[:batch]" (``fleet keys mint``)."""
    cache_group: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """vLLM prefix-cache sharing: projects naming the same group share one cache salt and so
    hit each other's cached prompts (a shared glossary); unset, the project's prompts are
    cached for itself alone. A member can confirm what another member sent (docs/security.md)."""
    tools: Literal["passthrough", "run"] = "passthrough"
    """Tool calls of the model: hand them back in the envelope (passthrough), or run the
    registered tools and continue the job (run; fleet/infer/tools.py)."""
    tool_registry: dict[str, ToolSettings] = Field(default_factory=dict)
    """Tools the fleet runs for this project (mode run), by name; allowed_tools must name them."""
    max_tool_rounds: int = Field(8, ge=1)
    """Tool rounds per job; one more call ends it E_TOOL_FAILED."""
    max_tool_calls: int = Field(8, ge=1)
    """Tool calls the fleet runs from one model turn; the calls past it (and a call that repeats
    an earlier call's id) are not run: the model is told why, as for invalid arguments."""
    tool_invalid_max: int = Field(2, ge=0)
    """Rounds with invalid calls that are answered with the validation error, before
    E_TOOL_INVALID."""
    quota: QuotaSettings = Field(default_factory=QuotaSettings)
    """Spending limits of the project (none by default)."""
    key_quotas: dict[str, QuotaSettings] = Field(default_factory=dict)
    """Spending limits of single gateway API keys, by the key's ledger name ("sha256:<first 8
    hex of its digest>", as ``fleet usage --by key`` shows it), beside the project's own:
    tokens and requests per window, the cost rates and ``over``; ``max_in_flight`` is the
    project's only. They bind the key's chat requests."""
    repeat_cache: RepeatCacheSettings = Field(default_factory=RepeatCacheSettings)
    """Answering identical gateway requests again from the first answer (off by default)."""

    @field_validator("key_quotas")
    @classmethod
    def _key_labels(cls, value: dict[str, QuotaSettings]) -> dict[str, QuotaSettings]:
        for label, quota in value.items():
            if re.fullmatch(r"sha256:[0-9a-f]{8}", label) is None:
                raise ValueError(f"key_quotas: {label!r} is not a key's name (\"sha256:\" and the first 8 "
                                 "hex digits of its digest, as fleet usage --by key shows it)")
            if quota.max_in_flight:
                raise ValueError(f"key_quotas.{label}: max_in_flight is the project's only (set it in "
                                 "its quota)")
        return value

    @field_validator("api_keys")
    @classmethod
    def _key_digests(cls, value: list[str]) -> list[str]:
        for entry in value:
            parse_entry(entry)
        return value

    @field_validator("response_schema")
    @classmethod
    def _usable_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_schema(value)
        return value

    @field_validator("answer_pattern")
    @classmethod
    def _usable_pattern(cls, value: str | None) -> str | None:
        return None if value is None else check_pattern(value)


class _GivenEnvSource(EnvSettingsSource):
    """pydantic-settings' environment source (prefix, nesting, parsing), reading a given mapping."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._given = env
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # The one hook pydantic-settings has for where the variables come from.
        return parse_env_vars(self._given, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="_",
        env_nested_max_split=1,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    broker_url: str = "redis://127.0.0.1:6379/0"
    """Redis URL shared by producers, workers and dispatchers: ``redis://host:port/db``, or
    ``sentinel://host:port/db;sentinel://host:port`` for Redis Sentinel (see [redis])."""
    key_prefix: str = "fleet:"
    """Prefix of every Redis key and Celery queue key of this fleet."""
    result_ttl_s: int = Field(7 * 24 * 3600, gt=0)
    """How long job records and final envelopes are kept."""
    events_ttl_s: int = Field(24 * 3600, gt=0)
    """How long per-job event streams are kept."""
    results_stream_maxlen: int = Field(100_000, gt=0)
    """Approximate cap of each project's results stream."""
    prep_lease_s: float = Field(60.0, gt=0)
    """A prep worker's claim on a job; renewed while it prepares, so a dead worker's job is sent
    again after at most this long (fleet/prep/watchdog.py)."""
    prep_unclaimed_s: float = Field(600.0, gt=0)
    """A submitted job no prep worker has claimed after this long is sent again (a worker that
    died holding it reserved); a deep backlog only makes harmless duplicates."""
    visibility_timeout_s: int = Field(12 * 3600, gt=0)
    """Broker redelivery of unacknowledged tasks; keep it above a whole job's inference
    (max_attempts x attempt_s). Earlier redeliveries are harmless (claims refuse duplicates),
    and dead workers are covered sooner by leases and the prep watchdog."""
    worker_metrics_port: int = Field(0, ge=0, le=65535)
    """Port of a worker's Prometheus /metrics (0 = off; threads and solo pools). Give each worker
    on a host its own (FLEET_WORKER_METRICS_PORT); a busy port is a warning, the worker runs on."""
    metrics_host: str = "127.0.0.1"
    """Address the dispatchers' and workers' /metrics listen on (``admission.metrics_port``,
    ``worker_metrics_port``). Loopback by default: the figures name every project and need no key,
    so a Prometheus on another host needs "0.0.0.0" or this host's address, and a firewall that
    lets only Prometheus in (docs/security.md)."""
    tool_imports: list[str] = Field(default_factory=list)
    """Python modules a tool worker imports: they register the Celery tasks that projects'
    ``tool_registry`` entries name (fleet/infer/tools.py)."""
    backend: BackendSettings = BackendSettings()
    backends: list[BackendSettings] = Field(default_factory=list)
    """The vLLM servers as ``[[backends]]`` entries, each with the keys of [backend]; one entry is
    the same as [backend] (give one or the other). Each has its own admission limits; fair share
    is one across all; a job runs on a backend that serves its model and fits it
    (docs/backends.md). Read back, this is always the list of backends, and ``backend`` is the
    first (``[backend]`` as the one entry)."""
    admission: AdmissionSettings = AdmissionSettings()
    timeouts: TimeoutSettings = TimeoutSettings()
    retry: RetrySettings = RetrySettings()
    watcher: WatcherSettings = WatcherSettings()
    security: SecuritySettings = SecuritySettings()
    acl: AclSettings = AclSettings()
    limits: LimitsSettings = LimitsSettings()
    collect: CollectSettings = CollectSettings()
    redis: RedisSettings = RedisSettings()
    gateway: GatewaySettings = GatewaySettings()
    usage: UsageSettings = UsageSettings()
    routing: RoutingSettings = RoutingSettings()
    projects: dict[str, ProjectSettings] = Field(default_factory=dict)

    @field_validator("broker_url")
    @classmethod
    def _broker_url_shape(cls, value: str) -> str:
        if is_sentinel(value):
            parse_sentinel_url(value)  # its ValueError names what is wrong
        return value

    @field_validator("key_prefix")
    @classmethod
    def _no_hash_tag(cls, value: str) -> str:
        # keys put a Redis Cluster hash tag right after the prefix (fleet/core/keys.py); braces in
        # the prefix would become the tag of every key instead
        if "{" in value or "}" in value:
            raise ValueError("must not contain { or }: keys carry hash tags after the prefix")
        return value

    @model_validator(mode="before")
    @classmethod
    def _one_backend(cls, data: Any) -> Any:
        """``[backend]`` and one ``[[backends]]`` entry are the same server: ``backend`` and
        ``backends[0]`` read back equal; ``FLEET_BACKEND_*`` variables override the entry."""
        if not isinstance(data, dict):
            return data
        entries = data.get("backends")
        if not entries:  # [backend] (or its defaults) is the one entry
            return {**data, "backends": [data.get("backend", {})]}
        if not isinstance(entries, list) or not entries:
            return data  # validation names what is wrong
        if len(entries) > 1:
            if data.get("backend"):
                raise ValueError(f"backend: [backend] or FLEET_BACKEND_* set beside {len(entries)} "
                                 "[[backends]] entries; with several, change an entry (FLEET_BACKENDS)")
            return {**data, "backend": entries[0]}
        entry, top = entries[0], data.get("backend", {})
        if isinstance(entry, BackendSettings):
            entry = entry.model_dump(exclude_unset=True)
        if isinstance(top, BackendSettings):
            top = top.model_dump(exclude_unset=True)
        if isinstance(entry, dict) and isinstance(top, dict):
            entry = {**entry, **top}
        return {**data, "backend": entry, "backends": [entry]}

    @field_validator("backends")
    @classmethod
    def _backends_buildable(cls, value: list[BackendSettings]) -> list[BackendSettings]:
        names = [entry.name for entry in value]
        if len(set(names)) != len(names):
            raise ValueError(f"backend names must be unique, got {', '.join(names)}")
        if len(value) > MAX_BACKENDS:  # a job's eligibility is a bit mask of them
            raise ValueError(f"{len(value)} [[backends]] entries: at most {MAX_BACKENDS}")
        return value

    @model_validator(mode="after")
    def _default_models_served(self) -> Settings:
        served = {name for entry in self.backends for name in entry.served_models}
        for name, project in self.projects.items():
            if project.model is not None and project.model not in served:
                raise ValueError(f"projects.{name}.model: no backend serves {project.model!r} "
                                 f"(served: {', '.join(sorted(served))})")
        return self

    def with_backend(self, **changes: Any) -> Settings:
        """These settings with the one backend's keys changed (``backend`` and ``backends[0]``
        alike; ``model_copy`` of ``backend`` alone would leave ``backends`` behind)."""
        backend = self.backend.model_copy(update=changes)
        return self.model_copy(update={"backend": backend, "backends": [backend]})

    def backend_named(self, name: str) -> BackendSettings:
        """The ``[[backends]]`` entry called ``name`` ('': the first); KeyError for none."""
        if not name:
            return self.backends[0]
        for entry in self.backends:
            if entry.name == name:
                return entry
        raise KeyError(f"no backend named {name!r} (configured: {', '.join(e.name for e in self.backends)})")

    def backend_bit(self, name: str) -> int:
        """Backend ``name``'s bit in an eligibility mask (fleet/core/routing.py: the entries'
        order); 0 for a name no entry has."""
        return next((1 << i for i, entry in enumerate(self.backends) if entry.name == name), 0)

    def on_backend(self, name: str) -> Settings:
        """These settings as a turn granted on backend ``name`` reads them: ``backend`` is that
        entry ('' or the first entry's name: these settings themselves). Everything downstream of
        a grant reads ``settings.backend`` (url, model, limits), so a turn streams to the backend
        its grant names. KeyError for a name no entry has."""
        entry = self.backend_named(name)
        return self if entry.name == self.backend.name else self.model_copy(update={"backend": entry})

    def served_models(self) -> list[str]:
        """Every model name some backend serves, each once, in the order of the backends."""
        return list(dict.fromkeys(name for entry in self.backends for name in entry.served_models))

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
        given = _GIVEN_ENV.get()
        if given is not None:
            env_settings = _GivenEnvSource(settings_cls, given)
        return (env_settings, init_settings)

    def project(self, name: str) -> ProjectSettings | None:
        return self.projects.get(name)


def reference_markdown() -> str:
    """docs/configuration.md's reference table, generated from the models above."""
    rows = ["| key | default | meaning |", "|---|---|---|"]

    def add(prefix: str, model: type[BaseModel]) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, _Section):
                add(f"{prefix}{name}.", annotation)
                continue
            if name == "projects":
                add("projects.<name>.", ProjectSettings)
                continue
            default = field.get_default(call_default_factory=True)
            shown = "required" if field.is_required() else f"`{default!r}`"
            meaning = " ".join((field.description or "").split())
            rows.append(f"| `{prefix}{name}` | {shown} | {meaning} |")

    add("", Settings)
    return "\n".join(rows)


def config_path(env: dict[str, str] | None = None) -> Path:
    """Which file configures this process (``FLEET_CONFIG`` > ./fleet.toml > the example)."""
    values: Mapping[str, str] = os.environ if env is None else env
    if values.get("FLEET_CONFIG"):
        return Path(values["FLEET_CONFIG"])
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


def _describe(error: ValidationError, env: Mapping[str, str]) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(root)"
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        variable = ENV_PREFIX + "_".join(str(part) for part in item["loc"][:2]).upper()
        where = f"{key} (from {variable})" if variable in env else key
        lines.append(f"{where}: {message}")
    return "; ".join(lines)


_warned_readable: set[Path] = set()


def _warn_readable_passwords(file: Path, data: dict[str, Any]) -> None:
    """One WARNING per process and file when ``acl.passwords`` is written into a config file that
    users other than its owner may read (its group, often the fleet's, or everyone): every unit
    and login that reads fleet.toml (workers, dispatchers, producers on the same host) would learn
    the operator's and every user's Redis password. ``acl.password_file`` (mode 600) or
    FLEET_ACL_PASSWORDS keep them apart."""
    acl = data.get("acl")
    if not isinstance(acl, dict) or not acl.get("passwords") or file in _warned_readable:
        return
    try:
        mode = file.stat().st_mode
    except OSError:
        return
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        _warned_readable.add(file)
        log.warning("%s holds acl.passwords and users other than its owner can read it (mode %s): "
                    "move them to acl.password_file (chmod 600, the operator's only) or "
                    "FLEET_ACL_PASSWORDS for the fleet acl run", file, stat.filemode(mode))


def load_settings(
    path: Path | str | None = None,
    env: dict[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Read the settings. ``overrides`` (nested dicts) win over the file, below the environment.

    ``env`` replaces os.environ as the source of ``FLEET_*`` variables; os.environ is only read."""
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
    _warn_readable_passwords(file, data)
    if "backend" in data and ("backends" in data or f"{ENV_PREFIX}BACKENDS" in env_map):
        raise ConfigError(f"{file}: backends: give the server as [backend] or as [[backends]] "
                          "entries (FLEET_BACKENDS), not both")
    data = _merge(data, overrides)
    token = _GIVEN_ENV.set(env_map)
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(f"{file}: {_describe(exc, env_map)}") from exc
    finally:
        _GIVEN_ENV.reset(token)
