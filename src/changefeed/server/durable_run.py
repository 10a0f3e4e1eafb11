"""A run of durable SETs applied as a run of prepares and answered through one record.

`protocol.set_run.take_set_run` takes flexible-magic SETs whose framing extras are one
durability frame info, the same for the whole run. This module does for every write of such
a run what a durable SET alone does (`kv_commands.durable_write`), with its checks in the
same order, each run-wide step once:

1. DURABILITY_IMPOSSIBLE when the node runs no monitor;
2. NOT_MY_VBUCKET for a vbucket id this node does not have (before the chain is looked at:
   the cluster map has no chain for such an id);
3. DURABILITY_IMPOSSIBLE when less than a majority of a vbucket's chain is reachable
   (`check_possible`, once per vbucket of the run);
4. the prepares queued, each vbucket's as one run (`Bucket.set_run` with the level:
   `VBucket.set_many(level=...)`): TMPFAIL while the store cannot persist, and each write's
   own refusal as `set` gives it (NOT_MY_VBUCKET, SYNC_WRITE_IN_PROGRESS, LOCKED, memory
   full...);
5. every prepare queued is followed by the monitor (`SyncWriteMonitor.track_run`), which
   answers it once: the commit's result, or SYNC_WRITE_AMBIGUOUS.

Refusals are answered at once, in request order, as the per-frame path answers each when it
dispatches it. Outcomes reach the connection's `SettledAnswers` (no future and no callback
per write), which sends what one loop step settled together, in the order it settled: the
successes packed (`pack_set_successes`), byte for byte the per-frame replies.

Not here: the commit rule and the timers (sync_writes.py), the wire (protocol/set_run.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from changefeed.protocol.errors import DurabilityImpossibleError, StatusError
from changefeed.protocol.set_run import SetRun
from changefeed.server.context import ServerContext
from changefeed.server.kv_commands import requirement_of
from changefeed.server.settled_answers import (
    AnsweringConnection,
    SettledAnswers,
    durable_set_request,
)


class RunConnection(AnsweringConnection, Protocol):
    """What a durable run needs of the connection it came on (`ClientConnection` has it)."""

    context: ServerContext
    settled_answers: SettledAnswers  # its durable writes' outcomes not yet sent

    def answers_expected(self, count: int) -> None:
        """`count` requests will be answered later (the connection is not idle until then)."""
        ...


def store_durable_run(c: RunConnection, run: SetRun) -> None:
    """Apply the durable SETs of `run` (module docstring) and answer each in its turn."""
    requirement = requirement_of(run.framing_extras)
    assert requirement is not None, run.framing_extras  # take_set_run checked it
    count = len(run)
    by_vb: dict[int, list[int]] = {}
    for index, vb in enumerate(run.vbuckets):  # bounded by the run
        group = by_vb.get(vb)
        if group is None:
            by_vb[vb] = [index]
        else:
            group.append(index)
    errors: dict[int, StatusError] = {}
    monitor = c.context.sync_writes
    bucket = c.context.bucket
    if monitor is None:
        errors = dict.fromkeys(range(count), DurabilityImpossibleError("durable writes need a "
                                                                       "running node"))  # fmt: skip
    else:
        for vb, indexes in by_vb.items():  # bounded by the run's vbuckets
            try:
                bucket.vbucket(vb)  # NotMyVbucketError when this node has none of that id
                monitor.check_possible(vb, len(indexes))
            except StatusError as error:
                errors.update(dict.fromkeys(indexes, error))
    applied: Sequence[int] = range(count)
    seqnos: list[int] = [0] * count
    if errors:
        applied = [index for index in range(count) if index not in errors]
    if applied:
        part = run if len(applied) == count else run.select(applied)
        answers = bucket.set_run(part, level=int(requirement.level))
        for at, refused in answers.errors.items():
            errors[applied[at]] = refused
        for at, index in enumerate(applied):
            seqnos[index] = answers.seqnos[at]
    for index in sorted(errors):  # refused now, as each would be when dispatched alone
        c.reply_error(durable_set_request(run.vbuckets[index], run.opaques[index]), errors[index])
    if monitor is None or len(errors) == count:
        return
    c.answers_expected(count - len(errors))
    queued = [index for index in range(count) if index not in errors] if errors else range(count)
    vbs = run.vbuckets
    if errors:
        vbs = [vbs[index] for index in queued]
        opaques = [run.opaques[index] for index in queued]
        keys = [run.keys[index] for index in queued]
        seqnos = [seqnos[index] for index in queued]
    else:
        opaques, keys = run.opaques, run.keys
    # The answers hold opaques and vbuckets only, never the run: its values are the store's
    # once queued (settled_answers.py).
    replies = c.settled_answers.run_answers(opaques, vbs)
    monitor.track_run(requirement, vbs, keys, seqnos, replies)
