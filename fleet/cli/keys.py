"""``fleet keys``: API keys of the gateway (fleet/core/apikeys.py). A key is shown once, when it is
minted; the settings keep its digest only."""

from __future__ import annotations

from typing import Annotated

import typer

keys_app = typer.Typer(add_completion=False, no_args_is_help=True)


@keys_app.command("mint")
def mint_command(
    project: Annotated[str, typer.Option(help="The project the key authenticates as.")],
    band: Annotated[str | None, typer.Option(help="interactive (default) or batch.")] = None,
) -> None:
    """Print a new gateway key once, and the line that admits it in fleet.toml."""
    from fleet.core.apikeys import mint

    if band not in (None, "interactive", "batch"):
        typer.echo(f"E_INPUT_INVALID --band must be interactive or batch, not {band!r}", err=True)
        raise typer.Exit(2)
    key, entry = mint(band)
    typer.echo(f"key (shown once; give it to the project's client): {key}")
    typer.echo(f"add to [projects.{project}] api_keys in fleet.toml, then SIGHUP the gateway "
               "(or let it see the file change):")
    typer.echo(f'  api_keys = ["{entry}"]')
