"""``changefeed mirror purge``: remove the changelog's tombstones that the store has purged.

Asks every node of the cluster for its vbuckets' purge seqnos (STAT vbucket-seqno), and removes
the changelog's ``delete`` rows at or below the smallest of them and of the mirror's committed
seqno, per vbucket, in one Delta transaction (``spark/purge.py``). No Spark: the tables are
rewritten by this process. Refused while a mirror job holds the tables (one line naming it).
"""

from __future__ import annotations

import json

import click

from changefeed.cli.mirror_tables_arg import checked_tables


@click.command()
@click.option("--cluster", default="127.0.0.1:11210", show_default=True,
              help="host:port of a node, or seed nodes of a cluster: h1:p1,h2:p2")  # fmt: skip
@click.option("--bucket", default="default", show_default=True)
@click.option("--user", default="Administrator", show_default=True, envvar="CHANGEFEED_USER")
@click.option("--password", default="password", envvar="CHANGEFEED_PASSWORD",
              help="Or CHANGEFEED_PASSWORD.")  # fmt: skip
@click.option("--tables", required=True, help="Directory (or s3:// URL) of the Delta tables.")
@click.option("--storage-option", "storage_pairs", multiple=True, metavar="KEY=VALUE",
              help="A deltalake storage option for s3:// tables (repeatable).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="JSON on stdout.")
def purge(cluster: str, bucket: str, user: str, password: str, tables: str,
          storage_pairs: tuple[str, ...], as_json: bool) -> None:  # fmt: skip
    """Remove the changelog's tombstones that the store itself has purged."""
    from changefeed.protocol.errors import StatusError
    from changefeed.spark.options import OptionError, SourceOptions
    from changefeed.spark.purge import PurgeError
    from changefeed.spark.purge import purge as run_purge
    from changefeed.spark.table_lease import MirrorBusyError

    tables, given = checked_tables(tables, storage_pairs)
    try:
        options = SourceOptions.parse(
            {"cluster": cluster, "bucket": bucket, "user": user, "password": password}
        )
    except OptionError as error:
        raise click.BadParameter(str(error), param_hint="--cluster") from None
    try:
        report = run_purge(tables, options, given or None)
    except (PurgeError, MirrorBusyError) as error:
        raise click.ClickException(str(error)) from None
    except StatusError as error:
        raise click.ClickException(
            f"the cluster at {options.cluster_text} refused user {user!r} on bucket {bucket!r}: "
            f"{error}"
        ) from None
    except (OSError, TimeoutError) as error:
        raise click.ClickException(f"cannot reach the cluster: {error}") from None
    if as_json:
        click.echo(json.dumps(report.to_json()))
        return
    for table in report.tables:
        at = f", table version {table.version}" if table.version is not None else ""
        click.echo(f"{table.table}: {table.removed:,} tombstones purged "
                   f"({table.files_rewritten} files rewritten{at})")  # fmt: skip
    limited = sum(1 for seqno in report.limits.values() if seqno > 0)
    click.echo(f"up to the store's purge seqnos: {limited} of {len(report.limits)} vbuckets "
               "have one (the mirror table holds no tombstones)")  # fmt: skip
