"""Model routing on one backend (fleet/core/routing.py): the model a request runs on and the refusal
of a model no backend serves."""

import pytest

from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.routing import UnknownModel, counting_backend, eligible, model_asked, route


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("routing") / "fleet.toml"
    path.write_text('[backend]\nserved_model_names = ["qwen3-next", "default"]\n\n'
                    '[projects.plain]\nsecret = "long-enough-secret"\n\n'
                    '[projects.aliased]\nsecret = "long-enough-secret"\nmodel = "default"\n')
    return load_settings(path, env={})


def test_the_request_the_project_then_the_backend_name_the_model(settings):
    plain, aliased = settings.projects["plain"], settings.projects["aliased"]
    assert model_asked(settings, plain, None) == "qwen3-next"
    assert model_asked(settings, aliased, None) == "default"
    assert model_asked(settings, aliased, "qwen3-next") == "qwen3-next"
    assert route(settings, aliased, None) is settings.backends[0]
    assert route(settings, plain, "default") is settings.backends[0]


def test_a_model_no_backend_serves_is_refused_naming_it(settings):
    with pytest.raises(UnknownModel) as caught:
        route(settings, settings.projects["plain"], "gpt-4o")
    assert caught.value.code == Code.E_INPUT_INVALID and caught.value.param == "model"
    assert "'gpt-4o'" in caught.value.message and "qwen3-next, default" in caught.value.message


SEVERAL = """
[[backends]]
name = "gpu-a"
served_model_names = ["qwen3-next"]
max_model_len = 262144

[[backends]]
name = "gpu-b"
served_model_names = ["qwen3-next"]
max_model_len = 262144

[[backends]]
name = "long"
served_model_names = ["qwen3-next"]
max_model_len = 524288
only_unfit_elsewhere = true

[[backends]]
name = "small"
served_model_names = ["small"]
max_model_len = 32768

[projects.plain]
secret = "long-enough-secret"
"""


@pytest.fixture(scope="module")
def several(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("routing") / "fleet.toml"
    path.write_text(SEVERAL)
    return load_settings(path, env={})


def test_a_job_is_prepared_against_the_largest_backend_of_its_model(several):
    plain = several.projects["plain"]
    assert route(several, plain, None).name == "long"  # qwen3-next: up to 524K may be held
    assert route(several, plain, "small").name == "small"
    # its prompt is counted by a general backend of the model, not by the long-context tier
    assert counting_backend(several, plain, None).name == "gpu-a"
    assert counting_backend(several, plain, "small").name == "small"


def test_a_job_may_run_on_every_backend_of_its_model_that_holds_it(several):
    """The long-context tier takes only what no other holds; another model's backend nothing."""
    assert eligible(several, "qwen3-next", 100_000) == 0b0011  # gpu-a, gpu-b; not the long tier
    assert eligible(several, "qwen3-next", 300_000) == 0b0100  # only the long tier holds it
    assert eligible(several, "small", 20_000) == 0b1000
    assert eligible(several, "small", 40_000) == 0b1000  # held by none: the largest of its model
