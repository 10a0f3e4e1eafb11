"""A bucket on a node: the store, its vbuckets, the flusher task, and status mapping.

Translates between the wire (vbucket ids, memcached expiry rules) and the vbucket layer
(``changefeed.vbucket``), whose errors already are the ``StatusError`` the client receives. One
asyncio task flushes every vbucket with queued items (group commit per vbucket batch). It is the
`VbucketSource` DCP producers read from. Clock and RNG come in through `open`, so a test replays.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from changefeed import limits
from changefeed.checkpoint import (
    ITEM_OVERHEAD_BYTES,
    CursorKind,
    Item,
    MemoryBudget,
    StreamReader,
    Wakeup,
)
from changefeed.checkpoint.flusher import stage_round
from changefeed.producer.stream_request import VbucketView
from changefeed.protocol.errors import KeyNotFoundError, NotMyVbucketError, StatusError
from changefeed.protocol.kv import MutationResult, ObserveSeqnoResult, StoreCommand
from changefeed.protocol.kv_ops import DocumentMeta
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.set_run import SetRun, SetRunAnswers
from changefeed.server.config import NodeConfig
from changefeed.server.persistence import PersistenceHealth
from changefeed.server.persistence_waits import PersistenceWaits, VbucketMark
from changefeed.storage import Op, StorageError, Store
from changefeed.vbucket import (
    Document,
    RunLookup,
    SetManyResult,
    VBucket,
    fields_in_range,
)
from changefeed.vbucket_state import STATE_BY_WIRE_VALUE, VBucketState, initial_state

log = logging.getLogger("changefeed.bucket")

_U32_MAX = 0xFFFF_FFFF
RELATIVE_EXPIRY_MAX_S = 30 * 24 * 3600  # memcached: up to 30 days is relative, above absolute
# The flusher gathers a group commit this long before a round (unless a writer waits for
# persistence: `hurry_flush`). After a round that wrote, too: back-to-back rounds under load
# were a few items per vbucket each, and a round's cost is mostly per vbucket touched (pages
# copied on write in three B-trees, the vbucket's metadata row): the 5 ms gap took a 3-node
# cluster from 26.1 to 22.2 us of node CPU per op at replicas=1 (bench_cluster).
FLUSH_IDLE_S = 0.005
# A round that wrote fewer items than this gathers longer before the next one: a client with
# small windows (16-64 SETs, one or two in flight) made a round of one or two windows every
# 5 ms, and a round costs per vbucket touched (commit, page writes, the writer thread's wake):
# ~900 us of node CPU per window of 16. Nobody waits on these rounds (a writer that waits
# for persistence hurries the round), so plain SETs never wait on disk either way; what a
# longer gap costs is only how long an unawaited write stays in memory alone. While a
# vbucket holds a pending SyncWrite prepare the gap stays short: a replica's persistence is
# what a persistToMajority write waits for, and the replica has no writer to hurry it.
SMALL_ROUND_ITEMS = 1024
FLUSH_GATHER_S = 0.05
# A round stops taking vbuckets past this: one more vbucket's batch (flush_batch_bytes is at most
# STORAGE_BATCH_BYTES_MAX // 64, config.py) must still fit under the store's batch bound.
ROUND_BYTES_MAX = 4 * limits.FLUSH_BATCH_BYTES_MAX


# One vbucket's part of a SET run: keys, values, flags, expiries, datatypes (`Bucket.set_run`).
_Columns = tuple[list[bytes], list[bytes], list[int], list[int], list[int]]


def _end_gap(gap: asyncio.Future[None]) -> None:
    """End a gathering gap (`Bucket._gather`) unless it has ended."""
    if not gap.done():
        gap.set_result(None)


class VBucketSource:
    """A node's vbuckets as the producer reads them (`producer.producer.VbucketSource`): the
    bucket is one, and so is the cluster simulator's node, so both serve streams alike."""

    vbuckets: dict[int, VBucket]

    def vbucket(self, vb: int) -> VBucket:
        """The vbucket `vb`; NotMyVbucketError when this node has none of that id."""
        found = self.vbuckets.get(vb)
        if found is None:
            raise NotMyVbucketError(f"vbucket {vb} does not exist")
        return found

    def vbucket_view(self, vb: int) -> VbucketView | None:
        v = self.vbuckets.get(vb)
        if v is None:
            return None
        return VbucketView(v.state, v.high_seqno, v.persisted_seqno, v.purge_seqno, v.failover_log)

    def open_reader(
        self,
        vb: int,
        name: str,
        start_seqno: int,
        *,
        kind: CursorKind,
        droppable: bool,
        end_seqno: int,
    ) -> StreamReader:
        return self.vbucket(vb).stream(
            name, start_seqno, kind=kind, droppable=droppable, end_seqno=end_seqno
        )

    def wakeup(self, vb: int) -> Wakeup:
        return self.vbucket(vb).manager.wakeup


class Bucket(VBucketSource):
    def __init__(
        self,
        name: str,
        store: Store,
        vbuckets: dict[int, VBucket],
        budget: MemoryBudget,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.name = name
        self.store = store
        self.vbuckets = vbuckets
        self.budget = budget
        self._clock = clock
        self._flush_task: asyncio.Task[None] | None = None
        self._dirty = asyncio.Event()
        self._hurry = asyncio.Event()  # a writer waits for persistence: no gathering gap
        self._queued_to: set[int] = set()  # vbuckets queued to during a gathering gap
        self._gap: asyncio.Future[None] | None = None  # the gathering gap, while it runs
        self._gap_check = False  # a look at `_queued_to` is scheduled (`_check_gap`)
        self.persistence = PersistenceHealth()
        # Told the vbuckets a flush round persisted more of (durable writes wait on it).
        self.persisted_listeners: list[Callable[[list[int]], None]] = []
        # The flusher's commits run here, off the event loop (one writer: LMDB has one).
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="changefeed-flush")
        self.persistence_waits = PersistenceWaits(
            self._mark_of, self.persistence.check_writable, self.hurry_flush
        )
        self.persisted_listeners.append(self.persistence_waits.on_persisted)

    @classmethod
    def open(
        cls,
        config: NodeConfig,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> Bucket:
        """Open (recover) the bucket's store and every vbucket of the node.

        Args:
            config: sizes, paths and durability.
            clock: wall-clock seconds for CAS, expiry and delete times (one clock for all).
            rng: draws vb_uuids; pass a seeded one for a replayable run.
        """
        store = Store(
            config.data_dir / config.bucket,
            map_size_bytes=config.map_size_bytes,
            durable=config.durable,
            start_fresh=config.start_fresh,
        )
        if store.set_aside_to is not None:
            log.warning("damaged store files moved to %s; starting empty", store.set_aside_to)
        budget = MemoryBudget(config.checkpoint_quota_bytes)
        initial = initial_state(clustered=bool(config.etcd))
        vbuckets = {
            vb: VBucket(
                store,
                vb,
                state=initial,
                clock=clock,
                rng=rng,
                budget=budget,
                checkpoint_max_bytes=config.checkpoint_max_bytes,
                flush_batch_bytes_max=config.flush_batch_bytes,
            )
            for vb in range(config.vbuckets)
        }
        return cls(config.bucket, store, vbuckets, budget, clock=clock)

    def start(self) -> None:
        for vb in self.vbuckets.values():
            vb.manager.wakeup.add_callback(self._queued_callback(vb.vb))
        self._flush_task = asyncio.get_running_loop().create_task(self._flush_loop())

    async def close(self) -> int:
        """Stop flushing, flush what is queued, close the store.

        The store is marked cleanly shut down only if everything queued was persisted; else
        the next start treats it as a crash (a new failover entry for every active vbucket,
        so consumers that saw the lost writes roll back).

        Returns:
            Items that could not be persisted (0 normally).
        """
        if self._flush_task is not None:
            self._flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flush_task
        self._writer.shutdown(wait=True)
        unpersisted = 0
        for vb in self.vbuckets.values():
            try:
                vb.flush()
            except StorageError as error:
                lost = vb.high_seqno - vb.persisted_seqno
                unpersisted += lost
                log.error("vb %d: %d items not persisted at shutdown: %s", vb.vb, lost, error)
            vb.release()
        self.persistence_waits.on_persisted(list(self.vbuckets))
        self.persistence_waits.fail_all("the node is stopping")
        try:
            self.store.close(clean=unpersisted == 0)
        except StorageError as error:
            log.error("could not record a clean shutdown (the next start recovers): %s", error)
        return unpersisted

    async def _flush_loop(self) -> None:
        while True:  # the bucket's flusher; cancelled by close()
            self._dirty.clear()
            self._hurry.clear()
            try:
                wrote = await self._flush_round()
            except StorageError as error:
                backoff_s = self.persistence.failed(error)
                self.persistence_waits.fail_all(f"cannot persist: {error}")
                await asyncio.sleep(backoff_s)
                continue
            if not wrote:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._dirty.wait(), 1.0)
            if wrote >= SMALL_ROUND_ITEMS or any(
                vb.has_pending_prepares for vb in self.vbuckets.values()
            ):
                with contextlib.suppress(TimeoutError):  # gather a group commit
                    await asyncio.wait_for(self._hurry.wait(), FLUSH_IDLE_S)
            else:
                await self._gather(FLUSH_GATHER_S)

    def _queued_callback(self, vb: int) -> Callable[[], None]:
        """What a vbucket's queue wakes: the flusher, noting which vbucket (see `_gather`)."""

        def queued() -> None:
            self._queued_to.add(vb)
            self._dirty.set()
            if self._gap is not None and not self._gap_check:
                self._gap_check = True  # one look per loop step, however many writes queue
                self._gap.get_loop().call_soon(self._check_gap)

        return queued

    async def _gather(self, gap_s: float) -> None:
        """Wait up to `gap_s` before the next round, ending early when a writer hurries it or
        a vbucket queued to meanwhile holds a pending prepare: a replica's persistence is what
        a persistToMajority write waits for, and nothing on the replica hurries the round.

        The gap is one future that a timer, the hurry event or `_check_gap` ends: a client with
        small windows queues a run every few hundred microseconds, and waking this coroutine
        for each (two tasks and an `asyncio.wait` per wakeup) cost ~5 % of the node's loop at
        windows of 16 (py-spy). `_check_gap` runs once per loop step that queued anything."""
        loop = asyncio.get_running_loop()
        self._queued_to.clear()  # the caller has just checked every vbucket
        if self._hurry.is_set():
            return
        gap: asyncio.Future[None] = loop.create_future()
        timer = loop.call_later(gap_s, _end_gap, gap)
        hurried = loop.create_task(self._hurry.wait())
        hurried.add_done_callback(lambda _: _end_gap(gap))
        self._gap = gap
        try:
            await gap
        finally:
            self._gap = None
            timer.cancel()
            hurried.cancel()

    def _check_gap(self) -> None:
        """End the gathering gap if a vbucket queued to since the last look holds a pending
        prepare (`_gather`)."""
        self._gap_check = False
        touched, self._queued_to = self._queued_to, set()
        gap = self._gap
        if gap is None or gap.done():
            return
        if any(self.vbuckets[vb].has_pending_prepares for vb in touched):
            gap.set_result(None)

    def _mark_of(self, vb: int) -> VbucketMark | None:
        """What a persistence wait on `vb` checks: its persisted seqno, state and history."""
        vbucket = self.vbuckets.get(vb)
        if vbucket is None:
            return None
        return VbucketMark(vbucket.persisted_seqno, vbucket.state, vbucket.vb_uuid)

    def hurry_flush(self) -> None:
        """A writer waits for persistence (OBSERVE_SEQNO polls below the high seqno, a
        durable write is pending): the next flush round starts without its gathering gap."""
        self._hurry.set()

    async def _flush_round(self) -> int:
        """One batch of every vbucket with queued items, all in one transaction: one commit
        (one fsync when durable) per round instead of one per vbucket. The batch is filled
        on the event loop and committed on the writer thread, so requests are served while
        LMDB commits and fsyncs (both release the GIL). A failed commit raises (every
        flusher keeps its batch queued) and is retried by the loop."""
        flush_round = stage_round(
            self.store, (vb.flusher for vb in self.vbuckets.values()), ROUND_BYTES_MAX
        )
        if flush_round is None:
            self.persistence.succeeded()
            return 0  # no empty transaction
        commit = asyncio.get_running_loop().run_in_executor(
            self._writer, self.store.commit_batch, flush_round.batch
        )
        cancelled = await _settle(commit)
        failure = commit.exception()
        if failure is not None:
            flush_round.failed()
        else:
            wrote, moved = flush_round.committed()
            self.persistence.succeeded()
            for listener in self.persisted_listeners:
                listener(moved)
        if cancelled:
            raise asyncio.CancelledError  # close(): stop, with every staged item settled
        if failure is not None:
            raise failure
        return wrote

    # -- KV --------------------------------------------------------------------------------------

    def store_command(self, command: StoreCommand, *, level: int = 0) -> MutationResult:
        """SET / ADD / REPLACE; TMPFAIL while the store cannot persist. A durability `level`
        queues a prepare (server/sync_writes.py decides its outcome)."""
        vb = self.vbucket(command.vbucket)
        self.persistence.check_writable()
        expiry = absolute_expiry(command.expiry, self._clock())
        if command.opcode == Opcode.ADD:
            return vb.add(
                command.key,
                command.value,
                flags=command.flags,
                expiry=expiry,
                datatype=command.datatype,
                level=level,
            )
        if command.opcode == Opcode.REPLACE:
            return vb.replace(
                command.key,
                command.value,
                flags=command.flags,
                expiry=expiry,
                datatype=command.datatype,
                cas=command.cas,
                level=level,
            )
        return vb.set(
            command.key,
            command.value,
            flags=command.flags,
            expiry=expiry,
            datatype=command.datatype,
            cas=command.cas,
            level=level,
        )

    def set_run(self, run: SetRun, *, level: int = 0) -> SetRunAnswers:
        """The plain SETs of one received batch (no CAS), answered as columns in run order:
        each vbucket's writes are applied together (`VBucket.set_many`), in their order
        within it. A durability `level` queues each as a prepare (`store_command`'s)."""
        count = len(run)
        try:
            self.persistence.check_writable()
        except StatusError as error:
            return SetRunAnswers([0] * count, [0] * count, [0] * count,
                                 dict.fromkeys(range(count), error))  # fmt: skip
        if self.might_pass_upper_mark(run.keys, run.values):
            return self._set_one_by_one(run, level)
        now = self._clock()
        by_vb: dict[int, list[int]] = {}
        for index, vb in enumerate(run.vbuckets):
            group = by_vb.get(vb)
            if group is None:
                by_vb[vb] = [index]
            else:
                group.append(index)
        answers = SetRunAnswers([0] * count, [0] * count, [0] * count, {})
        cases, seqnos, vb_uuids, errors = (
            answers.cases,
            answers.seqnos,
            answers.vb_uuids,
            answers.errors,
        )
        keys, values, flags, datatypes = run.keys, run.values, run.flags, run.datatypes
        # Relative expiries made absolute once for the run (none at all: the usual case).
        expiries = run.expiries
        if any(expiries):
            expiries = [absolute_expiry(expiry, now) for expiry in expiries]
        if run.checked:  # one check of the expiries made absolute, if any were
            fields_checked = expiries is run.expiries or max(expiries) <= _U32_MAX
        else:
            fields_checked = count > 0 and fields_in_range(
                (keys, values, flags, expiries, datatypes)
            )
        # Each vbucket's columns, then its keys that memory does not hold, looked up in one
        # read transaction. A vbucket with one write of the run (most of them, for a small
        # window over many vbuckets) builds no columns: `VBucket.set_single` takes the write
        # as it is (a run of one through `set_many`, ~40 % more, only if it declines).
        groups: list[tuple[int, list[int], VBucket | None, _Columns | None]] = []
        in_memory: dict[int, list[Item | None]] = {}
        missing: dict[int, list[bytes]] = {}
        vbuckets = self.vbuckets
        for vb, indexes in by_vb.items():
            vbucket = vbuckets.get(vb)
            columns: _Columns | None = None
            if len(indexes) > 1:
                columns = (
                    [keys[i] for i in indexes],
                    [values[i] for i in indexes],
                    [flags[i] for i in indexes],
                    [expiries[i] for i in indexes],
                    [datatypes[i] for i in indexes],
                )
            groups.append((vb, indexes, vbucket, columns))
            if vbucket is not None and vbucket.state.is_active:
                in_memory[vb], missing[vb] = vbucket.lookup_memory(
                    (keys[indexes[0]],) if columns is None else columns[0]
                )
        stored = self.store.get_many_across(missing)
        for vb, indexes, vbucket, columns in groups:
            if vbucket is None:
                errors.update(
                    dict.fromkeys(indexes, NotMyVbucketError(f"vbucket {vb} does not exist"))
                )
                continue
            outcome: SetManyResult | None = None
            if columns is None:
                i = indexes[0]
                if not level and vb in in_memory:
                    outcome = vbucket.set_single(
                        keys[i], values[i], flags[i], expiries[i], datatypes[i],
                        found=in_memory[vb][0], stored=stored[vb], fields_checked=fields_checked,
                    )  # fmt: skip
                if outcome is None:
                    columns = ([keys[i]], [values[i]], [flags[i]], [expiries[i]], [datatypes[i]])
            if outcome is None:
                assert columns is not None, vb
                outcome = vbucket.set_many(
                    *columns,
                    lookup=RunLookup(in_memory[vb], stored[vb]) if vb in in_memory else None,
                    fields_checked=fields_checked,
                    level=level,
                )
            vb_uuid = outcome.vb_uuid
            if len(indexes) == 1:  # most vbuckets of a small window: no loops
                index = indexes[0]
                seqnos[index], cases[index], vb_uuids[index] = (
                    outcome.seqnos[0], outcome.cases[0], vb_uuid
                )  # fmt: skip
                if outcome.errors:
                    errors[index] = outcome.errors[0]
                continue
            for index, seqno, cas in zip(indexes, outcome.seqnos, outcome.cases, strict=True):
                seqnos[index], cases[index], vb_uuids[index] = seqno, cas, vb_uuid
            for at, refused in outcome.errors.items():
                errors[indexes[at]] = refused
        return answers

    def might_pass_upper_mark(self, keys: Sequence[bytes], values: Sequence[bytes]) -> bool:
        """Whether writes of `keys` (SETs, DELETEs, GETs that may expire their document) with
        `values` might take checkpoint memory past the upper mark (each may queue its key's
        expiration too: two items, the key twice). Below it,
        no write of them is refused TMPFAIL and no recovery runs, so applying them vbucket
        by vbucket, as runs, answers what one write at a time in request order would (and
        a run of repeated keys is not refused where one at a time it fits)."""
        budget = self.budget
        bound = 2 * (sum(map(len, keys)) + len(keys) * ITEM_OVERHEAD_BYTES) + sum(map(len, values))
        return budget.used_bytes + bound > budget.upper_mark_bytes

    def _set_one_by_one(self, run: SetRun, level: int) -> SetRunAnswers:
        """`set_run` of a run memory might not hold: each write alone, in request order, as
        `store_command` applies a SET (a run asks room for all its writes at once and stops
        at the first refused, where one at a time a later, smaller write may still fit, and
        a repeated key's earlier version may be deduplicated away first)."""
        count = len(run)
        answers = SetRunAnswers([0] * count, [0] * count, [0] * count, {})
        now = self._clock()
        columns = zip(run.vbuckets, run.keys, run.values, run.flags, run.expiries, run.datatypes,
                      strict=True)  # fmt: skip
        for index, (vb, key, value, flags, expiry, datatype) in enumerate(columns):
            try:
                result = self.vbucket(vb).set(
                    key, value, flags=flags, expiry=absolute_expiry(expiry, now),
                    datatype=datatype, level=level,
                )  # fmt: skip
            except StatusError as error:
                answers.errors[index] = error
                continue
            answers.cases[index], answers.seqnos[index] = result.cas, result.seqno
            answers.vb_uuids[index] = result.vb_uuid
        return answers

    def delete(self, vb: int, key: bytes, *, cas: int = 0, level: int = 0) -> MutationResult:
        """DELETE; TMPFAIL while the store cannot persist; `level` as `store_command`."""
        vbucket = self.vbucket(vb)
        self.persistence.check_writable()
        return vbucket.delete(key, cas=cas, level=level)

    @contextlib.contextmanager
    def stored_read_ahead(
        self, wanted: Mapping[int, Sequence[bytes]], expiring_within_s: float
    ) -> Iterator[set[tuple[int, bytes]]]:
        """While the block runs, the active vbuckets' reads (`VBucket.current`: GET, DELETE,
        the checks of a write) of `wanted` keys memory has none of take their records from
        one store transaction made here, not one transaction and two B-tree lookups each:
        a window's GETs and DELETEs (request_window.py). Valid within one loop step (the
        invariant of `VBucket.current`'s `stored`), so the block must not await. A store
        error here reads nothing ahead: each read then meets it alone, as before.

        Yields the (vb, key) of `wanted` whose live version (memory or store) expires within
        `expiring_within_s` of now: a read of one may queue its expiration, a write."""
        missing: dict[int, list[bytes]] = {}
        expiring: set[tuple[int, bytes]] = set()
        horizon = self._clock() + expiring_within_s
        for vb, keys in wanted.items():
            vbucket = self.vbuckets.get(vb)
            if vbucket is None or not vbucket.state.is_active or not keys:
                continue  # a GET or DELETE there answers NOT_MY_VBUCKET: it reads nothing
            in_memory, absent = vbucket.lookup_memory(keys)
            for key, item in zip(keys, in_memory, strict=True):
                if item is not None and item.op is Op.MUTATION and 0 < item.expiry <= horizon:
                    expiring.add((vb, key))
            if absent:
                missing[vb] = absent
        try:
            stored = self.store.get_many_across(missing) if missing else {}
        except StorageError:  # nothing read ahead; any of them may be expired
            stored = {}
            expiring.update((vb, key) for vb, keys in missing.items() for key in keys)
        replaced = []
        for vb, found in stored.items():
            for key, record in found.items():
                if record is not None and record.op is Op.MUTATION and 0 < record.expiry <= horizon:
                    expiring.add((vb, key))
            replaced.append((self.vbuckets[vb], self.vbuckets[vb].read_ahead(found)))
        try:
            yield expiring
        finally:
            for vbucket, previous in reversed(replaced):
                vbucket.read_ahead(previous)

    def get(self, vb: int, key: bytes) -> Document:
        vbucket = self.vbucket(vb)
        if not vbucket.state.is_active:
            raise NotMyVbucketError(f"vb {vb} is {vbucket.state.value}, not active here")
        document = vbucket.get(key)
        if document is None:
            raise KeyNotFoundError(f"key {key[:64]!r} not found")
        return document

    def get_replica(self, vb: int, key: bytes) -> Document:
        """GET_REPLICA: read this node's replica copy (what it has received so far)."""
        vbucket = self.vbucket(vb)
        if not vbucket.state.is_replica:
            raise NotMyVbucketError(f"vb {vb} is {vbucket.state.value}, not a replica here")
        document = vbucket.get(key)
        if document is None:
            raise KeyNotFoundError(f"key {key[:64]!r} not found")
        return document

    # -- the Couchbase SDK's KV surface (server/kv_commands.py, server/subdoc.py) ---------------

    def active(self, vb: int) -> VBucket:
        """`vb` if it is active here, else NotMyVbucketError (writes and locks need the active)."""
        vbucket = self.vbucket(vb)
        if not vbucket.state.is_active:
            raise NotMyVbucketError(f"vb {vb} is {vbucket.state.value}, not active here")
        return vbucket

    def read(self, vb: int, key: bytes) -> Document | None:
        """The current version of `key` on the active `vb`, or None (a read-modify-write's
        read: the write that follows runs in the same loop step, so nothing comes between)."""
        return self.active(vb).get(key)

    def now(self) -> float:
        """Wall-clock seconds of the bucket's clock (the one CAS, expiry and locks use)."""
        return self._clock()

    def expiry_from_wire(self, expiry: int) -> int:
        """A wire expiry (0 never, <= 30 days relative, else Unix time) as absolute seconds."""
        return absolute_expiry(expiry, self._clock())

    def write(
        self,
        opcode: int,
        vb: int,
        key: bytes,
        value: bytes,
        *,
        flags: int,
        expiry: int,
        datatype: int,
        cas: int = 0,
        level: int = 0,
    ) -> MutationResult:
        """SET / ADD / REPLACE with an absolute `expiry` (a read-modify-write keeping the
        document's own); TMPFAIL while the store cannot persist; `level` as `store_command`."""
        vbucket = self.active(vb)
        self.persistence.check_writable()
        if opcode == Opcode.ADD:
            return vbucket.add(
                key, value, flags=flags, expiry=expiry, datatype=datatype, level=level
            )
        if opcode == Opcode.REPLACE:
            return vbucket.replace(
                key, value, flags=flags, expiry=expiry, datatype=datatype, cas=cas, level=level
            )
        assert opcode == Opcode.SET, opcode
        return vbucket.set(
            key, value, flags=flags, expiry=expiry, datatype=datatype, cas=cas, level=level
        )

    def get_locked(self, vb: int, key: bytes, lock_s: int) -> Document:
        """GET_LOCKED; a lock time of 0 or above ITEM_LOCK_MAX_S gets ITEM_LOCK_DEFAULT_S."""
        if not 0 < lock_s <= limits.ITEM_LOCK_MAX_S:
            lock_s = limits.ITEM_LOCK_DEFAULT_S
        return self.active(vb).get_locked(key, lock_s)

    def unlock(self, vb: int, key: bytes, cas: int) -> None:
        self.active(vb).unlock(key, cas)

    def touch(self, vb: int, key: bytes, expiry: int, *, cas: int = 0) -> MutationResult:
        """TOUCH / GAT (`expiry` as on the wire); TMPFAIL while the store cannot persist."""
        vbucket = self.active(vb)
        self.persistence.check_writable()
        return vbucket.touch(key, self.expiry_from_wire(expiry), cas=cas)

    def get_meta(self, vb: int, key: bytes) -> DocumentMeta:
        meta = self.active(vb).get_meta(key)
        if meta is None:
            raise KeyNotFoundError(f"key {key[:64]!r} not found")
        return meta

    # -- seqnos and failover logs -------------------------------------------------------------

    def vbucket_ids(self) -> list[int]:
        return sorted(self.vbuckets)

    def state_counts(self) -> dict[VBucketState, int]:
        """vbuckets per state (every state listed, zero included): STAT vb_<state>_num."""
        counts = dict.fromkeys(VBucketState, 0)
        for v in self.vbuckets.values():
            counts[v.state] += 1
        return counts

    def seqnos(self, vb: int) -> tuple[int, int, int]:
        v = self.vbucket(vb)
        return v.high_seqno, v.persisted_seqno, v.purge_seqno

    def vb_seqnos(self, state_filter: int) -> list[tuple[int, int]]:
        wanted = STATE_BY_WIRE_VALUE.get(state_filter)
        return [
            (vb, v.high_seqno)
            for vb, v in sorted(self.vbuckets.items())
            if (v.state is wanted if wanted else v.state.holds_copy)
        ]

    def failover_log(self, vb: int) -> list[tuple[int, int]]:
        return self.vbucket(vb).failover_log.entries

    def observe_seqno(self, vb: int, vb_uuid: int) -> ObserveSeqnoResult:
        """OBSERVE_SEQNO; while the store cannot persist, a TMPFAIL naming the error, so a
        writer waiting for persistence learns why instead of timing out."""
        v = self.vbucket(vb)
        if v.persisted_seqno < v.high_seqno:
            self.persistence.check_writable()
            self.hurry_flush()
        entries = v.failover_log.entries
        if vb_uuid == v.vb_uuid or vb_uuid not in [u for u, _ in entries]:
            return ObserveSeqnoResult(vb, v.vb_uuid, v.persisted_seqno, v.high_seqno)
        index = [u for u, _ in entries].index(vb_uuid)
        branch_end = entries[index - 1][1]  # the newer entry's seqno ends the old branch
        return ObserveSeqnoResult(
            vb, v.vb_uuid, v.persisted_seqno, v.high_seqno, vb_uuid, branch_end
        )

    # -- stats ---------------------------------------------------------------------------------

    def item_count(self) -> int:
        """Live items on disk (queued, unflushed writes are not counted)."""
        return sum(self.store.item_count(vb) for vb in self.vbuckets)

    def checkpoint_memory_bytes(self) -> int:
        return sum(v.manager.memory_bytes for v in self.vbuckets.values())

    def seqno_stats(self, vbs: list[int] | None) -> Iterator[tuple[str, str]]:
        """STAT vbucket-seqno keys (dcp-wire.md §7.17)."""
        for vb in vbs if vbs is not None else self.vbucket_ids():
            v = self.vbucket(vb)
            meta = self.store.vbucket_meta(vb)
            yield f"vb_{vb}:high_seqno", str(v.high_seqno)
            yield f"vb_{vb}:abs_high_seqno", str(v.high_seqno)
            yield f"vb_{vb}:last_persisted_seqno", str(v.persisted_seqno)
            yield f"vb_{vb}:uuid", str(v.vb_uuid)
            yield f"vb_{vb}:purge_seqno", str(v.purge_seqno)
            yield f"vb_{vb}:last_persisted_snap_start", str(meta.snap_start if meta else 0)
            yield f"vb_{vb}:last_persisted_snap_end", str(meta.snap_end if meta else 0)

    def failover_stats(self, vbs: list[int] | None) -> Iterator[tuple[str, str]]:
        for vb in vbs if vbs is not None else self.vbucket_ids():
            entries = self.vbucket(vb).failover_log.entries
            yield f"vb_{vb}:num_entries", str(len(entries))
            for i, (uuid, seqno) in enumerate(entries):
                yield f"vb_{vb}:{i}:id", str(uuid)
                yield f"vb_{vb}:{i}:seq", str(seqno)


async def _settle(future: asyncio.Future[None]) -> bool:
    """Wait for `future` to end even if this task is cancelled meanwhile (a commit on the
    writer thread runs on regardless: its items must end durable or queued again, never
    unknown); returns whether the task was cancelled."""
    try:
        await asyncio.wait([future])
    except asyncio.CancelledError:
        await asyncio.wait([future])
        return True
    return False


def absolute_expiry(expiry: int, now: float) -> int:
    """Memcached rule: 0 never expires, <= 30 days is relative seconds, else a Unix time.

    `now` is the vbucket's clock, the one expiry is later checked against.
    """
    if expiry == 0 or expiry > RELATIVE_EXPIRY_MAX_S:
        return expiry
    return int(now) + expiry
