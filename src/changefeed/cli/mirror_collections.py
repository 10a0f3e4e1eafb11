"""``changefeed mirror --collections``: a mirror per collection, and its tables in ``status``.

``--collections scope.collection,...`` mirrors those collections, ``--collections 'scope.*'``
every collection of a scope (those created later too), ``--collections '*'`` every
collection of the bucket; each gets a changelog and a mirror table under
``TABLES/<scope>/<collection>/`` (``spark/collection_mirror.py``). Without the flag the job
mirrors the default collection into ``TABLES/{changelog,mirror}`` as before collections.

Checked before Spark starts: the syntax, and that each collection named exists now, or has
tables already (a collection dropped while the job was stopped: its tables stay, marked). The
error lists the collections the bucket has.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import click

FLAG_HELP = (
    "Mirror collections, one table pair each under TABLES/<scope>/<collection>: "
    "scope.collection,... or 'scope.*' (a scope) or '*' (all) [default: the default "
    "collection into TABLES/changelog and TABLES/mirror]."
)

collections_flag = click.option(
    "--collections", "collection_list", default=None, metavar="LIST", help=FLAG_HELP
)


def collection_options(
    text: str | None, options: dict[str, str], tables: Path | str
) -> dict[str, str]:
    """The source options of ``--collections`` (``collections`` or ``scope``), checked.

    Raises:
        click.BadParameter: bad syntax, or a collection (scope) the bucket does not have and
            the tables never had.
    """
    from changefeed.spark.options import ALL_COLLECTIONS, OptionError, SourceOptions

    if text is None:
        return {}
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        hint = "give scope.collection,..., 'scope.*' or '*'"
        raise click.BadParameter(hint, param_hint="--collections")
    scopes = [p.removesuffix(".*") for p in parts if p.endswith(".*")]
    if scopes and len(parts) > 1:
        raise click.BadParameter(
            f"{text!r}: give one 'scope.*', or collections scope.collection,...",
            param_hint="--collections",
        )
    given = {"scope": scopes[0]} if scopes else {"collections": ",".join(parts)}
    try:
        parsed = SourceOptions.parse({**options, **given})
    except OptionError as error:
        raise click.BadParameter(str(error), param_hint="--collections") from None
    if parsed.collections == (ALL_COLLECTIONS,):
        return {"collections": ALL_COLLECTIONS}
    _check_exist(parsed, tables)
    if parsed.scope is not None:
        return {"scope": parsed.scope}
    return {"collections": ",".join(parsed.collections)}


def _check_exist(parsed: Any, tables: Path | str) -> None:
    from changefeed.spark.collection_registry import Registry
    from changefeed.spark.reading import fetch_manifest

    manifest = asyncio.run(fetch_manifest(parsed))
    try:
        had = {entry.name for entry in Registry.load(str(tables)).entries}
    except (OSError, ValueError):
        had = set()
    have = sorted(f"{s.name}.{c.name}" for s in manifest.scopes for c in s.collections)
    if parsed.scope is not None:
        missing = [] if manifest.scope(parsed.scope) is not None else [f"{parsed.scope}.*"]
        if missing and any(name.startswith(f"{parsed.scope}.") for name in had):
            missing = []
    else:
        missing = [
            name for name in parsed.collections
            if manifest.resolve(name)[1] is None and name not in had
        ]  # fmt: skip
    if missing:
        raise click.BadParameter(
            f"bucket {parsed.bucket!r} has no {', '.join(missing)} (it has: {', '.join(have)})",
            param_hint="--collections",
        )


def collection_fields(
    tables: Path, storage_options: dict[str, str] | None, table_fields: Any, empty: Any
) -> Any:
    """The document fields of a collection-aware mirror's tables (``table_fields`` of each
    collection's directory), merged in the order the collections came: a restart infers
    the schema over them, so no table's column is dropped or retyped. ``empty`` without any."""
    from changefeed.spark.collection_registry import Registry
    from changefeed.spark.delta_files import table_uri
    from changefeed.spark.documents import merge_fields

    fields = empty
    for entry in Registry.load(table_uri(tables, ""), storage_options).entries:
        fields = merge_fields(fields, table_fields(tables / entry.path, storage_options))
    return fields


def show_collections(tables: Path, as_json: bool) -> bool:
    """Print the per-collection tables of a collection-aware mirror under ``tables``; False
    (nothing printed) when it is not one."""
    import json

    from changefeed.spark.mirror_status import collection_statuses

    try:
        statuses = collection_statuses(tables)
    except (OSError, ValueError) as error:
        raise click.ClickException(str(error)) from None
    if not statuses:
        return False
    if as_json:
        click.echo(json.dumps({"tables": str(tables),
                               "collections": [s.to_json() for s in statuses]}))  # fmt: skip
        return True
    click.echo(f"mirror {tables}: {len(statuses)} collections, one table pair each")
    for status in statuses:
        click.echo(f"  {status.line()}")
        if status.status is not None:
            click.echo(f"    {status.status.line()}")
    return True
