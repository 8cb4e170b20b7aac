"""What a rich renderable (a ``fleet queues`` table, a ``fleet top`` frame) prints, as text."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console


def rendered(thing: Any, width: int = 200) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    console.print(thing)
    return console.export_text()
