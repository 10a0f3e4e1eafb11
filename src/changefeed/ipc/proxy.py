"""The proxy (reader): `subscribe` to a service and take zero-copy Arrow batches from it.

Creation follows the seed's proxy restart sequence exactly:

1. A shared ``flock`` on the service's usage marker (held until `Subscription.close`; the
   provider then knows the segments are in use and never removes or recreates them).
2. The segments are mapped and the control segment is checked (`layout.check_control`).
3. Rollback synchronization, per process and service instance: the first proxy of this
   process registers its UID/PID pair (an old pid coming back is reported to the provider over
   its control socket: ``outdated <app_id> <pid> <start>``, idempotent) and marks the logs its
   application id left behind as needs-rollback; every proxy then rolls back the first marked
   log that can be (`TransactionLogSet.rollback`). A log caught mid-transaction stays
   quarantined; the proxy is still created if a free log can be registered.
   Steps 3 run under the service's rollback lock (an flock: dropped if this process dies),
   which the provider also takes to reclaim a dead reader's log: one log is rolled back once.
4. Registration: a free transaction log, taken by CAS of its owner id; then the subscription,
   bracketed by SubscribeTxBegin/Commit (subscriber count and slot budget, `max_samples`).

Reading: batches have consecutive seqs. `Subscription.receive` takes the next one: it finds
its slot (seq index, or a scan), then references it inside a transaction — ReferenceTxBegin,
CAS of the slot's state word from (seq, n) to (seq, n + 1), ReferenceTxCommit. The CAS fails if
the provider reused the slot meanwhile: the batch is lost and `LostDataError` says so, with the
reader's position as DCP session state. A `Sample` stays valid (the provider cannot reuse its
slot) until released — `release()` or ``with sample:`` — bracketed by DereferenceTxBegin/Commit.
A reader holds at most `max_samples` samples at once (`SampleBudgetError` beyond).

Waiting: with nothing new, the reader sets its log's WAITING flag, checks the head again and
sleeps on its wakeup socket (an abstract unix datagram address per log), which the provider
writes to after a publish; it also wakes every 100 ms by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.consumer.session import SessionState, VbSession
from changefeed.failover import FailoverLog
from changefeed.ipc import txlog as _txlog
from changefeed.ipc.atomic import Atomics, atomics_for
from changefeed.ipc.errors import (
    CouldNotRestartProxyError,
    IpcError,
    LostDataError,
    MaxSubscribersError,
    SampleBudgetError,
    ServiceNotFoundError,
    ServiceReplacedError,
)
from changefeed.ipc.layout import (
    HEAD_SEQ_AT,
    INITIALIZING,
    NODE_LOST,
    NODE_NEXT_SEQ,
    NODE_WAITING,
    POSITION_FIELDS,
    PROVIDER_PID_AT,
    REFCOUNT_BITS,
    REPLACED,
    SEQ_IN_WRITING,
    SERVICE_STATE_AT,
    SLOT_FLAG_GAP,
    SLOT_HEADER,
    Header,
    check_control,
)
from changefeed.ipc.ring import dereference, find_slot, reference
from changefeed.ipc.segments import Marker, Segment, ServicePaths, try_lock
from changefeed.ipc.txlog import (
    Liveness,
    ProcessIdentity,
    RollbackResult,
    TransactionLog,
    TransactionLogSet,
    is_alive,
)

log = logging.getLogger("changefeed.ipc")

WAIT_TICK_S: Final = 0.1  # a sleeping reader looks again at least this often
# Before sleeping on its wakeup socket a reader looks at the head this many times, yielding the
# CPU in between (tens of us in all): at full speed the next batch often comes within that, and
# is taken without the provider's datagram and the reader's wakeup (bench_ipc.py).
SPIN_ROUNDS: Final = 20
Start = Literal["next", "oldest"] | int


_crash = _txlog._crash


# -- rollback synchronization (LoLa's RollbackSynchronization, process-local) ----------------


class _RollbackSync:
    """One mutex per service instance in this process, and whether its first proxy ran."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mutexes: dict[tuple[str, int], threading.Lock] = {}
        self._prepared: set[tuple[str, int]] = set()

    def mutex(self, key: tuple[str, int]) -> tuple[threading.Lock, bool]:
        """The service's mutex, and whether this process prepared the service already."""
        with self._lock:
            mutex = self._mutexes.setdefault(key, threading.Lock())
            return mutex, key in self._prepared

    def prepared(self, key: tuple[str, int]) -> bool:
        with self._lock:
            if key in self._prepared:
                return False
            self._prepared.add(key)
            return True

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


_SYNC = _RollbackSync()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SYNC.reset)  # a forked child is a new process


# -- samples ---------------------------------------------------------------------------------


class Sample:
    """One batch held by a reader: valid (its slot cannot be reused) until released.

    ``batch`` is a zero-copy Arrow record batch over the shared memory: do not use it after
    `release` (copy it first, e.g. ``pa.concat_batches([batch])``, to keep it longer).
    """

    __slots__ = (
        "_batch",
        "_size",
        "_sub",
        "_view",
        "flags",
        "published_ns",
        "released",
        "rows",
        "seq",
        "slot",
    )

    def __init__(
        self,
        sub: Subscription,
        seq: int,
        slot: int,
        view: memoryview,
        rows: int,
        size: int,
        flags: int,
        published_ns: int,
    ) -> None:
        self._sub = sub
        self._size = size
        self.seq = seq
        self.slot = slot
        self._view = view
        self.rows = rows
        self.flags = flags
        self.published_ns = published_ns
        self._batch: pa.RecordBatch | None = None
        self.released = False

    @property
    def batch(self) -> pa.RecordBatch:
        """The change rows (CHANGE_ROW_SCHEMA), read in place."""
        assert not self.released, f"batch {self.seq} was released"
        if self._batch is None:
            at = self._sub.header.geometry.payload_at
            payload = pa.py_buffer(self._view[at : at + self._size])
            self._batch = pa.ipc.read_record_batch(payload, CHANGE_ROW_SCHEMA)
        return self._batch

    @property
    def positions(self) -> NDArray[np.uint64]:
        """``(group_size, 5)``: per vbucket of the group (vb_uuid, seqno, snap_start, snap_end,
        seqno_before), the publisher's position after this batch (a copy)."""
        group = len(self._sub.header.geometry.group)
        at = self._sub.header.geometry.positions_at
        raw = self._view[at : at + 8 * POSITION_FIELDS * group]
        return np.frombuffer(raw, "<u8").reshape(group, POSITION_FIELDS).astype(np.uint64)

    def release(self) -> None:
        """Give the slot back (idempotent)."""
        if not self.released:
            self._batch = None
            self.released = True
            self._sub._release(self)

    def __enter__(self) -> Sample:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"Sample(seq={self.seq}, slot={self.slot}, rows={self.rows}, {state})"


@dataclass(frozen=True, slots=True)
class CreationReport:
    """What proxy creation found: the rollback, and the outdated pid it reported."""

    rollback: RollbackResult
    marked: tuple[int, ...]
    outdated: ProcessIdentity | None


# -- the subscription -------------------------------------------------------------------------


class Subscription:
    """A subscribed proxy of one service. Build with `subscribe`."""

    def __init__(
        self,
        paths: ServicePaths,
        usage: Marker,
        control: Segment,
        data: Segment,
        atomics: Atomics,
        header: Header,
        logs: TransactionLogSet,
        txlog: TransactionLog,
        max_samples: int,
        report: CreationReport,
    ) -> None:
        self.paths = paths
        self.service = paths.service
        self.header = header
        self.report = report
        self.max_samples = max_samples
        self._usage = usage
        self._control = control
        self._data = data
        self._a = atomics
        self._logs = logs
        self._log = txlog
        layout = header.layout
        geometry = header.geometry
        self._states = [layout.slot_state(i) for i in range(geometry.slot_count)]
        self._slot_bytes = geometry.slot_bytes
        self._layout = layout
        self._held: dict[int, Sample] = {}
        self._positions: bytes | None = None  # raw positions after the last batch taken
        geometry = header.geometry
        self._positions_span = (
            geometry.positions_at,
            geometry.positions_at + 8 * POSITION_FIELDS * len(geometry.group),
        )
        self.next_seq = 1
        self._closed = False
        self._wakeup = _wakeup_socket(paths.wakeup_address(header.segment_id, txlog.index))
        self._waker_loop: asyncio.AbstractEventLoop | None = None  # watching self._wakeup
        self._woken: asyncio.Future[None] | None = None  # the waiting task's, while it waits
        self.stats = {"received": 0, "rows": 0, "lost": 0, "waits": 0}

    # -- reading --------------------------------------------------------------------------------

    @property
    def log_index(self) -> int:
        return self._log.index

    @property
    def group(self) -> tuple[int, ...]:
        return self.header.geometry.group

    @property
    def head_seq(self) -> int:
        return self._a.load_u64(HEAD_SEQ_AT)

    @property
    def service_state(self) -> int:
        return self._a.load_u32(SERVICE_STATE_AT)

    @property
    def provider_pid(self) -> int:
        return self._a.load_u32(PROVIDER_PID_AT)

    def oldest_seq(self) -> int:
        """The oldest batch from which the ring holds every batch up to the head (0: none)."""
        present = {self._a.load_u64(at) >> REFCOUNT_BITS for at in self._states}
        present -= {0, SEQ_IN_WRITING}  # empty slots, and the one being written
        seq = self._a.load_u64(HEAD_SEQ_AT)
        if seq not in present:
            return 0
        while seq - 1 in present:  # bounded by the slot count
            seq -= 1
        return seq

    def seek(self, start: Start) -> None:
        """Read next from `start`: "next" (the next batch published), "oldest" (the oldest
        still in the ring) or a seq. The position (session state) is that of the batch before
        it, when the ring still holds it."""
        if start == "next":
            seq = self.head_seq + 1
        elif start == "oldest":
            seq = self.oldest_seq() or self.head_seq + 1
        else:
            assert isinstance(start, int) and start >= 1, start
            seq = start
        self.next_seq = seq
        positions = self.positions_of(seq - 1)
        self._positions = None if positions is None else positions.astype("<u8").tobytes()
        self._a.store_u64(self._log.node + NODE_NEXT_SEQ, seq)

    @property
    def positions(self) -> NDArray[np.uint64] | None:
        """Per vbucket of the group, the position after the last batch taken (None: unknown)."""
        if self._positions is None:
            return None
        return np.frombuffer(self._positions, "<u8").reshape(-1, POSITION_FIELDS).astype(np.uint64)

    def session_state(self) -> SessionState | None:
        """The position as DCP session state (resume over DCP after `LostDataError`)."""
        positions = self.positions
        return None if positions is None else positions_to_session(self.group, positions)

    def receive(self, timeout_s: float | None = None) -> Sample | None:
        """The next batch, waiting up to `timeout_s` (None: forever); None on timeout.

        Raises:
            LostDataError: the next batch is no longer in the ring (or did not fit a slot).
            SampleBudgetError: `max_samples` samples are held.
            ServiceReplacedError: the provider replaced the segments.
        """
        assert not self._closed, "receive after close"
        if len(self._held) >= self.max_samples:
            raise SampleBudgetError(
                f"{len(self._held)} samples held, max_samples {self.max_samples}: release one"
            )
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:  # bounded by the deadline; each round takes a batch, fails, or waits
            seq = self.next_seq
            if self._a.load_u64(HEAD_SEQ_AT) >= seq:
                sample = self._take(seq)
                if sample is None:
                    self._lost(seq, "it was overwritten before this reader took it")
                assert sample is not None
                if sample.flags & SLOT_FLAG_GAP:
                    sample.release()
                    self._lost(seq, "its rows did not fit a slot")
                self.next_seq = seq + 1
                start, end = self._positions_span
                self._positions = bytes(sample._view[start:end])
                self._a.store_u64(self._log.node + NODE_NEXT_SEQ, seq + 1)
                self.stats["received"] += 1
                self.stats["rows"] += sample.rows
                return sample
            if self.service_state == REPLACED:
                raise ServiceReplacedError(
                    f"service {self.service!r} was recreated by its provider: subscribe again"
                )
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            self._wait(seq, WAIT_TICK_S if remaining is None else min(remaining, WAIT_TICK_S))

    async def areceive(self, timeout_s: float | None = None) -> Sample | None:
        """`receive` for an asyncio caller: waits on the event loop, never blocks it."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:  # bounded by the deadline; each round takes a batch or waits a tick
            sample = self.receive(0)
            if sample is not None:
                return sample
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            await self._await_wakeup(
                WAIT_TICK_S if remaining is None else min(remaining, WAIT_TICK_S)
            )

    async def _await_wakeup(self, timeout_s: float) -> None:
        a = self._a
        flag = self._log.node + NODE_WAITING
        loop = asyncio.get_running_loop()
        if self._wakeup is not None and self._waker_loop is not loop:
            self._watch_wakeups(loop)
        # The future exists before the flag is set: a publish after the head check below sends
        # a datagram, whose callback (run only once this task awaits) resolves it.
        woken: asyncio.Future[None] = loop.create_future()
        self._woken = woken
        a.store_u8(flag, 1)
        try:
            if a.load_u64(HEAD_SEQ_AT) >= self.next_seq:
                return
            if self._wakeup is None:
                await asyncio.sleep(0.001)
                return
            timer = loop.call_later(timeout_s, _resolve, woken)
            try:
                await woken
            finally:
                timer.cancel()
        finally:
            self._woken = None
            a.store_u8(flag, 0)

    def _watch_wakeups(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch the wakeup socket from `loop` for the subscription's life (one registration,
        not one per wait: add_reader/remove_reader and a wait_for task per batch were most
        of a waiting reader's CPU per batch)."""
        assert self._wakeup is not None
        self._unwatch_wakeups()
        loop.add_reader(self._wakeup.fileno(), self._on_wakeup)
        self._waker_loop = loop

    def _unwatch_wakeups(self) -> None:
        loop, self._waker_loop = self._waker_loop, None
        if loop is not None and self._wakeup is not None and not loop.is_closed():
            with contextlib.suppress(Exception):  # a loop of another thread, or stopping
                loop.remove_reader(self._wakeup.fileno())

    def _on_wakeup(self) -> None:
        assert self._wakeup is not None
        with contextlib.suppress(BlockingIOError, OSError):
            while self._wakeup.recv(64):  # drain: one wakeup is as good as many
                pass
        if self._woken is not None:
            _resolve(self._woken)

    def __iter__(self) -> Iterator[Sample]:
        """Every batch, waiting for new ones; the caller releases each (``with sample:``)."""
        while not self._closed:  # ends when the subscription is closed
            sample = self.receive()
            if sample is not None:
                yield sample

    def fileno(self) -> int:
        """The wakeup socket, readable after a publish while `waiting` was set (for select)."""
        return self._wakeup.fileno() if self._wakeup is not None else -1

    def _lost(self, seq: int, why: str) -> None:
        self.stats["lost"] += 1
        self._a.fetch_add_u64(self._log.node + NODE_LOST, 1)
        oldest = self.oldest_seq()
        raise LostDataError(
            f"service {self.service!r}: batch {seq} is lost ({why}); oldest in the ring is "
            f"{oldest}. Resume over DCP from the session state.",
            wanted_seq=seq,
            oldest_seq=oldest,
            session=self.session_state(),
        )

    def _take(self, seq: int) -> Sample | None:
        """Reference batch `seq` inside a transaction; None if its slot no longer holds it."""
        slot = reference(self._a, self._layout, self._log, seq)
        if slot is None:
            return None
        base = slot * self._slot_bytes
        view = self._data.buf[base : base + self._slot_bytes]
        header = SLOT_HEADER.unpack_from(view, 0)
        assert header[0] == seq, (header[0], seq)
        sample = Sample(self, seq, slot, view, header[1], header[2], header[4], header[6])
        self._held[slot] = sample
        return sample

    def _release(self, sample: Sample) -> None:
        assert self._held.get(sample.slot) is sample, sample
        dereference(self._a, self._layout, self._log, sample.slot)
        del self._held[sample.slot]

    def _wait(self, seq: int, timeout_s: float) -> None:
        a = self._a
        flag = self._log.node + NODE_WAITING
        a.store_u8(flag, 1)
        try:
            for _ in range(SPIN_ROUNDS):  # a batch due any moment is taken without a wakeup
                if a.load_u64(HEAD_SEQ_AT) >= seq:
                    return
                os.sched_yield()
            self.stats["waits"] += 1
            if self._wakeup is None:
                time.sleep(min(timeout_s, 0.001))
                return
            readable, _, _ = select.select([self._wakeup], [], [], timeout_s)
            if readable:
                with contextlib.suppress(BlockingIOError):
                    while self._wakeup.recv(64):  # drain: one wakeup is as good as many
                        pass
        finally:
            a.store_u8(flag, 0)

    def positions_of(self, seq: int) -> NDArray[np.uint64] | None:
        """Positions stored with batch `seq` (read without a reference: then checked that the
        slot still held it after the copy)."""
        if seq < 1:
            return None
        slot = find_slot(self._a, self._layout, seq)
        if slot is None:
            return None
        geometry = self.header.geometry
        at = slot * self._slot_bytes + geometry.positions_at
        raw = bytes(self._data.buf[at : at + 8 * POSITION_FIELDS * len(geometry.group)])
        # Acquire fence, paired with the provider's release fence after its IN_WRITING CAS
        # (ring.claim_slot): the copy above is complete before the validating load below, so
        # if the slot still holds `seq` the copy saw none of a rewrite.
        self._a.fence_acquire()
        if self._a.load_u64(self._states[slot]) >> REFCOUNT_BITS != seq:
            return None
        return np.frombuffer(raw, "<u8").reshape(-1, POSITION_FIELDS).astype(np.uint64)

    def flags_of(self, seq: int) -> int | None:
        """The slot flags of batch `seq` (SLOT_FLAG_GAP), read as `positions_of` reads: None if
        no slot holds it (checked after the read)."""
        if seq < 1:
            return None
        slot = find_slot(self._a, self._layout, seq)
        if slot is None:
            return None
        header = SLOT_HEADER.unpack_from(self._data.buf, slot * self._slot_bytes)
        self._a.fence_acquire()  # paired with ring.claim_slot's release fence, as positions_of
        if self._a.load_u64(self._states[slot]) >> REFCOUNT_BITS != seq:
            return None
        return int(header[4])

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Release every sample, unsubscribe, free the log, drop the usage lock, unmap."""
        if self._closed:
            return
        self._closed = True
        for sample in list(self._held.values()):
            sample.release()
        txlog = self._log
        max_samples = txlog.max_samples
        txlog.unsubscribe_begin()
        _crash("unsubscribe.begun", txlog.index)
        self._logs.subscription.unsubscribe(max_samples)
        _crash("unsubscribe.released", txlog.index)
        txlog.unsubscribe_commit()
        _crash("unsubscribe.committed", txlog.index)
        self._logs.unregister(txlog)
        self._unwatch_wakeups()
        if self._wakeup is not None:
            self._wakeup.close()
        self._a.close()
        self._control.close()
        self._data.close()
        self._usage.close()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Subscription({self.service!r}, log {self.log_index}, next seq {self.next_seq}, "
            f"{len(self._held)} held)"
        )


def _wakeup_socket(address: bytes) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(address)
    except OSError as error:  # not Linux (no abstract names), or taken: poll instead
        log.debug("no wakeup socket (%s); polling", error)
        sock.close()
        return None
    sock.setblocking(False)
    return sock


def positions_to_session(group: tuple[int, ...], positions: NDArray[np.uint64]) -> SessionState:
    """DCP session state for a reader at `positions` (one row per vbucket of `group`).

    The failover log is the one entry the reader knows (its uuid, from seqno 0), as a DCP client
    resuming from a saved offset builds it. Consistent points: the position itself at a
    snapshot's end, else the end of the previous snapshot, which the reader holds whole.
    """
    state = SessionState()
    for vb, (uuid, seqno, snap_start, snap_end, _before) in zip(
        group, positions.tolist(), strict=True
    ):
        points = (
            [seqno] if seqno and seqno == snap_end else ([snap_start - 1] if snap_start > 1 else [])
        )
        state.vbuckets[vb] = VbSession(
            vb,
            seqno,
            snap_start,
            snap_end,
            FailoverLog([(uuid, 0)]) if uuid else None,
            consistent_points=points,
        )
    return state


# -- creation ----------------------------------------------------------------------------------


def subscribe(
    service: str,
    *,
    directory: str | os.PathLike[str] | None = None,
    app_id: int | None = None,
    max_samples: int = 2,
    start: Start = "next",
    lock_timeout_s: float = 5.0,
    identity: ProcessIdentity | None = None,
    alive: Liveness = is_alive,
) -> Subscription:
    """Create a proxy of `service` and subscribe (see the module docstring for the sequence).

    Args:
        directory: where the service lives (default ``$CHANGEFEED_IPC_DIR`` or
            ``/tmp/changefeed-ipc``).
        app_id: the application id its transaction logs are kept under (LoLa's
            TransactionLogId); default the uid. Give each application its own, so one's restart
            does not look at another's logs (a live process's logs are never touched anyway).
        max_samples: batches the reader may hold at once (taken from the slot budget).
        start: where to read from: "next", "oldest" or a seq (see `Subscription.seek`).
        lock_timeout_s: how long to wait for the usage marker (a provider holds it exclusively
            while it creates the segments).

    Raises:
        ServiceNotFoundError: the service was never offered in `directory`.
        MaxSubscribersError: max_subscribers (or the slot budget) is reached.
        CouldNotRestartProxyError: only quarantined logs of this id and no free one.
        ControlSegmentError: the control segment does not decode.
    """
    paths = ServicePaths(service, directory)
    app = os.getuid() if app_id is None else app_id
    if not 0 <= app < 0xFFFF_FFFF:
        raise ValueError(f"app_id {app} must be 0..{0xFFFF_FFFE}")
    if not 1 <= max_samples <= 0xFFFF:
        raise ValueError(f"max_samples {max_samples} must be 1..65535")
    me = identity or ProcessIdentity.current()
    try:
        usage = try_lock(paths.usage, exclusive=False, create=False, timeout_s=lock_timeout_s)
    except FileNotFoundError:
        raise ServiceNotFoundError(
            f"service {service!r} is not offered in {paths.directory} (no usage marker)"
        ) from None
    if usage is None:
        raise IpcError(
            f"service {service!r}: its provider held {paths.usage} for over {lock_timeout_s} s"
        )
    control = data = None
    atomics = None
    try:
        control, header = _open_control(paths, lock_timeout_s)
        data = Segment.open(paths.data_segment, service)
        if data.size < header.geometry.data_bytes:
            raise ServiceNotFoundError(f"service {service!r}: data segment is too short")
        atomics = atomics_for(control.buf)
        logs = TransactionLogSet(atomics, header.layout)
        report = _prepare_and_roll_back(paths, header, logs, app, me, alive, lock_timeout_s)
        txlog = register_and_subscribe(logs, app, me, max_samples, report.rollback)
    except BaseException:
        if atomics is not None:
            atomics.close()
        for segment in (control, data):
            if segment is not None:
                segment.close()
        usage.close()
        raise
    sub = Subscription(
        paths, usage, control, data, atomics, header, logs, txlog, max_samples, report
    )
    sub.seek(start)
    return sub


def _open_control(paths: ServicePaths, timeout_s: float) -> tuple[Segment, Header]:
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline: a provider is finishing a reuse or replacement
        control = Segment.open(paths.control_segment, paths.service)
        try:
            header = check_control(control.buf)
        except BaseException:
            control.close()
            raise
        state = int.from_bytes(control.buf[SERVICE_STATE_AT : SERVICE_STATE_AT + 4], "little")
        if state not in (INITIALIZING, REPLACED) or time.monotonic() >= deadline:
            if state == REPLACED:
                control.close()
                raise ServiceReplacedError(f"service {paths.service!r} is being replaced")
            return control, header
        control.close()
        time.sleep(0.01)


def _prepare_and_roll_back(
    paths: ServicePaths,
    header: Header,
    logs: TransactionLogSet,
    app: int,
    me: ProcessIdentity,
    alive: Liveness,
    timeout_s: float,
) -> CreationReport:
    key = (paths.control_segment, header.segment_id)
    mutex, _ = _SYNC.mutex(key)
    with mutex:
        # Across processes: the rollback lock, which a provider reclaiming a dead reader takes
        # too (two rollbacks of one log would release its references twice).
        lock = try_lock(paths.rollback_lock, exclusive=True, create=True, timeout_s=timeout_s)
        if lock is None:
            log.warning(
                "ipc service %s: the rollback lock %s is held past %s s; subscribing without "
                "rolling back (the provider reclaims dead readers' logs)",
                paths.service,
                paths.rollback_lock,
                timeout_s,
            )
        try:
            report = creation_steps(
                logs, app, me, alive, first=_SYNC.prepared(key), roll_back=lock is not None
            )
        finally:
            if lock is not None:
                lock.close()
    if report.outdated is not None:
        _notify_outdated(paths, app, report.outdated)
    for index, why in report.rollback.quarantined.items():
        log.warning(
            "ipc service %s: transaction log %d of app %d stays quarantined: %s",
            paths.service,
            index,
            app,
            why,
        )
    if report.rollback.rolled_back is not None:
        log.info(
            "ipc service %s: rolled back transaction log %d of app %d (%d slots released)",
            paths.service,
            report.rollback.rolled_back,
            app,
            report.rollback.released_slots,
        )
    return report


def creation_steps(
    logs: TransactionLogSet,
    app: int,
    me: ProcessIdentity,
    alive: Liveness,
    *,
    first: bool,
    roll_back: bool = True,
) -> CreationReport:
    """Steps 3 of the creation sequence, under the caller's per-service mutex and the service's
    rollback lock: if `first` (the first proxy of this process for the service), register the
    UID/PID pair and mark the id's old logs needs-rollback; then roll back the first marked log
    that can be. Without `roll_back` (the lock could not be had) only the pair is registered.

    Raises:
        IpcError: the UID/PID map is full.
    """
    marked: list[int] = []
    outdated = None
    if first:
        old = logs.register_pid(app, me)
        if old is None:
            raise IpcError(f"the UID/PID map ({logs.layout.geometry.pid_map_entries}) is full")
        if old != me:
            outdated = old
        if roll_back:
            marked = logs.mark_needs_rollback(app, me, alive)
    if not roll_back:
        return CreationReport(RollbackResult(), tuple(marked), outdated)
    return CreationReport(logs.rollback(app, me, alive), tuple(marked), outdated)


def _notify_outdated(paths: ServicePaths, app: int, old: ProcessIdentity) -> None:
    """Tell the provider a previous process of this id is gone (best effort, idempotent)."""
    message = f"outdated {app} {old.pid} {old.start_time}".encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.setblocking(False)
        try:
            sock.sendto(message, str(paths.control_socket))
        except OSError as error:  # no provider running now: it learns nothing, which is fine
            log.debug("outdated-pid notice to %s not sent: %s", paths.control_socket, error)


def register_and_subscribe(
    logs: TransactionLogSet,
    app: int,
    me: ProcessIdentity,
    max_samples: int,
    rollback: RollbackResult,
) -> TransactionLog:
    try:
        txlog = logs.register(app, me)
    except MaxSubscribersError as error:
        if rollback.failed:
            raise CouldNotRestartProxyError(
                f"the previous run of app {app} left only logs that cannot be rolled back "
                f"({sorted(rollback.quarantined)}: {'; '.join(rollback.quarantined.values())}) "
                f"and no log is free: {error}"
            ) from None
        raise
    txlog.subscribe_begin(max_samples)
    _crash("subscribe.begun", txlog.index)
    try:
        logs.subscription.subscribe(max_samples)
    except MaxSubscribersError:
        txlog.subscribe_abort()
        logs.unregister(txlog)
        raise
    _crash("subscribe.taken", txlog.index)
    txlog.subscribe_commit()
    _crash("subscribe.committed", txlog.index)
    return txlog


__all__ = [
    "CreationReport",
    "Sample",
    "Subscription",
    "positions_to_session",
    "subscribe",
]


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
