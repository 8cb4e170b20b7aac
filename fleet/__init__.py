"""fleet: a Celery + Redis worker fleet in front of a self-hosted vLLM reasoning model."""

from fleet.core.codes import Code
from fleet.core.models import Envelope, Job, Message, Source

__all__ = ["Client", "Code", "Envelope", "Job", "Message", "Source"]


def __getattr__(name: str):  # lazy: importing fleet must not import Celery
    if name == "Client":
        from fleet.client import Client

        return Client
    raise AttributeError(name)
