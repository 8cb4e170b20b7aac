"""Signed jobs: a producer proves which project it speaks for; a worker checks before anything.

Wire shape (what travels in the Celery message, JSON):
    {"job": {...raw job dict...}, "project": "p", "ts": 1732870000.123, "nonce": "hex", "sig": "hex"}

The signature is HMAC-SHA256 with the project's secret over
    "fleet-v1\\n" + project + "\\n" + ts + "\\n" + nonce + "\\n" + canonical(job)
where canonical(job) is JSON with sorted keys, no whitespace and UTF-8 text. The worker
canonicalises the dict it received (not the parsed model), so a field the model would reject still
counts in the signature and cannot be smuggled in after signing.

Verification order: known project, a finite timestamp no more than max_clock_skew_s in the future
and no older than max_age_s (a queue backlog is not an attack), a valid signature (constant-time
compare), then the nonce is claimed for the job id with SET NX: a redelivery of the same message
passes, the nonce on another job id within nonce_ttl_s is a replay. Any failure is an AuthError
(E_AUTH) whose message says which check failed but never echoes the secret or the signature.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import time
from collections.abc import Mapping
from typing import Any

import redis

from fleet.core.config import Settings
from fleet.core.errors import AuthError
from fleet.core.keys import Keys

VERSION = "fleet-v1"


def canonical(job: Mapping[str, Any]) -> str:
    return json.dumps(job, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _mac(secret: str, project: str, ts: str, nonce: str, job: Mapping[str, Any]) -> str:
    message = "\n".join([VERSION, project, ts, nonce, canonical(job)])
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def sign(job: Mapping[str, Any], project: str, secret: str, now: float | None = None) -> dict:
    ts = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(16)
    return {
        "job": dict(job),
        "project": project,
        "ts": ts,
        "nonce": nonce,
        "sig": _mac(secret, project, ts, nonce, job),
    }


def signature_valid(signed: Mapping[str, Any], secret: str) -> bool:
    """Only the MAC (constant-time compare): no freshness or nonce checks."""
    try:
        fields = [str(signed[name]) for name in ("project", "ts", "nonce", "sig")]
        job = signed["job"]
    except (KeyError, TypeError):
        return False
    if not isinstance(job, Mapping):
        return False
    expected = _mac(secret, fields[0], fields[1], fields[2], job)
    return hmac.compare_digest(expected.encode(), fields[3].encode("utf-8", "replace"))


def _check_fresh(ts: str, settings: Settings, now: float) -> None:
    try:
        stamp = float(ts)
    except ValueError as exc:
        raise AuthError("timestamp is not a number") from exc
    if not math.isfinite(stamp):
        raise AuthError("timestamp is not a finite number")
    if stamp - now > settings.security.max_clock_skew_s:
        raise AuthError(f"timestamp {stamp - now:.0f} s in the future "
                        f"(limit {settings.security.max_clock_skew_s:.0f} s)")
    if now - stamp > settings.security.max_age_s:
        raise AuthError(f"stale timestamp ({now - stamp:.0f} s old, limit "
                        f"{settings.security.max_age_s:.0f} s)")


def _claim_nonce(client: redis.Redis, keys: Keys, project: str, nonce: str, job_id: str,
                 settings: Settings) -> None:
    """First use claims the nonce for this job id. The same message delivered again (Celery
    redelivers unacknowledged tasks) carries the same job id and passes; the nonce on another
    job id is a replay."""
    key = keys.nonce(project, nonce)
    ttl_ms = int(settings.security.nonce_ttl_s * 1000)
    if client.set(key, job_id, nx=True, px=ttl_ms):
        return
    seen = client.get(key)
    if not isinstance(seen, bytes) or seen.decode() != job_id or not job_id:
        raise AuthError("replayed nonce")


def verify(
    signed: Mapping[str, Any],
    settings: Settings,
    client: redis.Redis,
    keys: Keys,
    now: float | None = None,
) -> dict:
    """Return the raw job dict of a genuine, fresh, first-seen signed job; else AuthError."""
    try:
        project = str(signed["project"])
        ts = str(signed["ts"])
        nonce = str(signed["nonce"])
        sig = str(signed["sig"])
        job = signed["job"]
    except (KeyError, TypeError) as exc:
        raise AuthError("unsigned job: the envelope lacks project, ts, nonce, sig or job") from exc
    if not isinstance(job, Mapping):
        raise AuthError("unsigned job: 'job' is not an object")
    project_settings = settings.project(project)
    if project_settings is None:
        raise AuthError(f"unknown project {project!r}")
    if job.get("project") != project:
        raise AuthError("the job's project differs from the signed project")
    _check_fresh(ts, settings, time.time() if now is None else now)
    expected = _mac(project_settings.secret, project, ts, nonce, job)
    if not hmac.compare_digest(expected.encode(), sig.encode("utf-8", "replace")):
        raise AuthError("bad signature")
    _claim_nonce(client, keys, project, nonce, str(job.get("id", "")), settings)
    return dict(job)
