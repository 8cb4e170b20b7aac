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
    path = tmp_path / "fleet.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as caught:
        load_settings(path, env={})
    assert named in str(caught.value)


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


def test_readme_configuration_reference_is_generated_from_the_models():
    from fleet.core.config import reference_markdown

    readme = (Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    assert reference_markdown() in readme, "README config table is stale: fleet config --reference"
