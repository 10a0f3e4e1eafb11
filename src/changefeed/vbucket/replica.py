"""The replica role (replica and pending copies): runs replicated from the active, snapshots,
rollback, the failover log adopted, and the passive side of durability.

Items keep the seqno and CAS the active gave them and must lie inside the snapshot being
received (`replica_snapshot` opened it). A replica keeps the prepares it receives; a later
committed change or an abort of the key ends one (`Effect.PREPARES_COMMITTED` on promotion
is the active role's). A rollback truncates before anything past the point is taken
(KAFKA-14704: truncate first) and keeps only the prepares at or below the point.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import Final

from changefeed import limits
from changefeed.checkpoint import Item, SyncItem
from changefeed.checkpoint.columns import items_of
from changefeed.protocol.errors import InvalidArgumentsError
from changefeed.storage import Op
from changefeed.vbucket.port import retain_pending
from changefeed.vbucket.role import Role
from changefeed.vbucket.values import (
    DATATYPE_MASK,
    EXTRAS_SIZE,
    KEY_SIZE_MAX,
    U64_MAX,
    VALUE_SIZE_MAX,
    ReplicatedColumns,
    check_fields,
)

_MUTATION: Final = Op.MUTATION
_PREPARE: Final = Op.PREPARE
_MUTATION_EXTRAS: Final = EXTRAS_SIZE[Op.MUTATION]


class ReplicaRole(Role):
    """A copy fed by its active (see the module docstring); serves reads."""

    def check_readable(self) -> None:
        return None

    def queue_replicated(self, item: Item) -> None:
        core = self.core
        manager = core.manager
        if not core.high_seqno < item.seqno <= manager.snapshot_end:
            raise InvalidArgumentsError(
                f"vb {core.vb}: replicated seqno {item.seqno} outside the snapshot being "
                f"received ({core.high_seqno}, {manager.snapshot_end}]"
            )
        check_fields(item.key, item.value, item.flags, item.expiry, item.datatype)
        if not 0 < item.cas <= limits.SEQNO_MAX:
            raise InvalidArgumentsError(f"vb {core.vb}: cas {item.cas} is not a non-zero u64")
        manager.queue(item)
        core.advanced(item.seqno, item.cas)
        pending = self.pending
        if item.op is _PREPARE:
            assert isinstance(item, SyncItem), item
            pending.pop(item.key, None)  # an older one, its end deduplicated away
            pending[item.key] = item
            retain_pending(manager, pending)
        elif pending and item.key in pending:
            # An abort, a commit, or a committed change of the key after them (a commit
            # deduplicated away, or sent as the document by a disk backfill): the prepare ends.
            del pending[item.key]
            retain_pending(manager, pending)

    def queue_replicated_run(self, items: Sequence[Item]) -> int:
        if not items:
            return 0
        core = self.core
        manager = core.manager
        high = core.high_seqno
        if not high < items[0].seqno or not items[-1].seqno <= manager.snapshot_end:
            raise InvalidArgumentsError(
                f"vb {core.vb}: replicated seqnos {items[0].seqno}..{items[-1].seqno} outside "
                f"the snapshot being received ({high}, {manager.snapshot_end}]"
            )
        previous = high
        for item in items:  # the replica's hot loop: each check inline, check_fields explains
            seqno = item.seqno
            if (
                seqno <= previous
                or not 0 < item.cas <= U64_MAX
                or not 0 < len(item.key) <= KEY_SIZE_MAX
                or len(item.body) - len(item.key) - EXTRAS_SIZE[item.op] > VALUE_SIZE_MAX
                or item.datatype & ~DATATYPE_MASK
            ):
                self._refuse_replicated(item, previous)
            previous = seqno
        queued = manager.queue_run(items)
        core.advanced(items[queued - 1].seqno, max(item.cas for item in items[:queued]))
        pending = self.pending
        if pending:
            for item in items[:queued]:  # a committed change of a pending key ends the prepare
                if item.key in pending:
                    del pending[item.key]
                    retain_pending(manager, pending)
        return queued

    def queue_replicated_columns(self, run: ReplicatedColumns) -> int:
        """`queue_replicated_run` for a run of mutations given as columns: checked with one
        C-level pass per column and queued as columns (`CheckpointManager.queue_columns`: no
        `Item` is built until something reads the checkpoint; each body is taken as
        received). A run a check refuses goes item by item through `queue_replicated_run`,
        which names the bad item."""
        seqnos, keys, bodies, cases = run.seqnos, run.keys, run.bodies, run.cases
        count = len(seqnos)
        if not count:
            return 0
        core = self.core
        manager = core.manager
        key_sizes = list(map(len, keys))
        datatypes = run.datatypes
        clean = (
            core.high_seqno < seqnos[0]
            and seqnos[-1] <= manager.snapshot_end
            and all(map(operator.lt, seqnos, itertools.islice(seqnos, 1, None)))
            and min(cases) > 0
            and max(cases) <= U64_MAX
            and min(key_sizes) > 0
            and max(key_sizes) <= KEY_SIZE_MAX
            and max(map(operator.sub, map(len, bodies), key_sizes))
            <= VALUE_SIZE_MAX + _MUTATION_EXTRAS
            and min(datatypes) >= 0
            and max(datatypes) <= DATATYPE_MASK
        )
        if not clean:
            return self.queue_replicated_run(items_of(run, 0, count))  # raises, naming the item
        queued = manager.queue_columns(run)
        core.advanced(seqnos[queued - 1], max(itertools.islice(cases, queued)))
        pending = self.pending
        if pending and not pending.keys().isdisjoint(itertools.islice(keys, queued)):
            for key in itertools.islice(keys, queued):  # a committed change ends a prepare
                if pending.pop(key, None) is not None:
                    retain_pending(manager, pending)
        return queued

    def queue_replicated_prepares(self, prepares: Sequence[SyncItem]) -> int:
        """`queue_replicated` for a run of DCP_PREPAREs (seqnos rising), queued with one
        `CheckpointManager.queue_prepares`. The prepares before the first bad one are queued
        and then its error is raised, as one call each would.

        Returns:
            How many were queued (the first ones; memory may run out part of the way).
        """
        core = self.core
        manager = core.manager
        snapshot_end = manager.snapshot_end
        previous = core.high_seqno
        good = 0
        for item in prepares:  # the checks of queue_replicated, in order
            seqno = item.seqno
            if not previous < seqno <= snapshot_end or not 0 < item.cas <= limits.SEQNO_MAX:
                break
            try:
                check_fields(item.key, item.value, item.flags, item.expiry, item.datatype)
            except InvalidArgumentsError:
                break
            assert item.op is _PREPARE, item
            previous = seqno
            good += 1
        queued = self._queue_prepares(prepares[:good]) if good else 0
        if queued == good < len(prepares):
            self.queue_replicated(prepares[good])  # raises, naming the bad prepare
            raise AssertionError(f"the run's checks refused {prepares[good]!r}, queue did not")
        return queued

    def _queue_prepares(self, prepares: Sequence[SyncItem]) -> int:
        core = self.core
        manager = core.manager
        queued = manager.queue_prepares(prepares)
        core.advanced(prepares[queued - 1].seqno, max(item.cas for item in prepares[:queued]))
        pending = self.pending
        for item in prepares[:queued]:
            pending.pop(item.key, None)  # an older one, its end deduplicated away
            pending[item.key] = item
        retain_pending(manager, pending)
        return queued

    def replica_commit_many(self, commits: Sequence[tuple[bytes, int, int]]) -> int:
        """`replica_commit` for a run of DCP_COMMITs, (key, prepared seqno, commit seqno) each,
        commit seqnos rising: queued with one `CheckpointManager.queue_run(commits=True)`.
        The commits before the first bad one are queued and then its error is raised, as one
        call each would.

        Returns:
            How many were queued (the first ones; memory may run out part of the way).
        """
        core = self.core
        manager = core.manager
        snapshot_end = manager.snapshot_end
        pending = self.pending
        previous = core.high_seqno
        items: list[Item] = []
        taken: set[bytes] = set()  # a key commits once: its prepare ends with the commit
        for key, prepared_seqno, commit_seqno in commits:  # replica_commit's checks, in order
            prepare = pending.get(key)
            if (
                prepare is None
                or prepare.seqno != prepared_seqno
                or key in taken
                or not previous < commit_seqno <= snapshot_end
            ):
                break
            # The prepare's fields and CAS were checked when it was taken (queue_replicated,
            # the active's write, or the store at warmup): the commit carries the same ones.
            items.append(prepare.committed(commit_seqno))
            taken.add(key)
            previous = commit_seqno
        queued = manager.queue_run(items, commits=True) if items else 0
        if queued:
            core.advanced(items[queued - 1].seqno, max(item.cas for item in items[:queued]))
            for item in items[:queued]:
                del pending[item.key]
            retain_pending(manager, pending)
        if queued == len(items) < len(commits):
            self.replica_commit(*commits[len(items)])  # raises, naming the bad commit
            raise AssertionError(f"the run's checks refused {commits[len(items)]!r}")
        return queued

    def _refuse_replicated(self, item: Item, previous: int) -> None:
        """Raise the error `queue_replicated_run` found in `item` (after `previous`)."""
        vb = self.core.vb
        if item.seqno <= previous:
            raise InvalidArgumentsError(
                f"vb {vb}: replicated seqno {item.seqno} does not follow {previous}"
            )
        if not 0 < item.cas <= limits.SEQNO_MAX:
            raise InvalidArgumentsError(f"vb {vb}: cas {item.cas} is not a non-zero u64")
        check_fields(item.key, item.value, item.flags, item.expiry, item.datatype)
        raise AssertionError(f"the run's checks refused {item!r}, check_fields did not")

    def replica_commit(self, key: bytes, prepared_seqno: int, commit_seqno: int) -> None:
        prepare = self.pending.get(key)
        if prepare is None or prepare.seqno != prepared_seqno:
            held = None if prepare is None else prepare.seqno
            raise InvalidArgumentsError(
                f"vb {self.core.vb}: DCP_COMMIT of {key[:64]!r} prepared at {prepared_seqno}, "
                f"pending here: {held}"
            )
        self.queue_replicated(prepare.committed(commit_seqno))

    def replica_snapshot(self, snap_start: int, snap_end: int) -> None:
        if not 0 <= snap_start <= snap_end <= limits.SEQNO_MAX:
            raise InvalidArgumentsError(f"vb {self.core.vb}: snapshot [{snap_start}, {snap_end}]")
        self.core.manager.start_snapshot(snap_start, snap_end)

    def adopt_failover_log(self, entries: list[tuple[int, int]]) -> None:
        if entries != self.core.failover_log.entries:
            self.core.replace_failover_log(entries)

    def rollback(self, seqno: int) -> int:
        core = self.core
        if seqno >= core.high_seqno:
            return core.high_seqno
        point = core.truncate_to(seqno)
        self.pending = {k: p for k, p in self.pending.items() if p.seqno <= point}
        retain_pending(core.manager, self.pending)
        return point
