"""What a running vLLM says about itself, beside what ``[backend]`` says it is.

``read_server`` asks ``GET /v1/models`` (``max_model_len``, every served model name) and
``GET /metrics`` for the info gauge ``vllm:cache_config_info``, whose labels are every field of
vLLM's CacheConfig as text ("None" when unset): ``block_size``, ``num_gpu_blocks``,
``cache_dtype``, ``enable_prefix_caching``, and in newer releases ``kv_cache_size_tokens`` (the
pool in tokens, counted per KV cache group, which is right for hybrid models where
``num_gpu_blocks x block_size`` is not). ``disagreements`` compares the reading with the settings
and ``model_disagreement`` names a ``backend.model`` the server does not serve; ``fleet plan
--server`` prints both, and ``ServerCheck`` runs the comparison in the dispatcher's scraper when it
starts and whenever the backend comes back after being unhealthy (a restarted server may have come
up with other flags).

A disagreement is logged as an error; with ``admission.on_server_mismatch = "refuse"`` the check
also yields the hold ``server_mismatch``, which the scraper stores as the backend verdict, so every
dispatcher stops admitting until a later check agrees.

vLLM's chunked-prefill flags (``--max-num-partial-prefills``, ``--max-long-partial-prefills``,
``--long-prefill-token-threshold``) are scheduler settings, and vLLM's ``/metrics`` carries only
its CacheConfig: they are read from any ``*_info`` gauge whose labels name them (a proxy in front,
a release that exports its SchedulerConfig), compared like the rest when found, and otherwise
shown as not exposed (``fleet plan --server``): then ``[backend]`` is all the fleet knows of them.

Failure cases: the server unreachable or answering an error raises ``UpstreamUnavailable``
(E_UPSTREAM_UNAVAILABLE); a ``/metrics`` without ``vllm:cache_config_info`` (an older vLLM, or a
proxy in front) leaves those figures unknown and they are not compared; unparsable exposition text
raises ``UpstreamError``. ``ServerCheck`` logs a failed read once per outage and tries again on
the next healthy scrape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from fleet.core.config import BackendSettings, Settings
from fleet.core.errors import ConfigError, UpstreamError, UpstreamUnavailable

log = logging.getLogger(__name__)

CACHE_CONFIG_INFO = "vllm:cache_config_info"
HOLD = "server_mismatch"
# [backend].kv_pool_tokens is usually a rounded reading of the start log ("about 530K"), so a pool
# within this share of the server's agrees; block size and max_model_len must match exactly.
POOL_TOLERANCE = 0.02


@dataclass(frozen=True)
class ServerInfo:
    model: str
    max_model_len: int | None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    pool_tokens: int | None = None
    cache_dtype: str | None = None
    prefix_caching: bool | None = None
    partial_prefills: dict[str, int] | None = None  # PARTIAL_PREFILL_FLAGS found, by name
    served: tuple[str, ...] = ()  # the ids of /v1/models: its --served-model-name list


def _int(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(float(labels.get(key, "None")))
    except ValueError:  # "None": not set on this server
        return None


PARTIAL_PREFILL_FLAGS = ("max_num_partial_prefills", "max_long_partial_prefills",
                         "long_prefill_token_threshold")


def partial_prefill_flags(metrics_text: str) -> dict[str, int] | None:
    """The chunked-prefill flags from the labels of any ``*_info`` sample naming one (None: none)."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if not sample.name.endswith("_info"):
                continue
            found = {k: v for k in PARTIAL_PREFILL_FLAGS if (v := _int(sample.labels, k)) is not None}
            if found:
                return found
    return None


def cache_config_labels(metrics_text: str) -> dict[str, str] | None:
    """The labels of the first ``vllm:cache_config_info`` sample, or None when there is none."""
    try:
        for family in text_string_to_metric_families(metrics_text):
            for sample in family.samples:
                if sample.name == CACHE_CONFIG_INFO:
                    return dict(sample.labels)
    except ValueError as exc:
        raise UpstreamError(f"/metrics is not Prometheus exposition text: {exc}") from exc
    return None


def server_info_from(models: dict[str, object], metrics_text: str) -> ServerInfo:
    data = models.get("data")
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    max_len = first.get("max_model_len")
    served = tuple(str(card["id"]) for card in data if isinstance(card, dict) and "id" in card) if (
        isinstance(data, list)) else ()
    info = ServerInfo(model=str(first.get("id", "")), max_model_len=max_len if isinstance(max_len, int) else None)
    labels = cache_config_labels(metrics_text)
    flags = partial_prefill_flags(metrics_text)
    if labels is None:
        return ServerInfo(model=info.model, max_model_len=info.max_model_len, partial_prefills=flags,
                          served=served)
    block, blocks = _int(labels, "block_size"), _int(labels, "num_gpu_blocks")
    pool = _int(labels, "kv_cache_size_tokens")
    if pool is None and block is not None and blocks is not None:
        pool = block * blocks
    prefix = labels.get("enable_prefix_caching")
    return ServerInfo(
        model=info.model,
        max_model_len=info.max_model_len,
        block_size=block,
        num_gpu_blocks=blocks,
        pool_tokens=pool,
        cache_dtype=labels.get("cache_dtype"),
        prefix_caching=None if prefix is None else prefix == "True",
        partial_prefills=flags,
        served=served,
    )


def read_server(http: httpx.Client) -> ServerInfo:
    """One reading; ``http`` has the server's base URL (and auth) configured."""
    try:
        models = http.get("/v1/models")
        models.raise_for_status()
        metrics = http.get("/metrics")
        metrics.raise_for_status()
        body = models.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise UpstreamUnavailable(f"cannot read the server's /v1/models and /metrics: {exc!r}") from exc
    if not isinstance(body, dict):
        raise UpstreamError("/v1/models did not answer a JSON object")
    return server_info_from(body, metrics.text)


def disagreements(backend: BackendSettings, info: ServerInfo) -> list[str]:
    """One line per figure of ``[backend]`` the server contradicts (unknown figures are skipped)."""
    out = []
    if info.max_model_len is not None and info.max_model_len != backend.max_model_len:
        out.append(f"max_model_len: fleet.toml {backend.max_model_len}, server {info.max_model_len}")
    if info.block_size is not None and info.block_size != backend.block_tokens:
        out.append(f"block_tokens: fleet.toml {backend.block_tokens}, server block_size {info.block_size}")
    if info.pool_tokens is not None and abs(backend.kv_pool_tokens - info.pool_tokens) > (
        POOL_TOLERANCE * info.pool_tokens
    ):
        out.append(f"kv_pool_tokens: fleet.toml {backend.kv_pool_tokens}, server {info.pool_tokens}")
    for name, value in (info.partial_prefills or {}).items():
        if getattr(backend, name) != value:
            out.append(f"{name}: fleet.toml {getattr(backend, name)}, server {value}")
    return out


def model_disagreement(backend: BackendSettings, info: ServerInfo) -> list[str]:
    """The line for a ``backend.model`` the server does not serve (every request would be 404)."""
    if not info.served or backend.model in info.served:
        return []
    return [f"model: fleet.toml sends {backend.model!r}, the server serves {', '.join(info.served)} "
            "(its --served-model-name)"]


class ServerCheck:
    """The comparison as the dispatcher's scraper runs it: at start and after every outage."""

    def __init__(self, settings: Settings) -> None:
        self.backend = settings.backend
        # how the log lines name it: [backend] alone, or the entry with several
        self.label = "[backend]" if len(settings.backends) == 1 else f"backend {settings.backend.name}"
        self.refuse = settings.admission.on_server_mismatch == "refuse"
        self.hold = ""
        self._due = True
        self._failure_logged = False

    def after_scrape(self, healthy: bool, http: httpx.Client) -> str:
        """The hold this check adds to the verdict of a scrape ("" or ``server_mismatch``)."""
        if not healthy:
            self._due = True
            return self.hold
        if self._due:
            self.run(http)
        return self.hold

    def check_once(self, http: httpx.Client) -> None:
        """The check of a dispatcher without a scraper (``backend_gate`` off): nothing could hold
        its admissions later, so refusing means not starting (``ConfigError``)."""
        with http:
            found = self.run(http)
        if found and self.refuse:
            raise ConfigError("[backend] disagrees with the server (admission.on_server_mismatch = "
                              f"'refuse'): {'; '.join(found)}")

    def run(self, http: httpx.Client) -> list[str]:
        try:
            info = read_server(http)
        except UpstreamError as exc:
            if not self._failure_logged:
                log.warning("server check: %s; trying again on the next scrape", exc.message)
                self._failure_logged = True
            return []
        self._due, self._failure_logged = False, False
        found = model_disagreement(self.backend, info) + disagreements(self.backend, info)
        for line in found:
            log.error("server check: %s disagrees with the server at %s: %s%s",
                      self.label, http.base_url, line, " - admissions held" if self.refuse else "")
        if not found:
            log.info("server check: %s agrees with the server (block %s, pool %s, max_model_len %s)",
                     self.label, info.block_size, info.pool_tokens, info.max_model_len)
        self.hold = HOLD if found and self.refuse else ""
        return found
