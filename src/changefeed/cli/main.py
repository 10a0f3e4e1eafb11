"""The ``changefeed`` command. Subcommands live in their own modules; this file only wires them."""

from __future__ import annotations

import click

from changefeed import __version__
from changefeed.cli.certs import certs
from changefeed.cli.client_commands import load, stats, stream
from changefeed.cli.cluster import cluster
from changefeed.cli.collections import collection
from changefeed.cli.compact import compact
from changefeed.cli.demo_command import demo
from changefeed.cli.mirror import mirror
from changefeed.cli.serve import serve, user


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="changefeed")
def cli() -> None:
    """changefeed: a partitioned key-value store whose every change is numbered and streamed.

    \b
    Exit status: 0 done; 1 runtime failure (node unreachable, authentication failed, port in
    use, data dir unusable...); 2 usage error (a bad flag or config value, as click reports).
    Errors print one line, "Error: ...", naming the value at fault.
    """


cli.add_command(demo)
cli.add_command(serve)
cli.add_command(user)
cli.add_command(load)
cli.add_command(stream)
cli.add_command(stats)
cli.add_command(compact)
cli.add_command(mirror)
cli.add_command(cluster)
cli.add_command(certs)
cli.add_command(collection)


def main() -> None:
    cli()
