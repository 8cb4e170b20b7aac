"""What the fleet authenticates itself, after a producer's signature was checked once at prep.

Seal: the prep worker stores the prepared job, its token plan and fence tag in the job hash
together with an HMAC-SHA256, keyed by ``security.worker_secret``, over
    "fleet-seal-v1\\n" + ref + "\\n" + job JSON + "\\n" + plan JSON + "\\n" + fence tag
The inference worker recomputes it before it sends anything: a record or an infer task written by
anyone who does not hold the workers' key (a producer, anyone with a broker URL) runs nothing and
ends E_AUTH. The ref (``<project>/<id>``) is in the MAC, so a sealed job cannot be moved to
another project's or another job's record.

Turn seal: a job between two model turns (a continuation, fleet/infer/attempts.py) keeps the
state of its next turn in the job hash (``turn``) with ``turn_seal`` = HMAC-SHA256 over
    "fleet-turn-v1\n" + ref + "\n" + turn JSON
under the same key; a turn that does not verify runs nothing (E_AUTH), like a bad seal.

Cancel requests: ``{p}cancel:{<ref>}`` holds a request signed with the project's own secret
(fleet/core/signing.py, job ``{"cancel": <id>, "project": <project>}``); the workers that act on it
(prep, the lease keeper of a running job, the cancel task) verify it first, so only the job's own
project can cancel it. A request is kept for result_ttl_s and is not one-shot, so its age is not
checked; it binds project and job id, so it cannot be moved to another job.

Digest: the sha256 of a whole signed message as received, which names its rejection (results.py).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from fleet.core.config import Settings
from fleet.core.errors import AuthError, ConfigError
from fleet.core.signing import canonical, sign, signature_valid

SEAL_VERSION = "fleet-seal-v1"
TURN_VERSION = "fleet-turn-v1"


def _worker_key(settings: Settings) -> bytes:
    secret = settings.security.worker_secret
    if not secret:
        raise ConfigError("security.worker_secret is not set: workers cannot seal or run jobs")
    return secret.encode()


def seal(settings: Settings, ref: str, job_json: str, plan_json: str, fence_tag: str) -> str:
    message = "\n".join([SEAL_VERSION, ref, job_json, plan_json, fence_tag])
    return hmac.new(_worker_key(settings), message.encode(), hashlib.sha256).hexdigest()


def check_seal(settings: Settings, ref: str, record: Mapping[str, str]) -> None:
    """AuthError unless the record's prepared job and plan carry the workers' seal for ``ref``."""
    try:
        expected = seal(settings, ref, record["job"], record["plan"], record.get("fence_tag", ""))
        given = record["seal"]
    except KeyError as exc:
        raise AuthError(f"job record not sealed by a prep worker (no {exc.args[0]!r})") from exc
    if not hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace")):
        raise AuthError("job record seal does not verify: not prepared by this fleet's workers")


def seal_turn(settings: Settings, ref: str, turn_json: str) -> str:
    message = "\n".join([TURN_VERSION, ref, turn_json])
    return hmac.new(_worker_key(settings), message.encode(), hashlib.sha256).hexdigest()


def check_turn(settings: Settings, ref: str, record: Mapping[str, str]) -> str | None:
    """The saved turn state's JSON (None before the second turn); AuthError unless sealed."""
    turn_json = record.get("turn")
    if turn_json is None:
        return None
    expected = seal_turn(settings, ref, turn_json)
    given = record.get("turn_seal", "")
    if not hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace")):
        raise AuthError("saved turn state seal does not verify: not written by this fleet's workers")
    return turn_json


def digest(signed: Any) -> str:
    """sha256 of a whole received message (any JSON value), hex."""
    try:
        text = canonical(signed) if isinstance(signed, Mapping) else json.dumps(signed, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(signed)
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()


def sign_cancel(project: str, job_id: str, secret: str) -> str:
    return json.dumps(sign({"cancel": job_id, "project": project}, project, secret))


def cancel_valid(settings: Settings, project: str, job_id: str, value: bytes | str | None) -> bool:
    """True when ``value`` is a cancel request of ``project`` for ``job_id`` signed with its secret."""
    found = settings.project(project)
    if not value or found is None:
        return False
    try:
        request = json.loads(value)
    except ValueError:
        return False
    if not isinstance(request, dict) or request.get("job") != {"cancel": job_id, "project": project}:
        return False
    return request.get("project") == project and signature_valid(request, found.secret)
