"""What the fleet authenticates itself, after a producer's signature was checked once at prep.

Seal: the fleet's own HMAC-SHA256, keyed by ``security.worker_secret``, over every field of the
job hash that decides what runs or where the outcome goes, ``SEALED_FIELDS`` (a field the record
lacks counts as ""), as the JSON array
    ["fleet-seal-v2", ref, project, kind, origin, gateway, job JSON, plan JSON, fence tag, warnings]
(JSON, so no value can spill into its neighbour). Two writers seal:
  - the prep worker, over the prepared job, its token plan, fence tag and warnings (origin and
    gateway empty: the job is for the inference workers);
  - the gateway, over its request's record (``origin=gateway``, ``gateway=<its id>``; no job).
Two readers check:
  - the inference worker, before it sends anything: a record or an infer task written by anyone
    who does not hold the workers' key (a producer, anyone with a broker URL) runs nothing and
    ends E_AUTH;
  - the dispatcher's send (fleet/worker/dispatch.py), before it hands a grant to a gateway
    instead of an inference worker: a record that claims ``origin=gateway`` without the seal
    (a producer editing its own job hash after prep) goes to the inference workers, whose check
    then ends it E_AUTH; it can neither take a slot away from the workers nor vanish into a
    gateway's grant list.
The ref (``<project>/<id>``) is in the MAC, so a sealed record cannot be moved to another
project's or another job's key. Fields outside the seal (state, times, fence, the producer's
signed message and digest) are information or are checked on their own.

Turn seal: a job between two model turns (a continuation, fleet/infer/attempts.py) keeps the
state of its next turn in the job hash (``turn``) with ``turn_seal`` = HMAC-SHA256 over
    "fleet-turn-v1\n" + ref + "\n" + turn JSON
under the same key; a turn that does not verify runs nothing (E_AUTH), like a bad seal. The seal
binds a turn to its job, not to its position: the producer may write its own job hash, so the
turn carries its number and the inference worker also checks it against the number the
dispatcher store keeps (fleet/worker/jobs/common.py ``current_turn``), which only the fleet writes.

Cancel requests: ``{p}cancel:{<ref>}`` holds a request signed with the project's own secret
(fleet/core/signing.py, job ``{"cancel": <id>, "project": <project>}``); the workers that act on it
(prep, the lease keeper of a running job, the cancel task) verify it first, so only the job's own
project can cancel it. A request is kept for result_ttl_s and is not one-shot, so its age is not
checked; it binds project and job id, so it cannot be moved to another job.

Cache salt: every request the fleet sends to vLLM carries ``cache_salt`` (``cache_salt``), the
base64url HMAC-SHA256 under the same key of ``"fleet-cache-salt-v1\n" + scope``, the scope being
``project:<name>``, or ``group:<name>`` for the projects naming that ``cache_group``: 43
characters (256 bits), the same in every worker and gateway that holds the key, and unknowable to
a producer. vLLM mixes it into the hash of a prompt's first KV block, so a prompt cached under one
salt never hits under another (docs/security.md, prompt caches). A changed key (or group) starts
every project's cache cold once.

Key tag: a job the gateway submits for an API key (``/v1/tasks``, a batch line) carries in its
job hash ``api_key`` (the key's name in the usage ledger, ``sha256:<8 hex>``) and ``api_key_seal``
= HMAC-SHA256 under the same key of ``"fleet-key-v1\n" + ref + "\n" + api_key``
(``seal_key``); the inference worker counts the job's turns under that key only when the tag
verifies (``tagged_key``), else under ``queue``. A producer may write its own job hash, so
without the workers' key it can neither attribute its queue jobs to one of its project's API
keys nor move a tag to another job.

Repeat tag: a queue job of a project with the exact-repeat cache carries ``rcache`` (the digest
of its request, fleet/worker/repeats.py) and ``rcache_seal`` = HMAC-SHA256 of
``"fleet-repeat-v1\n" + ref + "\n" + rcache`` (``repeat_tag``); a worker stores the job's answer
under that digest, or serves it one, only when the tag verifies (``tagged_repeat``).

Digest: the sha256 of a whole signed message as received, which names its rejection (results.py).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Mapping
from typing import Any

from fleet.core.config import Settings
from fleet.core.errors import AuthError, ConfigError
from fleet.core.keys import Keys
from fleet.core.signing import canonical, sign, signature_valid

SEAL_VERSION = "fleet-seal-v2"
SEALED_FIELDS = ("project", "kind", "origin", "gateway", "job", "plan", "fence_tag", "warnings")
TURN_VERSION = "fleet-turn-v1"
KEY_VERSION = "fleet-key-v1"
REPEAT_VERSION = "fleet-repeat-v1"
CACHE_SALT_VERSION = "fleet-cache-salt-v1"


def _worker_key(settings: Settings) -> bytes:
    secret = settings.security.worker_secret
    if not secret:
        raise ConfigError("security.worker_secret is not set: workers cannot seal or run jobs")
    return secret.encode()


def cache_salt(settings: Settings, project: str) -> str:
    """The ``cache_salt`` of ``project``'s requests: its own, or its ``cache_group``'s.
    ConfigError without ``security.worker_secret``; a project not configured gets its own."""
    found = settings.project(project)
    group = found.cache_group if found is not None else None
    scope = f"group:{group}" if group else f"project:{project}"
    mac = hmac.new(_worker_key(settings), f"{CACHE_SALT_VERSION}\n{scope}".encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode()


def seal(settings: Settings, ref: str, fields: Mapping[str, str]) -> str:
    """The seal of ``fields`` (the SEALED_FIELDS of a job hash) for ``ref``."""
    message = json.dumps([SEAL_VERSION, ref, *(fields.get(name, "") for name in SEALED_FIELDS)])
    return hmac.new(_worker_key(settings), message.encode(), hashlib.sha256).hexdigest()


def sealed(settings: Settings, ref: str, **fields: str) -> dict[str, str]:
    """``fields`` and their ``seal``: what a prep worker or a gateway writes into the job hash."""
    return {**fields, "seal": seal(settings, ref, fields)}


def seal_valid(settings: Settings, ref: str, record: Mapping[str, str]) -> bool:
    given = record.get("seal")
    if not given:
        return False
    expected = seal(settings, ref, record)
    return hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace"))


def sealed_gateway(client: Any, settings: Settings, ref: str) -> str | None:
    """The gateway process a job's record names, when the record says ``origin=gateway`` under
    the workers' seal (a producer may write its own job hashes); None for any other record."""
    values = client.hmget(Keys(settings.key_prefix).job(ref), [*SEALED_FIELDS, "seal"])
    record = {name: value.decode("utf-8", "replace")
              for name, value in zip([*SEALED_FIELDS, "seal"], values, strict=True) if isinstance(value, bytes)}
    if record.get("origin") != "gateway" or not record.get("gateway") or not seal_valid(settings, ref, record):
        return None
    return record["gateway"]


def check_seal(settings: Settings, ref: str, record: Mapping[str, str]) -> None:
    """AuthError unless the record's sealed fields carry the workers' seal for ``ref``."""
    missing = [name for name in ("seal", "job", "plan") if name not in record]
    if missing:
        raise AuthError(f"job record not sealed by a prep worker (no {missing[0]!r})")
    if not seal_valid(settings, ref, record):
        raise AuthError("job record seal does not verify: not prepared by this fleet's workers, "
                        "or edited since")


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


def _seal_tag(settings: Settings, version: str, ref: str, value: str) -> str:
    message = "\n".join([version, ref, value])
    return hmac.new(_worker_key(settings), message.encode(), hashlib.sha256).hexdigest()


def _tagged(settings: Settings, version: str, ref: str, value: str | None, given: str | None) -> str | None:
    if not value or not given:
        return None
    expected = _seal_tag(settings, version, ref, value)
    return value if hmac.compare_digest(expected.encode(), given.encode("utf-8", "replace")) else None


def seal_key(settings: Settings, ref: str, label: str) -> str:
    return _seal_tag(settings, KEY_VERSION, ref, label)


def key_tag(settings: Settings, ref: str, label: str) -> dict[str, str]:
    """The job hash fields that name the API key a gateway submitted the job for."""
    return {"api_key": label, "api_key_seal": seal_key(settings, ref, label)}


def tagged_key(settings: Settings, ref: str, record: Mapping[str, str]) -> str | None:
    """The API key a job was submitted for, when its tag verifies (None: untagged or forged)."""
    return _tagged(settings, KEY_VERSION, ref, record.get("api_key"), record.get("api_key_seal"))


def repeat_tag(settings: Settings, ref: str, request: str) -> dict[str, str]:
    """The job hash fields that name the exact-repeat cache entry a queue job computes or waits
    for (its request digest, fleet/worker/repeats.py), under the workers' seal: the producer may
    write its job hash, and must not point its job's answer at another entry."""
    return {"rcache": request, "rcache_seal": _seal_tag(settings, REPEAT_VERSION, ref, request)}


def tagged_repeat(settings: Settings, ref: str, record: Mapping[str, str]) -> str | None:
    """The request digest a job's record names, when its tag verifies (None: none or forged)."""
    return _tagged(settings, REPEAT_VERSION, ref, record.get("rcache"), record.get("rcache_seal"))


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
