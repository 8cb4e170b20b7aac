"""``fleet acl``: Redis ACL users that make the broker, not the producers' good manners, the trust
boundary between projects (docs/security.md).

Users (``<p>`` is ``key_prefix``, ``<q>`` is ``<p>q:``, kombu's global_keyprefix):
  fleet-producer-<project>  what ``fleet.Client`` of one project needs, no more:
      push onto the project's own queues (LPUSH ``<q>fleet.<project>`` and ``...collect``) and
      declare their bindings (kombu's ``_kombu.binding.*`` sets of those queues' exchanges),
      PUBLISH Celery's task-sent event (``<q>/<db>.celeryev/*``);
      create its own job records (``<p>job:{<project>/*``, a WATCH/MULTI transaction), add
      ``queued`` events and read them (``<p>events:{<project>/*``), claim idempotency keys
      (``<p>idem:<project>:*``), its own watchdog zset, write its own cancel requests;
      read its own results, rejections and results stream, and its own hourly usage hashes
      (``<p>usage:{<project>}:h:*``; never their turn markers, never a write: only the fleet's
      workers and gateways count usage). Nothing of another project, no
      dispatcher key, no ``fleet.infer``, no Lua (no script, no function: not even the fleet's
      own), no CLIENT subcommand (tracking would tell it every key any project writes), no
      administrative or dangerous command.
  fleet-worker      prep and inference workers: every fleet key and channel (they act for all
                    projects), no administrative or dangerous command but those Celery uses.
  fleet-dispatcher  the same reach as a worker: it sends ``fleet.infer``, resends prep messages,
                    publishes E_DEADLINE results and owns the dispatcher store.
  fleet-operator    everything, including ACL itself (``fleet acl --apply``, ``fleet queues``).

Passwords: a user's comes from the settings (``acl.passwords``, else ``acl.password_file``, see
``configured_passwords``), else it is generated here (``secrets.token_urlsafe``). Redis stores it
only as SHA-256 (``#<hex>`` rules), so the printed rules can be kept in an ACL file without
secrets. A generated password is shown once, in its user's broker URL; a configured one is never
printed (its line reads ``(from settings)``: the operator has it already, and a terminal, a log
or a ticket that keeps the output must not). A password file anyone on the host may read is a
WARNING. A generated password is new at every run (a rotation of that user); a configured one
changes only when the operator changes it, so
``fleet acl --apply`` can be run again (a new project, a changed rule) without invalidating
every URL handed out, and a rotation is deliberate: change one user's entry, apply, hand out
that URL. A configured name that is no user of the fleet is an error (a typo would otherwise
leave the real user on a generated password).
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from fleet.core.config import Settings, password_problem
from fleet.core.errors import ConfigError
from fleet.core.redisconn import is_sentinel, parse_sentinel_url
from fleet.worker.queues import collect_queue, project_queue

log = logging.getLogger(__name__)

# Only the commands the producer's path sends, by name (a category would bring in commands that
# cost the broker dearly on a producer's own keys: LCS, BITOP, SUNIONSTORE, LRANGE, ...):
# fleet.Client and ResultStore (idempotency keys and cancel requests: SET/GET/DEL; the job record,
# a WATCH/MULTI transaction: EXISTS, HSET, EXPIRE, ZADD/ZREM of the watchdog; HGET/HGETALL; events
# and results: XADD, XREAD, XREVRANGE), then kombu sending a task (SADD of the binding sets, SMEMBERS
# of its routing lookup, EXISTS/LLEN of the queue, LPUSH) and Celery's sent event (PUBLISH).
# No way to run code: no EVAL, EVALSHA, SCRIPT or FUNCTION of any kind (``-@scripting`` last, with
# ``-@dangerous`` and ``-@admin``, whatever a category above might hold). A loaded script runs by
# its SHA1 with nothing to stop it: one that writes and then loops makes Redis answer BUSY to
# every client of every project, and SCRIPT KILL cannot end it (only SHUTDOWN NOSAVE can); so the
# producer's path runs no Lua (fleet/core/results.py). What a producer can still cost the broker
# with these commands is in docs/security.md.
# The connection commands are named one by one too: ``@connection`` holds CLIENT whole, and
# CLIENT TRACKING ON BCAST pushes the name of every key anyone writes, key permissions unchecked
# (``job:{<other project>/<id>}`` the moment another project submits); CLIENT LIST, KILL and
# UNBLOCK reach other users' connections. So only what redis-py and kombu send on connecting:
# AUTH (or HELLO, for RESP3), SELECT and kombu's PING; no CLIENT subcommand at all. (redis-py's
# CLIENT SETINFO, sent to Redis 7.2 and later, is refused and redis-py goes on; Redis 7.0 does
# not know it, and its ACL SETUSER would refuse a user naming it.)
PRODUCER_CONNECTION = ["+auth", "+hello", "+select", "+ping"]
PRODUCER_COMMANDS = ["-@all", *PRODUCER_CONNECTION, "+@transaction",
                     "+get", "+set", "+del", "+exists", "+expire", "+hget", "+hgetall", "+hset",
                     "+zadd", "+zrem", "+xadd", "+xread", "+xrevrange",
                     "+sadd", "+smembers", "+llen", "+lpush", "+publish",
                     "-@dangerous", "-@admin", "-@scripting"]
SERVICE_COMMANDS = ["+@all", "-@dangerous", "-@admin", "+info", "+client"]
FROM_SETTINGS = "(from settings)"


@dataclass(frozen=True)
class AclUser:
    name: str
    rules: list[str]  # ACL SETUSER rules, without the password
    password: str
    generated: bool = False  # made by this run (shown once), not given by the settings

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
    readable = [f"{p}result:{own}", f"{p}rejected:{own}", f"{p}results:{project}",
                f"{p}usage:{{{project}}}:h:*"]  # its own usage ledger: read, never written
    queues = [project_queue(project), collect_queue(project)]
    broker = [f"{q}{name}" for name in queues]
    broker += [f"{q}_kombu.binding.{name}" for name in queues]
    broker += [f"{q}_kombu.binding_permanent.{name}" for name in queues]
    # kombu's declare counts the priority sub-queues (LLEN "<queue>\x06\x16<n>"): any key that
    # continues the queue's name with a character no queue name has
    readable += [f"{q}{name}[^-a-zA-Z0-9_.]*" for name in queues]
    # the "sent" event of its own task only: a channel pattern would let it publish any event
    # (a worker's heartbeat, another project's task failing or handed on, as Flower shows them)
    channels = [f"{q}/{_db(settings.broker_url)}.celeryev/task.sent"]
    return ([f"~{k}" for k in writable + broker] + [f"%R~{k}" for k in readable]
            + ["resetchannels"] + [f"&{c}" for c in channels] + PRODUCER_COMMANDS)


def service_rules(settings: Settings) -> list[str]:
    return [f"~{settings.key_prefix}*", "&*", *SERVICE_COMMANDS]


def read_password_file(path: Path) -> dict[str, str]:
    """``<user> <password>`` per line, then optionally a comment (a word starting with ``#`` after
    the password); a line starting with ``#`` is a comment; a ``#`` inside a password, or at its
    start, is part of it. A ConfigError names the line, never the password."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"acl.password_file {path}: {exc.strerror or exc}") from exc
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("acl.password_file %s is readable by others on this host (mode %s): "
                    "chmod 600 it, owned by the operator", path, stat.filemode(mode))
    found: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2 and fields[2].startswith("#"):
            fields = fields[:2]
        if len(fields) != 2:
            raise ConfigError(f"acl.password_file {path} line {number}: expected <user> <password>")
        problem = password_problem(fields[1])
        if problem:
            raise ConfigError(f"acl.password_file {path} line {number} ({fields[0]}): {problem}")
        found[fields[0]] = fields[1]
    return found


def configured_passwords(settings: Settings) -> dict[str, str]:
    """The passwords the settings give: ``acl.password_file``, overridden by ``acl.passwords``."""
    given = read_password_file(settings.acl.password_file) if settings.acl.password_file else {}
    return {**given, **settings.acl.passwords}


def acl_users(settings: Settings, passwords: dict[str, str] | None = None) -> list[AclUser]:
    """Every user of the fleet with its rules; passwords from ``passwords`` by user name (default:
    ``configured_passwords``), the rest generated."""
    given = configured_passwords(settings) if passwords is None else passwords

    def user(name: str, rules: list[str]) -> AclUser:
        if name in given:
            return AclUser(name, rules, given[name])
        return AclUser(name, rules, secrets.token_urlsafe(24), generated=True)

    users = [user(f"fleet-producer-{project}", producer_rules(settings, project))
             for project in settings.projects]
    users += [user(name, service_rules(settings)) for name in ("fleet-worker", "fleet-dispatcher")]
    users.append(user("fleet-operator", ["~*", "&*", "+@all"]))
    unknown = sorted(set(given) - {user.name for user in users})
    if unknown:
        raise ConfigError(f"ACL passwords given for users this fleet does not have: {', '.join(unknown)}")
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
    """ACL file lines (password hashes only), then each generated password's broker URL (shown
    once); a user whose password the settings give reads ``(from settings)``, never its URL."""
    lines = ["# Redis ACL rules (an ACL file, or ACL SETUSER arguments)"]
    lines += [f"user {' '.join(user.setuser())}" for user in users]
    lines += ["", "# broker URLs of new passwords: shown only now; give each process and project its own",
              "# (from settings): the password in acl.passwords / acl.password_file, not shown"]
    lines += [f"{user.name}\t{user.url(broker_url) if user.generated else FROM_SETTINGS}" for user in users]
    return "\n".join(lines) + "\n"
