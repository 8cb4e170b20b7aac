import os
import sys
import threading
from pathlib import Path

import pytest

from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.errors import ConfigError


def test_example_config_declares_five_weighted_projects():
    settings = load_settings(EXAMPLE_CONFIG, env={})
    assert len(settings.projects) == 5
    assert len({p.weight for p in settings.projects.values()}) > 1
    for project in settings.projects.values():
        assert project.secret and project.thinking_budget and project.content_reserve
    assert settings.backend.max_num_seqs == 32
    assert settings.backend.kv_pool_tokens == 530_000
    assert settings.backend.block_tokens == 1072


def test_environment_overrides_file():
    env = {"FLEET_BROKER_URL": "redis://elsewhere:6390/2", "FLEET_BACKEND_URL": "http://gpu:8100",
           "FLEET_BACKEND_MAX_NUM_SEQS": "16"}
    settings = load_settings(EXAMPLE_CONFIG, env=env)
    assert settings.broker_url == "redis://elsewhere:6390/2"
    assert settings.backend.url == "http://gpu:8100"
    assert settings.backend.max_num_seqs == 16


def test_fleet_config_variable_picks_the_file(tmp_path: Path):
    path = tmp_path / "other.toml"
    path.write_text('key_prefix = "other:"\n[projects.solo]\nsecret = "long-enough-secret"\n')
    settings = load_settings(env={"FLEET_CONFIG": str(path)})
    assert settings.key_prefix == "other:" and list(settings.projects) == ["solo"]


def assert_refused_naming(tmp_path: Path, toml: str, named: str) -> None:
    """Loading ``toml`` as fleet.toml is a ConfigError whose text contains ``named``."""
    path = tmp_path / "fleet.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, env={})
    assert named in str(caught.value)


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("[backend]\nmax_num_seqs = 0\n", "backend.max_num_seqs"),
        ("[backend]\nmax_num_sqes = 32\n", "backend.max_num_sqes: unknown key"),
        ("brokerurl = 'x'\n", "brokerurl: unknown key"),
        ("[projects.a]\nsecret = 'short'\n", "projects.a.secret"),
        ("[projects.a]\nsecret = 'long-enough-secret'\nweight = -1\n", "projects.a.weight"),
        ("[timeouts]\nidle_s = 'soon'\n", "timeouts.idle_s"),
        ("key_prefix = 'f{1}:'\n", "key_prefix: Value error, must not contain { or }"),
    ],
)
def test_bad_file_values_name_the_key(tmp_path: Path, toml: str, named: str):
    assert_refused_naming(tmp_path, toml, named)


def test_unknown_or_bad_environment_variables_are_named():
    with pytest.raises(ConfigError, match="FLEET_BACKEND_MAXSEQS"):
        load_settings(EXAMPLE_CONFIG, env={"FLEET_BACKEND_MAXSEQS": "3"})
    with pytest.raises(ConfigError, match="backend.max_num_seqs"):
        load_settings(EXAMPLE_CONFIG, env={"FLEET_BACKEND_MAX_NUM_SEQS": "many"})


def test_broken_toml_is_a_config_error(tmp_path: Path):
    path = tmp_path / "fleet.toml"
    path.write_text("[backend\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(path, env={})


def test_docs_configuration_reference_is_generated_from_the_models():
    from fleet.core.config import reference_markdown

    page = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert reference_markdown() in page, "docs/configuration.md is stale: fleet config --reference"



# os.putenv / os.unsetenv raise audit events; a hook that records them while `_watching` is set
# shows whether anything wrote the process environment (which every thread shares).
_env_writes: list[str] = []
_watching = threading.Event()


def _audit(event: str, args: tuple) -> None:
    if _watching.is_set() and event in ("os.putenv", "os.unsetenv"):
        _env_writes.append(event)


sys.addaudithook(_audit)


def test_given_environment_is_read_without_writing_os_environ(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_BROKER_URL", "redis://mine:6379/0")
    before = dict(os.environ)
    _env_writes.clear()
    _watching.set()
    try:
        settings = load_settings(EXAMPLE_CONFIG, env={"FLEET_BROKER_URL": "redis://given:1/0",
                                                      "FLEET_BACKEND_MAX_NUM_SEQS": "16"})
    finally:
        _watching.clear()
    assert settings.broker_url == "redis://given:1/0" and settings.backend.max_num_seqs == 16
    assert _env_writes == []
    assert dict(os.environ) == before


def test_a_concurrent_reader_of_os_environ_never_sees_the_given_values(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLEET_BROKER_URL", "redis://mine:6379/0")
    seen: set[str | None] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            seen.add(os.environ.get("FLEET_BROKER_URL"))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(30):
            assert load_settings(EXAMPLE_CONFIG, env={"FLEET_BROKER_URL": "redis://given:1/0"}
                                 ).broker_url == "redis://given:1/0"
    finally:
        stop.set()
        reader.join()
    assert seen == {"redis://mine:6379/0"}


# -- backends: [backend] is the one-entry form of [[backends]] ----------------------------------

ONE_ENTRY = ('[[backends]]\nname = "gpu-a"\nurl = "http://gpu-a:8100"\n'
             'served_model_names = ["qwen3-next", "default"]\nmax_num_seqs = 16\n')


def test_one_backends_entry_is_the_backend(tmp_path: Path):
    path = tmp_path / "fleet.toml"
    path.write_text(ONE_ENTRY)
    settings = load_settings(path, env={"FLEET_BACKEND_MAX_NUM_SEQS": "8"})
    assert settings.backends == [settings.backend]
    backend = settings.backend
    assert (backend.name, backend.url, backend.model, backend.max_num_seqs) == (
        "gpu-a", "http://gpu-a:8100", "qwen3-next", 8)  # model: the first served name; env wins
    assert backend.served_models == ("qwen3-next", "default")
    assert settings.served_models() == ["qwen3-next", "default"]
    changed = settings.with_backend(url="http://elsewhere:1")
    assert changed.backends == [changed.backend] and changed.backend.url == "http://elsewhere:1"


def test_backend_table_reads_back_as_the_one_entry():
    settings = load_settings(EXAMPLE_CONFIG, env={"FLEET_BACKEND_URL": "http://gpu:8100"})
    assert settings.backends == [settings.backend]
    assert (settings.backend.name, settings.backend.url) == ("default", "http://gpu:8100")
    assert settings.served_models() == ["local"]


SEVERAL = ('[[backends]]\nname = "a"\nurl = "http://a:1"\n\n'
           '[[backends]]\nname = "b"\nurl = "http://b:1"\nserved_model_names = ["small"]\nmax_num_seqs = 8\n')


@pytest.mark.parametrize("env", [{}, {"FLEET_BACKENDS": '[{"name": "a", "url": "http://a:1"}, {"name": "b", '
                                      '"url": "http://b:1", "served_model_names": ["small"], "max_num_seqs": 8}]'}])
def test_several_backends_read_back_in_order_with_the_first_as_backend(tmp_path: Path, env: dict):
    path = tmp_path / "fleet.toml"
    path.write_text("" if env else SEVERAL)
    settings = load_settings(path, env=env)
    assert [b.name for b in settings.backends] == ["a", "b"] and settings.backend == settings.backends[0]
    assert settings.served_models() == ["local", "small"]
    on_b = settings.on_backend("b")
    assert (on_b.backend.url, on_b.backend.max_num_seqs, on_b.backends) == ("http://b:1", 8, settings.backends)
    assert settings.on_backend("") is settings and settings.on_backend("a") is settings
    with pytest.raises(KeyError, match="no backend named 'c'"):
        settings.on_backend("c")


def test_a_backend_variable_beside_several_entries_is_refused(tmp_path: Path):
    """FLEET_BACKEND_URL names no entry when there are several: refused, not applied to one."""
    path = tmp_path / "fleet.toml"
    path.write_text(SEVERAL)
    with pytest.raises(ConfigError, match=r"FLEET_BACKEND_\* set beside 2 \[\[backends\]\] entries"):
        load_settings(path, env={"FLEET_BACKEND_URL": "http://x:1"})


def test_backends_variable_beside_a_backend_table_is_refused():
    with pytest.raises(ConfigError, match=r"backends: give the server as \[backend\] or as"):
        load_settings(EXAMPLE_CONFIG, env={"FLEET_BACKENDS": '[{"name": "a"}]'})


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ('[backend]\nurl = "http://x:1"\n\n' + ONE_ENTRY, "backends: give the server as [backend] or"),
        ('[backend]\nmodel = "m"\nserved_model_names = ["n"]\n',
         "backend: Value error, model 'm' is not one of served_model_names"),
        ('[backend]\nserved_model_names = ["n", "n"]\n',
         "backend.served_model_names: Value error, names a model twice"),
        ('[backend]\nname = "no spaces"\n', "backend.name"),
        ("[projects.p]\nsecret = 'long-enough-secret'\nmodel = 'gpt-4o'\n",
         "projects.p.model: no backend serves 'gpt-4o' (served: local)"),
    ],
)
def test_bad_backend_and_model_settings_name_the_key(tmp_path: Path, toml: str, named: str):
    assert_refused_naming(tmp_path, toml, named)
