"""The ``--tables`` and ``--storage-option`` checks shared by the commands that rewrite a
stopped job's tables (``mirror purge``, ``mirror compact``): done before any work, each a
one-line usage error naming the value."""

from __future__ import annotations

from pathlib import Path

import click

from changefeed.cli.mirror_flags import is_url, mended, storage_options


def checked_tables(tables: str, storage_pairs: tuple[str, ...]) -> tuple[str, dict[str, str]]:
    """``tables`` mended (an URL that lost a slash) and the storage options given.

    Raises:
        click.BadParameter: storage options for a local directory, an object store other than
            S3, or no changelog table under a local directory.
    """
    from changefeed.spark.delta_files import table_fs, table_uri

    tables = mended(tables)
    given = storage_options(storage_pairs)
    if given and not is_url(tables):
        raise click.BadParameter(
            f"{', '.join(sorted(given))} given, but {tables} is a local directory",
            param_hint="--storage-option",
        )
    if is_url(tables):
        try:  # the scheme check of the writer's file system (no connection made)
            table_fs(table_uri(tables, ""), given or None)
        except ValueError as error:
            raise click.BadParameter(str(error), param_hint="--tables") from None
    elif not (Path(tables) / "changelog").is_dir():
        raise click.BadParameter(f"no changelog table under {tables}", param_hint="--tables")
    return tables, given
