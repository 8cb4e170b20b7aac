"""``fleet acl``: Redis ACL users that make the broker, not the producers' good manners, the trust
boundary between projects (docs/security.md).

Users (``<p>`` is ``key_prefix``, ``<q>`` is ``<p>q:``, kombu's global_keyprefix):
  fleet-producer-<project>  what ``fleet.Client`` of one project needs, no more:
      push onto the project's own queues (LPUSH ``<q>fleet.<project>`` and ``...collect``) and
      declare their bindings (kombu's ``_kombu.binding.*`` sets of those queues' exchanges),
      PUBLISH Celery's task-sent event (``<q>/<db>.celeryev/*``);
      create its own job records (``<p>job:{<project>/*``) through the create script, add
      ``queued`` events and read them (``<p>events:{<project>/*``), claim idempotency keys
      (``<p>idem:<project>:*``), its own watchdog zset, write its own cancel requests;
      read its own results, rejections and results stream. Nothing of another project, no
      dispatcher key, no ``fleet.infer``, no administrative or dangerous command.
  fleet-worker      prep and inference workers: every fleet key and channel (they act for all
                    projects), no administrative or dangerous command but those Celery uses.
  fleet-dispatcher  the same reach as a worker: it sends ``fleet.infer``, resends prep messages,
                    publishes E_DEADLINE results and owns the dispatcher store.
  fleet-operator    everything, including ACL itself (``fleet acl --apply``, ``fleet queues``).

Passwords: generated here (``secrets.token_urlsafe``), shown once as broker URLs, and stored in
Redis only as SHA-256 (``#<hex>`` rules), so the printed rules can be kept in an ACL file
without secrets. Running it again makes new passwords (a rotation): hand out the new URLs.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from fleet.core.config import Settings
from fleet.core.errors import ConfigError
from fleet.core.redisconn import is_sentinel, parse_sentinel_url
from fleet.worker.app import collect_queue, project_queue

# Read, write, streams, the fleet's Lua scripts (EVALSHA, and SCRIPT LOAD when Redis lost them;
# the keys a script touches are checked too), MULTI and PUBLISH; never EVAL, FUNCTION, KEYS,
# FLUSH*, CONFIG, DEBUG, ACL or any other administrative command.
PRODUCER_COMMANDS = ["-@all", "+@connection", "+@read", "+@write", "+@stream", "+evalsha",
                     "+script|load", "+@transaction", "+publish", "-@dangerous", "-@admin",
                     "-function"]
SERVICE_COMMANDS = ["+@all", "-@dangerous", "-@admin", "+info", "+client"]


@dataclass(frozen=True)
class AclUser:
    name: str
    rules: list[str]  # ACL SETUSER rules, without the password
    password: str

    def setuser(self) -> list[str]:
        """The full ACL SETUSER argument list, password as its SHA-256."""
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        return [self.name, "reset", "on", f"#{digest}", *self.rules]

    def url(self, broker_url: str) -> str:
        """``broker_url`` with this user's credentials (of a Sentinel URL: in its first part, the
        master's, as kombu and fleet/core/redisconn.py read them)."""
        first, sep, others = broker_url.partition(";")
        if sep:
            return f"{self.url(first)};{others}"
        parts = urlsplit(broker_url)
        host = parts.hostname or "127.0.0.1"
        netloc = f"{quote(self.name, safe='')}:{quote(self.password, safe='')}@{host}"
        if parts.port:
            netloc += f":{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _db(broker_url: str) -> int:
    if is_sentinel(broker_url):
        return parse_sentinel_url(broker_url).db
    path = urlsplit(broker_url).path.strip("/")
    return int(path) if path.isdigit() else 0


def producer_rules(settings: Settings, project: str) -> list[str]:
    p, q = settings.key_prefix, f"{settings.key_prefix}q:"
    own = f"{{{project}/*"
    writable = [f"{p}job:{own}", f"{p}events:{own}", f"{p}cancel:{own}", f"{p}idem:{project}:*",
                f"{p}{{prep}}:prepping:{project}"]
    readable = [f"{p}result:{own}", f"{p}rejected:{own}", f"{p}results:{project}"]
    queues = [project_queue(project), collect_queue(project)]
    broker = [f"{q}{name}" for name in queues]
    broker += [f"{q}_kombu.binding.{name}" for name in queues]
    broker += [f"{q}_kombu.binding_permanent.{name}" for name in queues]
    # kombu's declare counts the priority sub-queues (LLEN "<queue>\x06\x16<n>"): any key that
    # continues the queue's name with a character no queue name has
    readable += [f"{q}{name}[^-a-zA-Z0-9_.]*" for name in queues]
    channels = [f"{q}/{_db(settings.broker_url)}.celeryev/*"]
    return ([f"~{k}" for k in writable + broker] + [f"%R~{k}" for k in readable]
            + ["resetchannels"] + [f"&{c}" for c in channels] + PRODUCER_COMMANDS)


def service_rules(settings: Settings) -> list[str]:
    return [f"~{settings.key_prefix}*", "&*", *SERVICE_COMMANDS]


def acl_users(settings: Settings, passwords: dict[str, str] | None = None) -> list[AclUser]:
    """Every user of the fleet with its rules; ``passwords`` by user name, else generated."""
    given = passwords or {}

    def password(name: str) -> str:
        return given.get(name) or secrets.token_urlsafe(24)

    users = [AclUser(f"fleet-producer-{project}", producer_rules(settings, project),
                     password(f"fleet-producer-{project}")) for project in settings.projects]
    users += [AclUser(name, service_rules(settings), password(name))
              for name in ("fleet-worker", "fleet-dispatcher")]
    users.append(AclUser("fleet-operator", ["~*", "&*", "+@all"], password("fleet-operator")))
    return users


def apply_users(client: Any, users: list[AclUser]) -> None:
    """ACL SETUSER each user (``client`` must be allowed ACL: the operator, or the default user
    before it is switched off); a refusal is a ConfigError naming the user."""
    for user in users:
        try:
            client.execute_command("ACL", "SETUSER", *user.setuser())
        except redis.ResponseError as exc:
            raise ConfigError(f"ACL SETUSER {user.name} refused: {exc}") from exc


def render(users: list[AclUser], broker_url: str) -> str:
    """ACL file lines (password hashes only), then each user's broker URL (shown once)."""
    lines = ["# Redis ACL rules (an ACL file, or ACL SETUSER arguments)"]
    lines += [f"user {' '.join(user.setuser())}" for user in users]
    lines += ["", "# broker URLs: shown only now; give each process and project its own"]
    lines += [f"{user.name}\t{user.url(broker_url)}" for user in users]
    return "\n".join(lines) + "\n"
