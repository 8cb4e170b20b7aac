import pytest

from fleet.core.config import EXAMPLE_CONFIG, load_settings
from fleet.core.errors import AuthError
from fleet.core.keys import Keys
from fleet.core.signing import _mac, sign, verify

JOB = {"project": "reports", "messages": [{"role": "user", "content": "hi"}], "id": "j1"}


@pytest.fixture
def settings():
    return load_settings(EXAMPLE_CONFIG, env={})


def secret(settings, project="reports"):
    return settings.projects[project].secret


def test_redelivery_passes_but_the_nonce_on_another_job_is_a_replay(settings, redis_client,
                                                                     key_prefix):
    keys = Keys(key_prefix)
    signed = sign(JOB, "reports", secret(settings))
    assert verify(signed, settings, redis_client, keys) == JOB
    assert verify(signed, settings, redis_client, keys) == JOB  # Celery delivered it again
    other = {**JOB, "id": "j2"}
    # a genuinely signed message for another job that reuses the nonce
    replay = {**signed, "job": other,
              "sig": _mac(secret(settings), "reports", signed["ts"], signed["nonce"], other)}
    with pytest.raises(AuthError, match="replayed nonce"):
        verify(replay, settings, redis_client, keys)


def test_age_limits(settings, redis_client, key_prefix):
    keys = Keys(key_prefix)
    now = 1_800_000_000.0
    backlog = sign(JOB, "reports", secret(settings), now=now - 3600)
    assert verify(backlog, settings, redis_client, keys, now=now) == JOB  # an hour in the queue
    old = sign(JOB, "reports", secret(settings), now=now - settings.security.max_age_s - 1)
    with pytest.raises(AuthError, match="stale timestamp"):
        verify(old, settings, redis_client, keys, now=now)
    future = sign(JOB, "reports", secret(settings), now=now + 3600)
    with pytest.raises(AuthError, match="in the future"):
        verify(future, settings, redis_client, keys, now=now)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda s: s["job"]["messages"].append({"role": "user", "content": "x"}), "bad signature"),
        (lambda s: s.update(sig="0" * 64), "bad signature"),
        (lambda s: s.update(project="nobody"), "unknown project"),
        (lambda s: s.update(ts="1000.000"), "stale timestamp"),
        (lambda s: s.update(ts="nan"), "finite"),
        (lambda s: s.update(sig="\u00e9" * 64), "bad signature"),
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


def test_cache_salts_are_per_project_or_group_and_need_the_workers_key():
    """Every path derives the same salt from the workers' key; a producer, lacking it, cannot."""
    from fleet.core.errors import ConfigError
    from fleet.core.seal import cache_salt

    def salts(key, groups):
        settings = load_settings(EXAMPLE_CONFIG, env={}, security={"worker_secret": key},
                                 projects={name: {"cache_group": group} for name, group in groups.items()})
        return {name: cache_salt(settings, name) for name in settings.projects}

    own = salts("k" * 16, {})
    assert len(set(own.values())) == len(own) and all(len(s) == 43 for s in own.values())
    assert salts("k" * 16, {}) == own  # the gateway and every worker derive the same
    grouped = salts("k" * 16, {"reports": "glossary", "translate": "glossary"})
    assert grouped["reports"] == grouped["translate"] != own["reports"]
    assert grouped["assistant"] == own["assistant"]
    assert salts("m" * 16, {})["reports"] != own["reports"]
    with pytest.raises(ConfigError):
        cache_salt(load_settings(EXAMPLE_CONFIG, env={}, security={"worker_secret": None}), "reports")
