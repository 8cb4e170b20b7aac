"""A private redis-server started with the fleet's ACL users (``fleet acl``), one per module that
asks for it: the ``broker`` fixture of the ACL tests and of the queue-stamp tests (imported by name
there, where it stands in for the root conftest's ``broker``)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis

from fleet.cli.acl import AclUser, acl_users, apply_users
from fleet.core.config import EXAMPLE_CONFIG, Settings, load_settings
from fleet.local.embedded import EmbeddedRedis, start_redis

A, B = "reports", "triage"


@dataclass
class AclBroker:
    server: EmbeddedRedis
    settings: Settings  # operator's URL
    users: dict[str, AclUser]

    def url(self, user: str) -> str:
        return self.users[user].url(self.server.url)

    def client(self, user: str) -> redis.Redis:
        return redis.Redis.from_url(self.url(user))

    def settings_for(self, user: str, project: str | None = None) -> Settings:
        update: dict = {"broker_url": self.url(user)}
        if project is not None:
            update["projects"] = {project: self.settings.projects[project]}
        return self.settings.model_copy(update=update)


@pytest.fixture(scope="module")
def broker() -> Iterator[AclBroker]:
    server = start_redis()
    example = load_settings(EXAMPLE_CONFIG, env={})
    # secrets of its own: workers refuse the example's public ones on a broker fleet up did not start
    projects = {name: project.model_copy(update={"secret": uuid.uuid4().hex})
                for name, project in example.projects.items()}
    settings = example.model_copy(update={"broker_url": server.url, "projects": projects,
                                          "key_prefix": f"t-{uuid.uuid4().hex[:8]}:"})
    users = {user.name: user for user in acl_users(settings)}
    default = redis.Redis.from_url(server.url)
    apply_users(default, list(users.values()))
    default.execute_command("ACL", "SETUSER", "default", "off")  # only the fleet's users remain
    default.close()
    yield AclBroker(server, settings.model_copy(
        update={"broker_url": users["fleet-operator"].url(server.url)}), users)
    server.close()
