"""Prefix-cache friendliness: the project's stable prefix and whether vLLM can ever reuse it.

vLLM's prefix cache reuses whole KV blocks only, and on the deployment's hybrid model a block is
1,072 tokens (``backend.block_tokens``). The five projects resend the same system prompt on every
job, which is exactly what the cache is for, but only if (a) the prompt comes FIRST and is
byte-identical on every job of the project, and (b) it is at least one block long. A 600-token
prefix sent three times scored zero hits on the deployment (docs/deployment.md).

(a) is fleet/prep/prepare.py's layout rule: ``stable_prefix`` (the project's ``system_prompt``, then
the job's own leading system messages) opens every prompt, and material, which differs per job,
comes after it. (b) is checked here: ``check_prefix`` counts the project's prefix and reports how
many whole blocks it fills, with a warning when that is zero; ``prepare`` adds the same warning
to a job whose prefix (with its own system messages) is non-empty but shorter than a block.
Tool schemas are not counted: they render after the system text and may vary per job.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from fleet.core.config import ProjectSettings, Settings, load_settings
from fleet.core.keys import Keys
from fleet.core.models import Job, Message
from fleet.core.promptcache import leading_system
from fleet.core.redisconn import redis_client
from fleet.prep.tokens import TokenCounter


@dataclass(frozen=True)
class PrefixReport:
    project: str
    chars: int
    tokens: int
    exact: bool
    block_tokens: int
    blocks: int
    warning: str | None

    @property
    def cacheable_tokens(self) -> int:
        return self.blocks * self.block_tokens


def stable_prefix(project: ProjectSettings | None, job: Job | None = None) -> list[Message]:
    """The messages every prompt of the project starts with, byte for byte."""
    prefix: list[Message] = []
    if project is not None and project.system_prompt:
        prefix.append(Message(role="system", content=project.system_prompt))
    if job is None:
        return prefix
    for i, message in enumerate(leading_system(job)):
        if i == 0 and prefix and message.content == prefix[0].content:
            continue  # the producer already sent the project's prompt: keep one copy
        prefix.append(message)
    return prefix


def prefix_warning(tokens: int, block_tokens: int, exact: bool = True) -> str | None:
    if tokens >= block_tokens:
        return None
    about = "" if exact else "about "
    return (
        f"stable prefix is {about}{tokens} tokens, shorter than one KV block ({block_tokens}): "
        "vLLM's prefix cache can never hit it; lengthen the shared system prompt/glossary "
        "to at least one block or accept recomputing it on every job"
    )


def check_prefix(settings: Settings, project_name: str, counter: TokenCounter) -> PrefixReport:
    """Count the project's stable prefix and report the whole KV blocks it fills."""
    project = settings.project(project_name)
    if project is None:
        raise KeyError(f"unknown project {project_name!r}")
    block = settings.backend.block_tokens
    messages = stable_prefix(project)
    if not messages:
        return PrefixReport(
            project_name,
            0,
            0,
            True,
            block,
            0,
            "no system_prompt configured: the project's jobs share no prefix to cache",
        )
    tokens, exact = counter.count_messages([m.to_openai() for m in messages])
    chars = sum(len(m.text()) for m in messages)
    return PrefixReport(
        project_name,
        chars,
        tokens,
        exact,
        block,
        tokens // block,
        prefix_warning(tokens, block, exact),
    )


def render_report(report: PrefixReport) -> Table:
    table = Table(title=f"stable prefix of project {report.project}")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("characters", str(report.chars))
    table.add_row("tokens", f"{report.tokens}{'' if report.exact else ' (estimate)'}")
    table.add_row("KV block", f"{report.block_tokens} tokens")
    table.add_row("whole blocks", str(report.blocks))
    table.add_row("cacheable tokens", str(report.cacheable_tokens))
    return table


def prefix_command(
    project: Annotated[str, typer.Argument(help="project name from fleet.toml")],
) -> None:
    """Check that a project's shared prefix is long enough for vLLM's prefix cache."""
    settings = load_settings()
    if settings.project(project) is None:
        raise typer.BadParameter(f"unknown project {project!r}", param_hint="PROJECT")
    client = redis_client(settings)
    counter = TokenCounter(
        settings.backend.url, settings.backend.model, client, Keys(settings.key_prefix)
    )
    try:
        report = check_prefix(settings, project, counter)
    finally:
        counter.close()
        client.close()
    console = Console()
    console.print(render_report(report))
    if not report.exact:
        console.print(f"[yellow]token count is an estimate: {counter.last_failure}[/yellow]")
    if report.warning:
        console.print(f"[yellow]warning:[/yellow] {report.warning}")
    else:
        console.print("[green]ok:[/green] the prefix fills whole KV blocks and can be cached")
