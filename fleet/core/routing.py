"""Which backend a job or gateway request runs on, by the model it names (docs/backends.md).

A job names a model (``Job.model``), else its project's default (``projects.<name>.model``), else it
runs on the backend's own ``model``. The model must be one some backend serves (any name of its
``served_model_names``); a name no backend serves is refused (``UnknownModel``, E_INPUT_INVALID,
naming the model and the ones served). The fleet admits into one backend today (a config with
several is refused at load), so the backend found is always that one; what routing across
several will add (fit, cached prefix, load, health) is docs/backends.md's design.
"""

from __future__ import annotations

from fleet.core.config import BackendSettings, ProjectSettings, Settings
from fleet.core.errors import InputInvalid


class UnknownModel(InputInvalid):
    """A model no configured backend serves."""


def model_asked(settings: Settings, project: ProjectSettings | None, asked: str | None) -> str:
    """The model a request runs on: its own, else the project's default, else the backend's."""
    if asked:
        return asked
    if project is not None and project.model is not None:
        return project.model
    return settings.backends[0].model


def backends_serving(settings: Settings, model: str) -> list[BackendSettings]:
    """The backends that answer to ``model``, in the order of the settings."""
    return [entry for entry in settings.backends if model in entry.served_models]


def route(settings: Settings, project: ProjectSettings | None, asked: str | None) -> BackendSettings:
    """The backend for a request naming ``asked`` (or none); ``UnknownModel`` if none serves it."""
    model = model_asked(settings, project, asked)
    serving = backends_serving(settings, model)
    if not serving:
        served = ", ".join(settings.served_models())
        raise UnknownModel(f"model: no backend serves {model!r} (served: {served})", param="model")
    return serving[0]
