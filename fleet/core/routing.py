"""Which backends a job or gateway request may run on, by the model it names and its size
(docs/backends.md).

A job names a model (``Job.model``), else its project's default (``projects.<name>.model``), else it
runs on the first backend's ``model``. The model must be one some backend serves (any name of its
``served_model_names``); a name no backend serves is refused (``UnknownModel``, E_INPUT_INVALID,
naming the model and the ones served). Prep prepares (and trims) a job against the largest
backend of its model (``route``); ``eligible`` then names every backend of that model that holds
its prompt plus output limit, leaving out a long-context tier (``only_unfit_elsewhere``) when
another holds it: the bit mask the dispatcher store keeps as the job's eligibility class. Which of
those a grant lands on (health, room, load) the admission script decides
(schedulers/policy/placement.py).
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
    """The backend a request naming ``asked`` (or none) is prepared against: of the backends
    serving its model, the one with the largest ``max_model_len`` (the first of equals), so prep
    trims only what no backend of that model could hold; ``UnknownModel`` if none serves it."""
    model = model_asked(settings, project, asked)
    serving = backends_serving(settings, model)
    if not serving:
        served = ", ".join(settings.served_models())
        raise UnknownModel(f"model: no backend serves {model!r} (served: {served})", param="model")
    return max(serving, key=lambda entry: entry.max_model_len)  # max keeps the first of equals


def counting_backend(settings: Settings, project: ProjectSettings | None, asked: str | None) -> BackendSettings:
    """The backend whose ``/tokenize`` counts a job's prompt: the first serving its model that is
    not a long-context tier (the same model's tokenizer; the tier need not carry every job's
    preparation), else ``route``'s."""
    model = model_asked(settings, project, asked)
    general = [entry for entry in backends_serving(settings, model) if not entry.only_unfit_elsewhere]
    return general[0] if general else route(settings, project, asked)


def job_eligible(settings: Settings, project: str, model: str | None, need_tokens: int) -> int:
    """``eligible`` for a job of ``project`` that names ``model`` (or none): a continuation's
    mask once its prompt grew (READMIT and GROW take it)."""
    return eligible(settings, model_asked(settings, settings.projects.get(project), model), need_tokens)


def eligible(settings: Settings, model: str, need_tokens: int) -> int:
    """The backends a job of ``model`` needing ``need_tokens`` (prompt + output limit) may run on,
    as a bit mask in the settings' order (bit i: ``settings.backends[i]``; the dispatcher store's
    eligibility class): those serving the model whose ``max_model_len`` holds it, without the
    ``only_unfit_elsewhere`` ones when any other is among them. A job no backend holds gets the
    largest one's bit (prep has trimmed it to that one; a turn checks its prompt again)."""
    entries = settings.backends
    fits = [i for i, entry in enumerate(entries)
            if model in entry.served_models and entry.max_model_len >= need_tokens]
    general = [i for i in fits if not entries[i].only_unfit_elsewhere]
    chosen = general or fits
    if not chosen:
        serving = [i for i, entry in enumerate(entries) if model in entry.served_models] or [0]
        chosen = [max(serving, key=lambda i: entries[i].max_model_len)]
    return sum(1 << i for i in chosen)
