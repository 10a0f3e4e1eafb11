"""The table-upkeep flags of ``changefeed mirror``: how often a running job purges the
changelog's tombstones the store has purged and compacts the tables' small files
(``spark/maintenance.py``), turned into the writer's options.

- ``--purge-every SECONDS`` (default 600; 0: after every batch; ``never``);
- ``--compact-every SECONDS`` (default 60; same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

NEVER = "never"


def _seconds(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A flag's value as the option's text: seconds (>= 0), or -1 for ``never``."""
    if value is None:
        return None
    if value.strip().lower() == NEVER:
        return "-1"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # also NaN
        raise click.BadParameter(f"{value!r} is not a number of seconds (>= 0) or {NEVER!r}")
    return repr(seconds)


def maintenance_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--purge-every`` and ``--compact-every`` on ``command``."""
    command = click.option(
        "--compact-every", default=None, callback=_seconds, metavar="SECONDS",
        help="A running job merges the tables' small files this often (0: every batch; "
        "never) [default: 60].",
    )(command)  # fmt: skip
    return click.option(
        "--purge-every", default=None, callback=_seconds, metavar="SECONDS",
        help="A running job removes the changelog's tombstones the store has purged this "
        "often (0: every batch; never) [default: 600].",
    )(command)  # fmt: skip


def maintenance_options(purge_every: str | None, compact_every: str | None) -> dict[str, str]:
    """The writer's options for the flags given (``maintenance.py`` reads them)."""
    from changefeed.spark.maintenance import OPTION_COMPACT, OPTION_PURGE

    given = ((OPTION_PURGE, purge_every), (OPTION_COMPACT, compact_every))
    return {name: value for name, value in given if value is not None}
