import pytest

from fleet.config import EXAMPLE_CONFIG, load_settings
from fleet.errors import AuthError
from fleet.keys import Keys
from fleet.signing import sign, verify

JOB = {"project": "reports", "messages": [{"role": "user", "content": "hi"}], "id": "j1"}


@pytest.fixture
def settings():
    return load_settings(EXAMPLE_CONFIG, env={})


def secret(settings, project="reports"):
    return settings.projects[project].secret


def test_genuine_job_verifies_once_then_is_a_replay(settings, redis_client, key_prefix):
    keys = Keys(key_prefix)
    signed = sign(JOB, "reports", secret(settings))
    assert verify(signed, settings, redis_client, keys) == JOB
    with pytest.raises(AuthError, match="replayed nonce"):
        verify(signed, settings, redis_client, keys)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda s: s["job"]["messages"].append({"role": "user", "content": "x"}), "bad signature"),
        (lambda s: s.update(sig="0" * 64), "bad signature"),
        (lambda s: s.update(project="nobody"), "unknown project"),
        (lambda s: s.update(ts="1000.000"), "stale timestamp"),
        (lambda s: s.pop("nonce"), "unsigned job"),
        (lambda s: s["job"].update(project="triage"), "differs"),
    ],
)
def test_tampering_is_rejected(settings, redis_client, key_prefix, mutate, reason):
    signed = sign(JOB, "reports", secret(settings))
    signed["job"] = {**signed["job"], "messages": list(signed["job"]["messages"])}
    mutate(signed)
    with pytest.raises(AuthError, match=reason):
        verify(signed, settings, redis_client, Keys(key_prefix))


def test_other_projects_secret_does_not_verify(settings, redis_client, key_prefix):
    signed = sign(JOB, "reports", secret(settings, "triage"))
    with pytest.raises(AuthError, match="bad signature"):
        verify(signed, settings, redis_client, Keys(key_prefix))
