"""Sizing: the KV arithmetic against the deployment's own figures (docs/deployment.md, docs/sizing.md,
its config.json in tests/cli/fixtures), ``fleet plan`` as a command, and the server check against a real
``fleet sim`` process, at ``fleet plan --server`` and at dispatcher start."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from typer.testing import CliRunner

from fleet.cli.main import app
from fleet.core.codes import Code
from fleet.core.config import Settings, load_settings
from fleet.core.errors import ConfigError, InputInvalid
from fleet.core.kvplan import GIB, Layout, PlanInputs, plan_layout, recommend, shape_from_config
from fleet.sim.server import SimProcess, start_sim_process
from schedulers.dispatcher import run_dispatcher
from schedulers.serverinfo import HOLD, ServerCheck, disagreements, read_server, server_info_from
from schedulers.store import make_store
from schedulers.store.base import PendingItem
from tests.support.waiting import wait_until

CONFIG_PATH = Path(__file__).parent / "fixtures" / "qwen3-next-config.json"
CONFIG = json.loads(CONFIG_PATH.read_text(encoding="utf-8"))
SHAPE = shape_from_config(CONFIG)
FP8 = PlanInputs(kv_cache_dtype="fp8")
# The start log's "Available KV cache memory" on the tightest GPU at TP=4.
TP4_KV_GIB = 1.37
# At TP=2 x PP=2 the write-up gives the result, not the memory: "2.02x @ 262K", about 530K
# tokens; 1.52 GiB per GPU is what that pool takes at 3,072 B/token.
TP2PP2_KV_GIB = 1.52


def plan(layout: str, kv_gib: float | None = None, **inputs):
    base = PlanInputs(kv_cache_dtype="fp8", kv_memory_bytes=int(kv_gib * GIB) if kv_gib else None)
    return plan_layout(SHAPE, Layout.parse(layout), PlanInputs(**{**base.__dict__, **inputs}))


def test_bytes_per_token_and_replication() -> None:
    tp4, tp2pp2 = plan("tp4"), plan("tp2pp2")
    # 12 full-attention layers x 2 (K, V) x 1 KV head x 256 x 1 byte
    assert (tp4.full_layers, tp4.kv_heads, tp4.replication, tp4.kv_bytes_per_token) == (12, 1, 2.0, 6_144)
    assert (tp2pp2.full_layers, tp2pp2.kv_heads, tp2pp2.replication, tp2pp2.kv_bytes_per_token) == (6, 1, 1.0, 3_072)
    # bf16 at TP=1 holds both heads: the write-up's 24 KB per token
    assert plan("tp1", kv_cache_dtype="bfloat16").kv_bytes_per_token == 12 * 2 * 2 * 256 * 2


def test_more_kv_heads_make_the_layouts_equal() -> None:
    """With 8 KV heads nothing is replicated at TP=4, so PP buys no KV per GPU."""
    shape = shape_from_config({**CONFIG, "num_key_value_heads": 8})
    tp4, tp2pp2 = (plan_layout(shape, Layout.parse(x), FP8) for x in ("tp4", "tp2pp2"))
    assert tp4.replication == 1.0 and tp4.kv_bytes_per_token == tp2pp2.kv_bytes_per_token


def test_hybrid_block_grows_to_the_state_page() -> None:
    tp4, tp2pp2 = plan("tp4"), plan("tp2pp2")
    assert (tp4.block_tokens, tp2pp2.block_tokens) == (544, 1_072)
    # one page (a block over the GPU's attention layers) is ~3.3 MB either way
    assert (tp4.page_bytes, tp2pp2.page_bytes) == (544 * 6_144, 1_072 * 3_072)
    assert round(tp4.page_bytes / 1e6, 2) == 3.34 and round(tp2pp2.page_bytes / 1e6, 2) == 3.29
    # one attention layer's page holds one state page: the rule vLLM enforces
    for p in (tp4, tp2pp2):
        assert p.state_page_bytes is not None
        assert p.page_bytes // p.full_layers >= p.state_page_bytes > p.page_bytes // p.full_layers - 16 * 512


def test_pools_of_the_deployment() -> None:
    tp4, tp2pp2 = plan("tp4", TP4_KV_GIB), plan("tp2pp2", TP2PP2_KV_GIB)
    assert 235_000 < tp4.pool_tokens < 240_000  # 239K computed; vLLM's log reported 235K
    assert tp4.pool_tokens % 544 == 0
    assert 525_000 < tp2pp2.pool_tokens < 535_000 and round(tp2pp2.full_length_concurrency, 2) == 2.02
    held, share = tp4.take(4, 30_000)  # four long requests take about half the TP=4 pool
    assert held == 4 * 56 * 544 and 0.45 < share < 0.55
    assert tp4.take(4, 1) == (4 * 544, 4 * 544 / tp4.pool_tokens)  # a short sequence still holds a block


def test_pool_from_the_memory_left_after_weights() -> None:
    p = plan("tp2pp2", gpu_memory_bytes=16 * GIB, gpu_memory_utilization=0.92, weights_bytes=46 * GIB,
             overhead_bytes=GIB)
    left = 16 * GIB * 0.92 - 46 * GIB / 4 - GIB
    assert p.kv_memory_bytes == int(left) and p.pool_blocks == int(left) // p.page_bytes


def test_recommended_settings() -> None:
    rec = recommend(plan("tp2pp2", TP2PP2_KV_GIB), max_num_seqs=32)
    assert rec == {"max_num_seqs": 32, "max_model_len": 262_144, "kv_pool_tokens": 495 * 1_072,
                   "block_tokens": 1_072, "long_prompt_tokens": 32_768, "max_long": 2}
    tiny = recommend(plan("tp2pp2", 0.01), max_num_seqs=32)
    assert tiny["max_num_seqs"] == 3  # three blocks: every running sequence holds at least one


@pytest.mark.parametrize(("change", "message"), [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"linear_conv_kernel_dim": None}, "--state-page-bytes"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
])
def test_bad_configs_are_named(change: dict, message: str) -> None:
    config = {k: v for k, v in {**CONFIG, **change}.items() if v is not None}
    with pytest.raises(InputInvalid, match=message) as caught:
        plan_layout(shape_from_config(config), Layout.parse("tp4"), FP8)
    assert caught.value.code is Code.E_INPUT_INVALID


def test_bad_layouts_and_dtypes() -> None:
    for text in ("", "tp", "x4", "tp0", "tp2xpp2"):
        with pytest.raises(InputInvalid, match="layout"):
            Layout.parse(text)
    with pytest.raises(InputInvalid, match="neither divides"):
        plan_layout(SHAPE, Layout.parse("tp3"), FP8)
    with pytest.raises(InputInvalid, match="unknown dtype 'fp7'"):
        plan("tp4", kv_cache_dtype="fp7")


def test_given_state_page_is_used() -> None:
    p = plan("tp2pp2", state_page_bytes=16 * 512 * 10)
    assert p.block_tokens == 160


runner = CliRunner()


def plan_writing(toml: Path) -> list[str]:
    """``fleet plan`` of the deployment's tp2pp2 layout (fp8 KV cache) writing into ``toml``."""
    return ["plan", str(CONFIG_PATH), "--layout", "tp2pp2", "--kv-cache-dtype", "fp8",
            "--kv-memory-gib", str(TP2PP2_KV_GIB), "--write", str(toml)]


def test_plan_command_prints_and_writes(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text('# mine\nbroker_url = "redis://x:1/0"\n\n[backend]\nurl = "http://gpu:8100"\n'
                    "block_tokens = 16\n\n[retry]\nmax_attempts = 5\n", encoding="utf-8")
    args = plan_writing(toml)
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "530,640" in result.output and "1,072" in result.output
    settings = load_settings(toml, env={})
    assert (settings.backend.url, settings.backend.block_tokens, settings.backend.kv_pool_tokens) == (
        "http://gpu:8100", 1_072, 530_640)
    assert settings.retry.max_attempts == 5 and toml.read_text(encoding="utf-8").startswith("# mine\n")


def test_plan_command_refuses_bad_input(tmp_path: Path) -> None:
    result = runner.invoke(app, ["plan", str(CONFIG_PATH), "--layout", "tp4pp", "--layout", "tp2"])
    assert result.exit_code == 2 and "E_INPUT_INVALID" in result.output
    result = runner.invoke(app, ["plan", str(CONFIG_PATH), "--layout", "tp4", "--layout", "tp2",
                                 "--write", str(tmp_path / "f.toml")])
    assert result.exit_code == 2 and "exactly one --layout" in result.output
    assert not (tmp_path / "f.toml").exists()
    assert runner.invoke(app, ["plan"]).exit_code == 2


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    proc = start_sim_process(speed=50.0, log_level="warning")
    yield proc
    proc.stop()


def test_sim_publishes_cache_config_info(sim: SimProcess) -> None:
    with httpx.Client(base_url=sim.base_url) as http:
        info = read_server(http)
    assert (info.max_model_len, info.block_size, info.num_gpu_blocks) == (262_144, 1_072, 494)
    assert info.pool_tokens == 494 * 1_072 and info.cache_dtype == "fp8" and info.prefix_caching is True
    assert disagreements(Settings().backend, info) == []  # the defaults are the deployment's


def test_plan_server_beside_fleet_toml(sim: SimProcess, tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text("[backend]\nkv_pool_tokens = 239360\nblock_tokens = 544\n", encoding="utf-8")
    result = runner.invoke(app, ["plan", "--server", sim.base_url], env={"FLEET_CONFIG": str(toml)})
    assert result.exit_code == 1
    assert "529568" in result.output and "block_tokens: fleet.toml 544, server block_size 1072" in result.output
    toml.write_text("[backend]\nkv_pool_tokens = 530000\n", encoding="utf-8")
    assert runner.invoke(app, ["plan", "--server", sim.base_url], env={"FLEET_CONFIG": str(toml)}).exit_code == 0


def test_unreachable_server_is_an_upstream_error() -> None:
    result = runner.invoke(app, ["plan", "--server", "http://127.0.0.1:9"], env={"FLEET_CONFIG": ""})
    assert result.exit_code == 2 and "E_UPSTREAM_UNAVAILABLE" in result.output


def dispatcher_settings(prefix: str, url: str, mode: str, **admission) -> Settings:
    return Settings(
        key_prefix=prefix,
        backend={"url": url, "kv_pool_tokens": 1_000_000},  # the server has 529,568
        admission={"metrics_port": 0, "scrape_interval_s": 0.05, "on_server_mismatch": mode, **admission},
        projects={"a": {"secret": "secret-a-123"}},
    )


@pytest.mark.parametrize("mode", ["warn", "refuse"])
def test_misconfigured_pool_is_caught_at_dispatcher_start(
    sim: SimProcess, mode: str, redis_url: str, redis_client: redis.Redis, key_prefix: str, caplog
) -> None:
    settings = dispatcher_settings(key_prefix, sim.base_url, mode)
    store = make_store(settings, redis_client)
    stop, sent = threading.Event(), []
    client = redis.Redis.from_url(redis_url)
    caplog.set_level(logging.INFO, logger="schedulers.serverinfo")
    thread = threading.Thread(target=run_dispatcher, args=(settings, client, sent.append, stop))
    thread.start()
    try:
        assert wait_until(lambda: any("disagrees" in r.getMessage() for r in caplog.records))
        assert wait_until(lambda: store.backend().get("scraped_at") is not None)
        store.add_pending(PendingItem("j1", "a", 100, 100))
        if mode == "refuse":
            assert wait_until(lambda: store.backend().get("hold") == HOLD)
            assert store.admit_next(time.time()).hold_reason == f"backend_{HOLD}" and not sent
        else:
            assert wait_until(lambda: len(sent) == 1)
    finally:
        stop.set()
        store.wake()
        thread.join(timeout=10)
        client.close()
    errors = [r for r in caplog.records if r.levelno == logging.ERROR and "kv_pool_tokens" in r.getMessage()]
    assert len(errors) == 1  # once at start, not on every scrape


def test_check_runs_again_after_an_outage(sim: SimProcess) -> None:
    check = ServerCheck(dispatcher_settings("x:", sim.base_url, "refuse"))
    with httpx.Client(base_url=sim.base_url) as http:
        assert check.after_scrape(True, http) == HOLD
        check.backend = Settings().backend  # the operator fixed fleet.toml; the server restarts
        assert check.after_scrape(True, http) == HOLD  # no outage: not read again
        assert check.after_scrape(False, http) == HOLD
        assert check.after_scrape(True, http) == ""  # back after the outage: read again, agrees


def test_refusing_dispatcher_without_a_gate_does_not_start(sim: SimProcess, redis_url: str, key_prefix: str) -> None:
    settings = dispatcher_settings(key_prefix, sim.base_url, "refuse", backend_gate=False)
    client = redis.Redis.from_url(redis_url)
    try:
        with pytest.raises(ConfigError, match="kv_pool_tokens: fleet.toml 1000000, server 529568"):
            run_dispatcher(settings, client, lambda grant: None, stop=threading.Event())
    finally:
        client.close()


def test_partial_prefill_flags_are_compared_where_the_server_exposes_them() -> None:
    """vLLM's /metrics has only its CacheConfig: the flags stay unknown and are not compared;
    an info gauge that names them (a proxy, a release exporting its SchedulerConfig) is read."""
    models = {"data": [{"id": "m", "max_model_len": 262_144}]}
    cache = 'vllm:cache_config_info{block_size="1072",num_gpu_blocks="494"} 1.0\n'
    assert server_info_from(models, cache).partial_prefills is None
    scheduler = ('vllm:scheduler_config_info{max_num_partial_prefills="4",max_long_partial_prefills="2",'
                 'long_prefill_token_threshold="0"} 1.0\n')
    info = server_info_from(models, cache + scheduler)
    assert info.partial_prefills == {"max_num_partial_prefills": 4, "max_long_partial_prefills": 2,
                                     "long_prefill_token_threshold": 0}
    assert disagreements(Settings().backend, info) == [
        "max_num_partial_prefills: fleet.toml 1, server 4", "max_long_partial_prefills: fleet.toml 1, server 2"]
    backend = Settings(backend={"max_num_partial_prefills": 4, "max_long_partial_prefills": 2}).backend
    assert disagreements(backend, info) == []


def test_plan_server_shows_the_partial_prefill_flags_vllm_does_not_expose(sim: SimProcess, tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text("[backend]\nkv_pool_tokens = 530000\nmax_long_partial_prefills = 3\n", encoding="utf-8")
    result = runner.invoke(app, ["plan", "--server", sim.base_url], env={"FLEET_CONFIG": str(toml)})
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if "max_long_partial_prefills" in line)
    assert "not exposed" in row and "3" in row


def test_plan_checks_each_backend_entry_at_its_url(sim: SimProcess, tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text(f'[[backends]]\nname = "gpu-a"\nurl = "{sim.base_url}"\nkv_pool_tokens = 530000\n',
                    encoding="utf-8")
    result = runner.invoke(app, ["plan", "--backends"], env={"FLEET_CONFIG": str(toml)})
    assert result.exit_code == 0, result.output
    assert "gpu-a:" in result.output and "served model names" in result.output
    toml.write_text(f'[[backends]]\nname = "gpu-a"\nurl = "{sim.base_url}"\nmodel = "qwen3-next"\n',
                    encoding="utf-8")
    result = runner.invoke(app, ["plan", "--backends"], env={"FLEET_CONFIG": str(toml)})
    assert result.exit_code == 1
    assert "gpu-a: model: fleet.toml sends 'qwen3-next', the server serves local" in result.output
    result = runner.invoke(app, ["plan", "--server", sim.base_url, "--backend", "gpu-b"],
                           env={"FLEET_CONFIG": str(toml)})
    assert result.exit_code == 2 and "no backend named 'gpu-b' (configured: gpu-a)" in result.output


def test_plan_writes_the_backends_entry(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text('[[backends]]\nname = "gpu-a"\nurl = "http://gpu:8100"\nblock_tokens = 16\n\n'
                    "[retry]\nmax_attempts = 5\n", encoding="utf-8")
    args = plan_writing(toml)
    assert runner.invoke(app, [*args, "--backend", "gpu-b"]).exit_code == 2
    result = runner.invoke(app, [*args, "--backend", "gpu-a"])
    assert result.exit_code == 0, result.output
    settings = load_settings(toml, env={})
    assert (settings.backend.name, settings.backend.url, settings.backend.block_tokens,
            settings.backend.kv_pool_tokens, settings.retry.max_attempts) == (
        "gpu-a", "http://gpu:8100", 1_072, 530_640, 5)
    assert "[backend]\n" not in toml.read_text(encoding="utf-8")


def test_fleet_config_masks_every_backends_key_and_url_password(tmp_path: Path) -> None:
    toml = tmp_path / "fleet.toml"
    toml.write_text('[[backends]]\nname = "gpu-a"\nurl = "http://user:url-secret@gpu-a:8100"\n'
                    'api_key = "backend-key-secret"\n', encoding="utf-8")
    result = runner.invoke(app, ["config"], env={"FLEET_CONFIG": str(toml)})
    assert result.exit_code == 0, result.output
    assert "gpu-a" in result.output and "http://user:***@gpu-a:8100" in result.output
    assert "url-secret" not in result.output and "backend-key-secret" not in result.output


def test_server_check_holds_for_a_model_the_server_does_not_serve(sim: SimProcess) -> None:
    settings = Settings(backend={"model": "qwen3-next"}, admission={"on_server_mismatch": "refuse"})
    check = ServerCheck(settings)
    with httpx.Client(base_url=sim.base_url) as http:
        assert check.after_scrape(True, http) == HOLD
    with pytest.raises(ConfigError, match="model: fleet.toml sends 'qwen3-next', the server serves local"):
        check.check_once(httpx.Client(base_url=sim.base_url))
    agreeing = ServerCheck(Settings(admission={"on_server_mismatch": "refuse"}))
    agreeing.check_once(httpx.Client(base_url=sim.base_url))  # "local" is served: no ConfigError
    assert agreeing.hold == ""
