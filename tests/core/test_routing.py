"""Model routing on one backend (fleet/core/routing.py): the model a request runs on and the refusal
of a model no backend serves."""

import pytest

from fleet.core.codes import Code
from fleet.core.config import load_settings
from fleet.core.routing import UnknownModel, model_asked, route


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
