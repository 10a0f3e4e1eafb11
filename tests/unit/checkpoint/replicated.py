"""A replica's received run as columns, for the checkpoint tests that queue one."""

from __future__ import annotations

from changefeed.checkpoint import Item
from changefeed.vbucket.values import ReplicatedColumns


def columns_of(built: list[Item]) -> ReplicatedColumns:
    """`built` as the columns a replica receives (and queues with `queue_columns`)."""
    return ReplicatedColumns(
        [o.seqno for o in built], [o.key for o in built], [o.body for o in built],
        [o.cas for o in built], [o.flags for o in built], [o.expiry for o in built],
        [o.datatype for o in built], [o.rev_seqno for o in built],
    )  # fmt: skip
