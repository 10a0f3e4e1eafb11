"""The provider (LoLa's skeleton): offers one service and publishes Arrow batches into it.

``Provider.offer`` follows the seed's skeleton restart sequence:

1. Existence marker: exclusive ``flock`` without waiting. Held for the provider's life; if it
   is taken, a live provider already offers the service: `ProviderExistsError`.
2. Usage marker: try an exclusive ``flock``. Got it: no proxy has the segments mapped, so any
   old segments (a clean stop, or a provider that crashed while creating them) are removed and
   created afresh; the lock is then dropped so proxies can take shared locks. Not got: proxies
   are attached; the segments are reused — checked (`layout.check_control`), slots left
   IN_WRITING by the crashed provider are cleaned to empty, the head and the seq index are
   rebuilt from the slots — so readers keep their batches and continue with the next seq.
   Segments that cannot be reused (damaged, another geometry) are marked REPLACED, unlinked and
   created afresh: attached readers get `ServiceReplacedError` and subscribe again.
3. The control socket (``<service>.ctl``) is bound; the service state becomes OFFERED.

Dead readers are reclaimed without their restart (beyond the seed): `maintain` (called by
`publish`, and by an idle publisher's loop) looks every RECLAIM_INTERVAL_S for a reader process
that died — its recorded pid and start time no longer name a running process — and rolls its
transaction log back itself, under the service's rollback lock, exactly as the reader's restart
would (`TransactionLogSet.reclaim_dead`): its slot references, subscriber seat and slot budget
come back within RECLAIM_BOUND_S. A reader that is alive but stalled is not touched: it holds
at most its ``max_samples`` slots and falls behind (`LostDataError`).

``stop_offer`` removes the segments and markers only if it can lock the usage marker
exclusively; otherwise proxies still read, the segments stay (state STOPPED) and the next offer
reuses them.

Publishing (`publish`), single-threaded: the slot to write is the unreferenced one holding the
oldest batch (empty slots first). It is claimed by CAS of its state word from (seq, 0 refs) to
IN_WRITING, which fails if a reader referenced it meanwhile (the next candidate is tried). The
batch is written, the state becomes (new seq, 0), then the seq index entry, then the head;
then readers sleeping on their wakeup socket are woken. The provider never waits for a reader:
readers hold at most their ``max_samples`` slots and the subscription budget keeps their sum
below the slot count, so a free slot always exists — a slow reader loses data instead of
blocking anyone (proxy.py raises `LostDataError` for it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Final

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from changefeed.ipc import stats as _stats
from changefeed.ipc import txlog as _txlog
from changefeed.ipc.atomic import Atomics, atomics_for
from changefeed.ipc.errors import ControlSegmentError, ProviderExistsError
from changefeed.ipc.layout import (
    HEAD_SEQ_AT,
    INVALID_OWNER,
    NODE_NEXT_SEQ,
    NODE_OWNER,
    NODE_WAITING,
    OFFERED,
    POSITION_FIELDS,
    PROVIDER_EPOCH_AT,
    PROVIDER_PID_AT,
    REFCOUNT_BITS,
    REPLACED,
    SEQ_IN_WRITING,
    SEQ_MAX,
    SERVICE_STATE_AT,
    SLOT_FLAG_GAP,
    SLOT_HEADER,
    STOPPED,
    ControlLayout,
    Geometry,
    check_control,
    encode_header,
)
from changefeed.ipc.ring import claim_slot, clean_for_reuse, commit_slot
from changefeed.ipc.segments import Marker, Segment, ServicePaths, read_pid, try_lock, write_pid
from changefeed.ipc.txlog import ProcessIdentity, TransactionLogSet, is_alive, pid_namespace

log = logging.getLogger("changefeed.ipc")


_crash = _txlog._crash


CONTROL_MESSAGE_MAX: Final = 256
# A provider looks for dead readers this often (one load of each log's owner, and a look at
# /proc for each registered reader: ~10-20 us a reader). A node's idle publisher wakes every
# 0.1 s, so a dead reader's slots and budget are back within 0.2 + 0.1 s plus the rollback
# (microseconds): RECLAIM_BOUND_S, the bound docs/ipc.md promises and tests/ipc checks.
RECLAIM_INTERVAL_S: Final = 0.2
RECLAIM_BOUND_S: Final = 1.0
assert RECLAIM_INTERVAL_S * 2 < RECLAIM_BOUND_S, (RECLAIM_INTERVAL_S, RECLAIM_BOUND_S)


@dataclass(frozen=True, slots=True)
class OfferReport:
    """How `offer` found the service: created afresh or reused, and what it cleaned."""

    reused: bool
    cleaned_in_writing: int
    head_seq: int
    replaced_reason: str = ""


class Provider:
    """One offered service. Build with `Provider.offer`."""

    def __init__(
        self,
        paths: ServicePaths,
        geometry: Geometry,
        existence: Marker,
        control: Segment,
        data: Segment,
        atomics: Atomics,
        layout: ControlLayout,
        segment_id: int,
        report: OfferReport,
        reclaim_interval_s: float | None = RECLAIM_INTERVAL_S,
    ) -> None:
        self.paths = paths
        self.service = paths.service
        self.geometry = geometry
        self._existence = existence
        self._control = control
        self._data = data
        self._a = atomics
        self.layout = layout
        self.segment_id = segment_id
        self.report = report
        self.logs = TransactionLogSet(atomics, layout)
        self._slot_state = [layout.slot_state(i) for i in range(geometry.slot_count)]
        # The seq each slot holds, as this provider wrote it (a restarted one reads them): the
        # oldest is the slot to try first.
        self._slot_seq = [atomics.load_u64(at) >> REFCOUNT_BITS for at in self._slot_state]
        self._slot_seq = [0 if seq == SEQ_IN_WRITING else seq for seq in self._slot_seq]
        self._positions_at = geometry.positions_at
        self._payload_at = geometry.payload_at
        self._head = atomics.load_u64(HEAD_SEQ_AT)
        self._wake = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self._wake.setblocking(False)
        self._control_socket = _bind_control_socket(paths)
        self._outdated: set[ProcessIdentity] = set()
        self._closed = False
        self._reclaim_interval_s = reclaim_interval_s
        self._next_reclaim = 0.0
        self._namespace = pid_namespace()
        # (log, dead process) found caught mid-transaction: quarantined, not tried again.
        self._quarantined: set[tuple[int, ProcessIdentity]] = set()
        self.stats = {
            "published": 0,
            "rows": 0,
            "gaps": 0,
            "wakeups": 0,
            "outdated_pids": 0,
            "reclaimed": 0,
            "reclaim_quarantined": 0,
            "reclaimed_slots": 0,
        }

    # -- offer / stop ---------------------------------------------------------------------------

    @classmethod
    def offer(
        cls,
        service: str,
        geometry: Geometry,
        *,
        directory: str | os.PathLike[str] | None = None,
        bucket: str = "",
        node_port: int = 0,
        reclaim_interval_s: float | None = RECLAIM_INTERVAL_S,
    ) -> Provider:
        """Offer `service` (see the module docstring for the sequence).

        Args:
            reclaim_interval_s: how often `maintain` looks for dead readers to reclaim; None:
                never (a dead reader's log waits for its restart, as in LoLa).

        Raises:
            ProviderExistsError: a live provider holds the existence marker.
        """
        paths = ServicePaths(service, directory)
        existence = try_lock(paths.existence, exclusive=True, create=True)
        if existence is None:
            pid = read_pid(paths.existence)
            raise ProviderExistsError(
                f"service {service!r} is already offered by a live provider"
                + (f" (pid {pid})" if pid else "")
                + f": its existence marker {paths.existence} is locked"
            )
        try:
            write_pid(existence)
            usage = try_lock(paths.usage, exclusive=True, create=True)
            if usage is not None:
                try:
                    parts = _create(paths, geometry, bucket, node_port, reason="")
                finally:
                    usage.close()  # proxies may attach now
            else:
                parts = _reuse(paths, geometry, bucket, node_port)
        except BaseException:
            existence.close()
            raise
        control, data, atomics, layout, segment_id, report = parts
        provider = cls(
            paths,
            geometry,
            existence,
            control,
            data,
            atomics,
            layout,
            segment_id,
            report,
            reclaim_interval_s,
        )
        atomics.store_u32(PROVIDER_PID_AT, os.getpid())
        atomics.fetch_add_u64(PROVIDER_EPOCH_AT, 1)
        atomics.store_u32(SERVICE_STATE_AT, OFFERED)
        provider.wake_all()  # readers that slept through a provider restart
        log.info(
            "ipc service %s offered (%s, head seq %d, %d slots x %d bytes, %d subscribers max)",
            service,
            "reused" if report.reused else "created",
            report.head_seq,
            geometry.slot_count,
            geometry.slot_bytes,
            geometry.max_subscribers,
        )
        return provider

    def stop_offer(self) -> bool:
        """Stop offering. Returns True if the segments were removed (no proxy attached)."""
        if self._closed:
            return False
        self._closed = True
        a = self._a
        a.store_u32(SERVICE_STATE_AT, STOPPED)
        a.store_u32(PROVIDER_PID_AT, 0)
        self.wake_all()
        self._control_socket.close()
        with contextlib.suppress(FileNotFoundError):
            self.paths.control_socket.unlink()
        self._wake.close()
        usage = try_lock(self.paths.usage, exclusive=True, create=True)
        removed = usage is not None
        self.logs = None  # type: ignore[assignment]
        a.close()
        self._control.close()
        self._data.close()
        if usage is not None:
            Segment.unlink(self.paths.control_segment)
            Segment.unlink(self.paths.data_segment)
            with contextlib.suppress(FileNotFoundError):
                self.paths.usage.unlink()
            with contextlib.suppress(FileNotFoundError):
                self.paths.rollback_lock.unlink()
            usage.close()
        with contextlib.suppress(FileNotFoundError):
            self.paths.existence.unlink()
        self._existence.close()
        log.info(
            "ipc service %s stopped (%s)",
            self.service,
            "removed" if removed else "kept: proxies attached",
        )
        return removed

    def __enter__(self) -> Provider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_offer()

    # -- publishing -----------------------------------------------------------------------------

    @property
    def head_seq(self) -> int:
        return self._head

    @property
    def payload_bytes(self) -> int:
        """The largest Arrow message a slot holds."""
        return self.geometry.slot_payload_bytes

    def publish(
        self,
        batch: pa.RecordBatch | pa.Buffer,
        positions: NDArray[np.uint64],
        *,
        rows: int | None = None,
        flags: int = 0,
    ) -> int:
        """Publish one batch; returns its seq.

        Args:
            batch: change rows, or an already serialized record-batch message.
            positions: ``(group_size, 5)`` uint64: per vbucket of the group, (vb_uuid, seqno,
                snap_start, snap_end, seqno_before) after this batch.
            rows: the row count when `batch` is serialized.
            flags: SLOT_FLAG_GAP for a batch that stands for rows that did not fit.

        Raises:
            ValueError: the message is larger than a slot's payload (split the batch).
        """
        assert not self._closed, "publish after stop_offer"
        geometry = self.geometry
        if isinstance(batch, pa.RecordBatch):
            rows = batch.num_rows
            message = batch.serialize()
        else:
            message = batch
            assert rows is not None, "rows of a serialized batch"
        size = message.size
        if size > geometry.slot_payload_bytes:
            raise ValueError(
                f"a batch of {size} bytes does not fit a slot ({geometry.slot_payload_bytes}); "
                "split it"
            )
        assert positions.shape == (len(geometry.group), POSITION_FIELDS), positions.shape
        seq = self._head + 1
        assert seq <= SEQ_MAX, seq
        seqs = self._slot_seq
        slot = claim_slot(
            self._a, self._slot_state, prefer=min(range(len(seqs)), key=seqs.__getitem__)
        )
        seqs[slot] = seq
        _crash("publish.claimed", -1, slot)
        buf = self._data.buf
        base = slot * geometry.slot_bytes
        SLOT_HEADER.pack_into(
            buf,
            base,
            seq,
            rows,
            size,
            len(geometry.group),
            flags,
            self._a.load_u64(PROVIDER_EPOCH_AT),
            time.time_ns(),
        )
        at = base + self._positions_at
        raw = positions.astype("<u8", copy=False).tobytes()
        buf[at : at + len(raw)] = raw
        at = base + self._payload_at
        buf[at : at + size] = memoryview(message).cast("B")
        _crash("publish.written", -1, slot)
        commit_slot(self._a, self.layout, slot, seq)  # readable from here on
        self._head = seq
        self.stats["published"] += 1
        self.stats["rows"] += rows
        if flags & SLOT_FLAG_GAP:
            self.stats["gaps"] += 1
        self._wake_waiting()
        self.maintain()
        return seq

    def publish_gap(self, positions: NDArray[np.uint64]) -> int:
        """Publish an empty batch that tells readers to fetch up to `positions` over DCP."""
        from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA

        empty = pa.RecordBatch.from_pylist([], schema=CHANGE_ROW_SCHEMA)
        return self.publish(empty, positions, flags=SLOT_FLAG_GAP)

    # -- wakeups and the control socket ---------------------------------------------------------

    def _wake_waiting(self) -> None:
        a = self._a
        for txlog in self.logs.logs:
            if a.load_u8(txlog.node + NODE_WAITING):
                a.store_u8(txlog.node + NODE_WAITING, 0)
                self._send_wakeup(txlog.index)

    def wake_all(self) -> None:
        """Wake every registered reader (after an offer or at a stop)."""
        a = self._a
        for txlog in self.logs.logs:
            if a.load_u32(txlog.node + NODE_OWNER) != INVALID_OWNER:
                self._send_wakeup(txlog.index)

    def _send_wakeup(self, index: int) -> None:
        with contextlib.suppress(OSError):  # no such reader (gone), or its queue is full
            self._wake.sendto(b"w", self.paths.wakeup_address(self.segment_id, index))
            self.stats["wakeups"] += 1

    def control_fileno(self) -> int:
        """The control socket, for an event loop's add_reader."""
        return self._control_socket.fileno()

    def handle_control(self) -> list[str]:
        """Process every waiting control message; returns them (decoded) for logs and tests.

        ``outdated <app_id> <pid> <start_time>``: a restarted proxy found this pid registered
        for its id. If that process is gone, its wakeup requests are dropped. Idempotent.
        """
        handled: list[str] = []
        while True:  # bounded by the messages queued on the socket
            try:
                data = self._control_socket.recv(CONTROL_MESSAGE_MAX)
            except (BlockingIOError, OSError):
                return handled
            text = data.decode(errors="replace").strip()
            handled.append(text)
            parts = text.split()
            if len(parts) == 4 and parts[0] == "outdated" and all(p.isdigit() for p in parts[1:]):
                self.outdated_process(ProcessIdentity(int(parts[2]), int(parts[3])))
            else:
                log.warning("ipc service %s: unknown control message %r", self.service, text)

    def outdated_process(self, process: ProcessIdentity) -> bool:
        """Drop what the provider keeps for a dead reader process; False if already done or the
        process still runs (a notice about a live process is ignored)."""
        if process in self._outdated or is_alive(process):
            return False
        self._outdated.add(process)
        self.stats["outdated_pids"] += 1
        a = self._a
        for index in range(self.geometry.max_subscribers):
            if self.logs.owner_process(index) == process:
                a.store_u8(self.logs.logs[index].node + NODE_WAITING, 0)
        log.info("ipc service %s: reader process %d is gone", self.service, process.pid)
        return True

    # -- dead readers ---------------------------------------------------------------------------

    def maintain(self, now: float | None = None) -> None:
        """Periodic work, one clock read when not due: every `reclaim_interval_s`, reclaim the
        readers that died (`reclaim_dead_readers`). `publish` calls it; a publisher with
        nothing to publish calls it from its loop (at least every RECLAIM_INTERVAL_S)."""
        if self._reclaim_interval_s is None or self._closed:
            return
        now = time.monotonic() if now is None else now
        if now < self._next_reclaim:
            return
        self._next_reclaim = now + self._reclaim_interval_s
        self.reclaim_dead_readers()

    def reclaim_dead_readers(self) -> _txlog.ReclaimResult | None:
        """Roll back the transaction log of every reader process that died, as its restart
        would; returns what was done (None: no dead reader, or the rollback lock is busy — a
        restarting reader rolls back now; the next call looks again)."""
        logs, quarantined = self.logs, self._quarantined
        dead = [
            index
            for index in logs.dead_owned(is_alive, self._namespace)
            if (index, logs.owner_process(index)) not in quarantined
        ]
        if not dead:
            return None
        lock = try_lock(self.paths.rollback_lock, exclusive=True, create=True)
        if lock is None:
            return None
        try:
            result = logs.reclaim_dead(is_alive, self._namespace, skip=quarantined)
        finally:
            lock.close()
        self.stats["reclaimed"] += len(result.reclaimed)
        self.stats["reclaim_quarantined"] += len(result.quarantined)
        self.stats["reclaimed_slots"] += result.released_slots
        for index, (owner, process) in sorted(result.reclaimed.items()):
            self._outdated.add(process)
            log.info(
                "ipc service %s: reader pid %d (app %d) died; its log %d is rolled back",
                self.service,
                process.pid,
                owner,
                index,
            )
        for index, (owner, process, why) in sorted(result.quarantined.items()):
            quarantined.add((index, process))
            log.warning(
                "ipc service %s: reader pid %d (app %d) died; its log %d stays quarantined: %s",
                self.service,
                process.pid,
                owner,
                index,
                why,
            )
        return result

    # -- state ----------------------------------------------------------------------------------

    def positions_of(self, seq: int) -> NDArray[np.uint64] | None:
        """The positions stored with batch `seq`, if its slot still holds it."""
        geometry = self.geometry
        for slot, at in enumerate(self._slot_state):
            if self._a.load_u64(at) >> REFCOUNT_BITS == seq:
                start = slot * geometry.slot_bytes + geometry.positions_at
                raw = self._data.buf[start : start + 8 * POSITION_FIELDS * len(geometry.group)]
                return np.frombuffer(raw, "<u8").reshape(-1, POSITION_FIELDS).astype(np.uint64)
        return None

    def resume_positions(self) -> NDArray[np.uint64] | None:
        """Positions after the newest batch in the ring: where a restarted publisher resumes."""
        return self.positions_of(self._head) if self._head else None

    def readers(self) -> list[dict[str, int]]:
        """Registered readers: log index, app id, pid, next seq (lag), for stats."""
        a = self._a
        found = []
        for index in range(self.geometry.max_subscribers):
            owner = self.logs.owner(index)
            if owner == INVALID_OWNER:
                continue
            node = self.logs.logs[index].node
            process = self.logs.owner_process(index)
            found.append(
                {
                    "log": index,
                    "app_id": owner,
                    "pid": process.pid,
                    "next_seq": a.load_u64(node + NODE_NEXT_SEQ),
                    "quarantined": int(self.logs.needs_rollback(index)),
                }
            )
        return found

    def subscription(self) -> tuple[int, int]:
        """(subscribers, slots of the budget held)."""
        return self.logs.subscription.state()

    def service_stats(self) -> dict[str, float]:
        """The service's figures now (`changefeed.ipc.stats`), with this provider's counters:
        batches and rows published, gaps, readers reclaimed."""
        figures = _stats.service_stats(self._a, self.layout, self._data.buf)
        stats = self.stats
        figures["batches_published_total"] = stats["published"]
        figures["rows_published_total"] = stats["rows"]
        figures["gaps_total"] = stats["gaps"]
        figures["readers_reclaimed_total"] = stats["reclaimed"]
        figures["slots_reclaimed_total"] = stats["reclaimed_slots"]
        return figures


def _bind_control_socket(paths: ServicePaths) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    with contextlib.suppress(FileNotFoundError):
        paths.control_socket.unlink()  # a crashed provider's; we hold the existence marker
    sock.bind(str(paths.control_socket))
    sock.setblocking(False)
    return sock


_Parts = tuple[Segment, Segment, Atomics, ControlLayout, int, OfferReport]


def _create(
    paths: ServicePaths, geometry: Geometry, bucket: str, node_port: int, *, reason: str
) -> _Parts:
    """Remove any old segments and create both afresh (the caller makes sure no proxy uses
    them: it holds the usage marker exclusively, or marked them REPLACED)."""
    Segment.unlink(paths.control_segment)
    Segment.unlink(paths.data_segment)
    layout = ControlLayout.of(geometry)
    data = Segment.create(paths.data_segment, geometry.data_bytes)
    try:
        control = Segment.create(paths.control_segment, layout.control_bytes)
    except BaseException:
        data.close()
        Segment.unlink(paths.data_segment)
        raise
    segment_id = secrets.randbits(63) or 1
    encode_header(control.buf, geometry, segment_id=segment_id, node_port=node_port, bucket=bucket)
    atomics = atomics_for(control.buf)
    for index in range(geometry.max_subscribers):
        atomics.store_u32(layout.node(index) + NODE_OWNER, INVALID_OWNER)
    return control, data, atomics, layout, segment_id, OfferReport(False, 0, 0, reason)


def _reuse(paths: ServicePaths, geometry: Geometry, bucket: str, node_port: int) -> _Parts:
    """Reuse the segments proxies have mapped; clean IN_WRITING slots and rebuild the head and
    index. Segments that cannot be reused are replaced."""
    try:
        control = Segment.open(paths.control_segment, paths.service)
    except Exception as error:
        return _create(paths, geometry, bucket, node_port, reason=f"no segment: {error}")
    try:
        header = check_control(control.buf)
        problem = ""
        if header.geometry != geometry:
            problem = f"geometry changed ({header.geometry} -> {geometry})"
        elif header.bucket != bucket:
            problem = f"bucket changed ({header.bucket!r} -> {bucket!r})"
        data = None if problem else Segment.open(paths.data_segment, paths.service)
        if data is not None and data.size < geometry.data_bytes:
            problem = f"data segment of {data.size} bytes, expected {geometry.data_bytes}"
    except (ControlSegmentError, OSError, Exception) as error:
        problem = f"damaged: {error}"
        data = None
    if problem:
        log.warning("ipc service %s: replacing its segments (%s)", paths.service, problem)
        with contextlib.suppress(Exception):
            if len(control.buf) >= SERVICE_STATE_AT + 4:
                struct.pack_into("<I", control.buf, SERVICE_STATE_AT, REPLACED)
        control.close()
        if data is not None:
            data.close()
        return _create(paths, geometry, bucket, node_port, reason=problem)
    assert data is not None
    layout = header.layout
    atomics = atomics_for(control.buf)
    cleaned, head = clean_for_reuse(atomics, layout)
    return control, data, atomics, layout, header.segment_id, OfferReport(True, cleaned, head)
