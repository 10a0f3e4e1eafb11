"""The table-upkeep flags of ``changefeed mirror``: how often a running job purges the
changelog's tombstones the store has purged and compacts the tables' small files
(``spark/maintenance.py``), turned into the writer's options.

- ``--purge-every SECONDS`` (default 600; 0: after every batch; ``never``);
- ``--compact-every SECONDS`` (default 60; same).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
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


def maintenance_options(
    purge_every: str | None,
    compact_every: str | None,
    writer: str | None = None,
    tables: str | None = None,
) -> dict[str, str]:
    """The writer's options for the flags given (``maintenance.py`` reads them).

    Raises:
        click.BadParameter: a flag given for the local writer (``--writer local``, or local
            tables it wrote), which has no upkeep: the flag would be ignored.
    """
    from changefeed.spark.maintenance import OPTION_COMPACT, OPTION_PURGE

    given = ((OPTION_PURGE, purge_every), (OPTION_COMPACT, compact_every))
    options = {name: value for name, value in given if value is not None}
    if options and (writer == "local" or (writer is None and _local_writers(tables))):
        flag = "--purge-every" if purge_every is not None else "--compact-every"
        whose = "--writer local" if writer == "local" else f"the local writer's tables {tables}"
        raise click.BadParameter(
            f"table upkeep runs in the distributed writer only, not for {whose}", param_hint=flag
        )
    return options


def _local_writers(tables: str | None) -> bool:
    """Whether ``tables`` is a local directory whose tables the local writer wrote (not
    partitioned by the vbucket group; the writer keeps to their layout)."""
    if tables is None or "://" in tables:
        return False
    from deltalake import DeltaTable

    from changefeed.spark.delta_files import GROUP_COLUMN

    for name in ("mirror", "changelog"):
        path = str(Path(tables) / name)
        if DeltaTable.is_deltatable(path):
            return GROUP_COLUMN not in DeltaTable(path).metadata().partition_columns
    return False
