"""``tether`` commands kept outside ``cli.py`` (which holds the app and is at its line limit); ``cli.py``
registers each on its app. Like ``cli.py`` they only parse arguments and call the public API."""

from __future__ import annotations

import typer
from rich.markup import escape

from tether.console import console


def fail(message: str) -> None:
    """One line ``error: MESSAGE`` and exit code 2, for every command."""
    # escaped: messages quote data ("[[A]]", "[bold]"); unwrapped: paths and line numbers stay whole
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(2)
