"""``changefeed compact``: ask a running node to compact now (COMPACT_DB, one vbucket at a time).

Each vbucket's request is answered once its compaction is done; the command prints how many
tombstones went and each vbucket's purge seqno (a consumer resuming below it rolls back to 0).
It does not wait for, or change, the node's own schedule (`compaction_interval_s`).
"""

from __future__ import annotations

import json
import time
from typing import Any

import click

# The connection options and the error-to-message runner every client command shares.
from changefeed.cli.client_commands import Target, connection_options, run_against
from changefeed.consumer import KvClient
from changefeed.protocol.kv import CompactionSummary


@click.command()
@connection_options
@click.option("--vbuckets", default="all", show_default=True, help="e.g. 0-15,32 or all.")
@click.option(
    "--purge-age",
    type=click.FloatRange(min=0),
    default=None,
    help="Purge tombstones deleted at least this many seconds ago "
    "[default: the node's tombstone_purge_age_s].",
)
@click.option("--drop-deletes", is_flag=True, help="Purge every tombstone, whatever its age.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def compact(
    host: str,
    port: int,
    bucket: str,
    user: str,
    password: str,
    vbuckets: str,
    purge_age: float | None,
    drop_deletes: bool,
    as_json: bool,
) -> None:
    """Compact a running node now: purge old tombstones, raising purge seqnos."""

    async def main() -> list[CompactionSummary]:
        kv = await KvClient.connect(host, port, bucket=bucket, user=user, password=password)
        try:
            summaries = []
            for vb in parse_vbuckets(vbuckets, kv.vbuckets):
                summaries.append(
                    await kv.compact(vb, purge_age_s=purge_age, drop_deletes=drop_deletes)
                )
            return summaries
        finally:
            await kv.close()

    started = time.perf_counter()
    summaries = run_against(main(), Target(host, port, user))
    seconds = time.perf_counter() - started
    purged = sum(summary.purged for summary in summaries)
    visited = sum(summary.visited for summary in summaries)
    if as_json:
        result: dict[str, Any] = {
            "vbuckets": len(summaries),
            "purged": purged,
            "visited": visited,
            "seconds": seconds,
            "purge_seqnos": {str(s.vbucket): s.purge_seqno for s in summaries},
        }
        click.echo(json.dumps(result))
        return
    click.echo(
        f"compacted {len(summaries)} vbuckets in {seconds:.2f} s: purged {purged:,} tombstones "
        f"({visited:,} records looked at)"
    )
    for summary in summaries:
        if summary.purged:
            click.echo(f"  vb {summary.vbucket}: purged {summary.purged}, ", nl=False)
            click.echo(f"purge seqno {summary.purge_seqno}")


def parse_vbuckets(spec: str, vbuckets: int) -> list[int]:
    """The vbuckets `spec` names: "all", or a list like "0-15,32" (each below `vbuckets`).

    Raises:
        click.BadParameter: a part is not a number or range, or names a missing vbucket.
    """
    if spec == "all":
        return list(range(vbuckets))
    chosen: list[int] = []
    for part in spec.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise click.BadParameter(f"{part!r} is not a vbucket or range", param_hint="--vbuckets")
        first, last = int(low), int(high or low)
        if not first <= last < vbuckets:
            raise click.BadParameter(
                f"{part!r} is outside 0..{vbuckets - 1}", param_hint="--vbuckets"
            )
        chosen.extend(range(first, last + 1))
    return list(dict.fromkeys(chosen))
