"""A run of durable SETs applied as a run of prepares and answered through one record.

`protocol.set_run.take_set_run` takes flexible-magic SETs whose framing extras are one
durability frame info, the same for the whole run. This module does for every write of such
a run what a durable SET alone does (`kv_commands.durable_write`), with its checks in the
same order, each run-wide step once:

1. DURABILITY_IMPOSSIBLE when the node runs no monitor, or when less than a majority of a
   vbucket's chain is reachable (`check_possible`, once per vbucket of the run);
2. NOT_MY_VBUCKET for a vbucket this node does not have;
3. the prepares queued, each vbucket's as one run (`Bucket.set_run` with the level:
   `VBucket.set_many(level=...)`): TMPFAIL while the store cannot persist, and each write's
   own refusal as `set` gives it (NOT_MY_VBUCKET, SYNC_WRITE_IN_PROGRESS, LOCKED, memory
   full...);
4. every prepare queued is followed by the monitor (`SyncWriteMonitor.track_run`), which
   answers it once: the commit's result, or SYNC_WRITE_AMBIGUOUS.

Refusals are answered at once, in request order, as the per-frame path answers each when it
dispatches it. Outcomes reach the connection's `SettledAnswers` (no future and no callback
per write), which sends what one loop step settled together, in the order it settled: the
successes packed (`pack_set_successes`), byte for byte the per-frame replies.

Not here: the commit rule and the timers (sync_writes.py), the wire (protocol/set_run.py).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from functools import partial
from typing import Final, Protocol

from changefeed.protocol.errors import DurabilityImpossibleError, StatusError
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import MutationResult
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.set_run import SetRun
from changefeed.server.context import ServerContext
from changefeed.server.kv_commands import requirement_of
from changefeed.server.settled_answers import AnsweringConnection, SettledAnswers

_STORE_EXTRAS: Final = struct.Struct(">II")
_ALT_REQUEST: Final = int(Magic.ALT_REQUEST)
_SET: Final = int(Opcode.SET)
Outcome = MutationResult | StatusError


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
                monitor.check_possible(vb, len(indexes))
                bucket.vbucket(vb)  # NotMyVbucketError when this node has none of that id
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
        c.reply_error(_request(run, index), errors[index])
    if monitor is None or len(errors) == count:
        return
    c.answers_expected(count - len(errors))
    queued = [index for index in range(count) if index not in errors] if errors else range(count)
    settle = c.settled_answers.run_write
    monitor.track_run(
        requirement,
        [run.vbuckets[index] for index in queued],
        [run.keys[index] for index in queued],
        [seqnos[index] for index in queued],
        [partial(settle, run, index) for index in queued],
    )


def _request(run: SetRun, index: int) -> Frame:
    """Write `index` of the run as the frame it came in (what an error reply is built from)."""
    return Frame(_ALT_REQUEST, _SET, vbucket=run.vbuckets[index], opaque=run.opaques[index])


def run_frames(run: SetRun) -> list[Frame]:
    """The run's durable SETs as the frames they came in, for the per-frame path."""
    return [
        Frame(
            _ALT_REQUEST,
            _SET,
            datatype=run.datatypes[i],
            vbucket=run.vbuckets[i],
            opaque=run.opaques[i],
            extras=_STORE_EXTRAS.pack(run.flags[i], run.expiries[i]),
            key=run.keys[i],
            value=run.values[i],
            framing_extras=run.framing_extras,
        )
        for i in range(len(run))
    ]
