"""`LocalStream`: a group's change rows from shared memory, over DCP when the ring cannot serve.

The analogue of the node's own dropped cursor: a stream reads memory while it keeps up and the
disk when it fell behind, then memory again. Here the ring is the memory and a DCP stream from
the node is the disk. The reader's position is DCP session state (per vbucket: seqno, snapshot,
vb_uuid), advanced by the positions every batch carries, so:

* a reader that falls behind the ring (`LostDataError`), or starts from a saved state or from
  the beginning, streams over DCP from its position up to the positions of the ring's newest
  batch, then rejoins the ring at the oldest batch it can continue from;
* a batch continues the reader iff its position *before* is at or below the reader's for every
  vbucket (rows at or below the reader's position are dropped: they came over DCP). Every batch
  is checked, so a reader can never skip rows silently: a batch that does not continue it sends
  it back to DCP.

Batches from the ring are zero-copy and valid until the next `next_batch` call (the sample is
released then); batches from DCP are ordinary Arrow batches. Both are change rows
(CHANGE_ROW_SCHEMA); a rollback arrives as a row ``op = rollback``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping
from typing import Final, Literal

import numpy as np
import pyarrow as pa
from numpy.typing import NDArray

from changefeed.consumer.change_rows import ChangeRows
from changefeed.consumer.dcp_client import ClientConfig, DcpClient
from changefeed.consumer.events import (
    Changes,
    Disconnected,
    Rollback,
    Snapshot,
    StreamEnded,
    StreamRefused,
)
from changefeed.consumer.handshake import connect
from changefeed.consumer.session import CONSISTENT_POINTS_MAX, SessionState, VbSession
from changefeed.failover import FailoverLog
from changefeed.ipc.errors import (
    IpcError,
    LostDataError,
    ServiceReplacedError,
    UnpublishedError,
)
from changefeed.ipc.layout import SLOT_FLAG_GAP
from changefeed.ipc.proxy import Sample, Subscription, subscribe
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status

DCP_ROWS_PER_BATCH: Final = 4096
DCP_RETRY_S: Final = 0.2  # a fallback that cannot reach the node tries again after this long
# A bounded read whose stream brought no row for this long reads the rest over DCP (an end
# seqno may be a SyncWrite prepare or abort, which no published row ever reaches).
BOUNDED_STALL_S: Final = 0.5
LocalStart = Literal["now", "beginning"] | SessionState


class LocalStream:
    """Change rows of one service (one stream group), with the DCP fallback.

    Args:
        service: the service name (``<bucket>-<port>-g<i>`` for a node's group).
        directory, app_id, max_samples: as `changefeed.ipc.subscribe`.
        start: "now" (the next batch published), "beginning" (every change: over DCP first),
            or a session state to continue from (vbuckets it lacks start at 0).
        dcp: how to reach the node for the fallback; None: `LostDataError` goes to the caller.
        vbuckets: follow only these of the group (default all): a bounded reader's.
    """

    def __init__(
        self,
        service: str,
        *,
        directory: str | os.PathLike[str] | None = None,
        app_id: int | None = None,
        start: LocalStart = "now",
        dcp: ClientConfig | None = None,
        max_samples: int = 2,
        vbuckets: Iterable[int] | None = None,
    ) -> None:
        self.service = service
        self._directory = directory
        self._app_id = app_id
        self._max_samples = max_samples
        self._dcp = dcp
        self._sub = self._subscribe()
        self.group = self._sub.group
        # The vbuckets this reader follows (the others' rows still come in ring batches; they
        # are neither checked nor fetched over DCP).
        wanted = set(self.group) if vbuckets is None else set(vbuckets) & set(self.group)
        self.vbuckets = tuple(vb for vb in self.group if vb in wanted)
        self._watched = np.array([i for i, vb in enumerate(self.group) if vb in wanted], np.intp)
        self._held: Sample | None = None
        self._catch_up: AsyncGenerator[pa.RecordBatch, None] | None = None
        self.session: SessionState | None
        if start == "now":
            positions = self._sub.positions
            self.session = None if positions is None else _to_session(self.group, positions)
            self._joined = True
        else:
            base = SessionState() if start == "beginning" else start
            self.session = SessionState({vb: base.get(vb).copy() for vb in self.group})
            self._joined = False
        self.stats = {
            "shm_batches": 0,
            "shm_rows": 0,
            "dcp_rows": 0,
            "lost": 0,
            "rejoins": 0,
            "dropped_rows": 0,
            "resubscribed": 0,
            "dcp_unreachable": 0,
        }

    def _subscribe(self) -> Subscription:
        return subscribe(
            self.service,
            directory=self._directory,
            app_id=self._app_id,
            max_samples=self._max_samples,
            start="next",
        )

    @property
    def subscription(self) -> Subscription:
        return self._sub

    async def next_batch(self, timeout_s: float | None = None) -> pa.RecordBatch | None:
        """The next rows (None after `timeout_s` without any); the previous batch from the ring
        is released first, so use it before calling again. Never an empty batch: a batch with
        nothing new for this reader moves `session` on and is passed over.

        Raises:
            LostDataError: the reader fell behind and there is no `dcp` fallback.
            IpcError: the node refused a DCP stream.
        """
        self._release()
        fruitless = 0
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:  # each round serves a batch, waits out the timeout, or changes source
            if self._catch_up is not None:
                try:
                    return await anext(self._catch_up)
                except StopAsyncIteration:
                    self._catch_up = None
                    self._joined = False
                    continue
            if not self._joined and not self._join():
                if fruitless:  # caught up over DCP and still no batch to join: the ring is
                    await asyncio.sleep(0.01)  # being rewritten under us; look again
                    if deadline is not None and loop.time() >= deadline:
                        return None
                fruitless += 1
                self._start_catch_up()
                continue
            try:
                sample = await self._sub.areceive(timeout_s)
            except LostDataError as error:
                self.stats["lost"] += 1
                if self._dcp is None:
                    raise
                self._joined = False
                if error.session is not None and self.session is None:
                    self.session = error.session
                continue
            except ServiceReplacedError:
                self._sub.close()
                self._sub = self._subscribe()
                self.stats["resubscribed"] += 1
                self._joined = self.session is None
                continue
            if sample is None:
                return None
            batch = self._accept(sample)
            if batch is not None and batch.num_rows:
                return batch
            if batch is not None:  # nothing new (all had over DCP, or an empty batch): the
                self._release()  # position moved on; a caller saving it per batch need not
                if deadline is not None and loop.time() >= deadline:
                    return None

    def _accept(self, sample: Sample) -> pa.RecordBatch | None:
        """The rows of `sample` that continue the reader; None if it does not continue it (the
        reader goes back to DCP)."""
        positions = sample.positions
        session = self.session
        batch = sample.batch
        if session is not None:
            watched = self._watched
            mine = np.array([session.get(vb).seqno for vb in self.vbuckets], np.uint64)
            if bool(
                np.any(positions[watched, 4] > mine)
            ):  # rows between are missing: not a follower
                sample.release()
                self._joined = False
                self.stats["lost"] += 1
                if self._dcp is None:
                    raise LostDataError(
                        f"service {self.service!r}: batch {sample.seq} does not continue this "
                        "reader",
                        wanted_seq=sample.seq,
                        oldest_seq=self._sub.oldest_seq(),
                        session=session,
                    )
                return None
            if bool(np.any(positions[watched, 4] < mine)):  # overlaps what came over DCP: drop it
                index = np.full(max(self.group) + 1, 0, np.int64)
                index[list(self.vbuckets)] = mine.astype(np.int64)
                vbs = batch.column("vbucket").to_numpy()
                keep = batch.column("seqno").to_numpy() > index[vbs]
                self.stats["dropped_rows"] += int((~keep).sum())
                batch = batch.filter(pa.array(keep))
                sample.release()
                sample = None  # type: ignore[assignment]
        self.session = _merge(self.group, self.session, positions)
        if sample is not None:
            self._held = sample
        self.stats["shm_batches"] += 1
        self.stats["shm_rows"] += batch.num_rows
        return batch

    def _join(self) -> bool:
        """Point the subscription at the oldest batch that continues the reader with something
        new; False if the ring holds none (and it is not empty): the reader goes over DCP.

        A batch continues the reader if its positions *before* are at or below the reader's,
        on the same branch. Batches with nothing past the reader are passed over (joining one
        would only repeat it), and so is a gap batch (its rows are not in the ring: they come
        over DCP). A reader at or past the newest batch waits for the next one.
        """
        sub = self._sub
        session = self.session
        if session is None:
            sub.seek("next")
            self._joined = True
            return True
        oldest, head = sub.oldest_seq(), sub.head_seq
        if oldest == 0:  # nothing in the ring: take the next batch, `_accept` checks it
            sub.seek("next")
            self._joined = True
            return True
        mine = np.array([session.get(vb).seqno for vb in self.vbuckets], np.uint64)
        uuids = np.array([session.get(vb).vb_uuid for vb in self.vbuckets], np.uint64)
        for seq in range(oldest, head + 1):  # bounded by the slot count
            positions = sub.positions_of(seq)
            flags = sub.flags_of(seq)
            if positions is None or flags is None:
                continue
            positions = positions[self._watched]
            same_branch = (uuids == 0) | (mine == 0) | (uuids == positions[:, 0])
            if not bool(np.all(positions[:, 4] <= mine)) or not bool(np.all(same_branch)):
                continue  # rows between the reader and this batch are missing
            if bool(np.all(positions[:, 1] <= mine)):
                if seq == head:  # the reader has everything the ring holds: the next one
                    return self._seek_joined(seq + 1)
                continue  # nothing new in it
            if flags & SLOT_FLAG_GAP:
                continue  # joining it would raise LostDataError again
            return self._seek_joined(seq)
        return False

    def _seek_joined(self, seq: int) -> bool:
        self._sub.seek(seq)
        self._joined = True
        self.stats["rejoins"] += 1
        return True

    def _start_catch_up(self) -> None:
        if self._dcp is None:
            raise LostDataError(
                f"service {self.service!r}: the ring holds no batch that continues this reader",
                wanted_seq=self._sub.next_seq,
                oldest_seq=self._sub.oldest_seq(),
                session=self.session,
            )
        head = self._sub.head_seq
        target = self._sub.positions_of(head) if head else None
        self._catch_up = self._dcp_rows(target)

    async def _dcp_rows(
        self, target: NDArray[np.uint64] | None
    ) -> AsyncGenerator[pa.RecordBatch, None]:
        """Rows from the node over DCP, from the reader's position to `target` (the ring's
        newest positions; None: the node's high seqnos)."""
        assert self._dcp is not None and self.session is not None
        session = self.session
        ends: dict[int, int] = {}
        vbs = []
        for i, vb in enumerate(self.group):
            if vb not in self.vbuckets:
                continue
            mine = session.get(vb)
            if target is not None:
                end = int(target[i, 1])
                if mine.seqno >= end and mine.vb_uuid in (0, int(target[i, 0])):
                    continue  # nothing to fetch (a branch change still goes over DCP)
                ends[vb] = max(end, mine.seqno)
            vbs.append(vb)
        async for batch in self._over_dcp(vbs, ends or None, set()):
            yield batch

    async def read_to(
        self, ends: Mapping[int, int], ended: set[int]
    ) -> AsyncIterator[pa.RecordBatch]:
        """Rows over DCP from the reader's position up to `ends` (vbuckets of this reader),
        adding to `ended` each vbucket whose stream ended: its end seqno was read, even when
        the seqno itself is one no application stream sends (a SyncWrite prepare or abort, so
        the reader's position stays below it). The reader rejoins the ring after it.

        A vbucket the reader already holds to its end is added at once. Nothing is added for a
        node that cannot be reached (the caller tries again later).
        """
        self._release()
        if self._catch_up is not None:
            await self._catch_up.aclose()
            self._catch_up = None
        self._joined = False
        assert self._dcp is not None and self.session is not None
        vbs = []
        for vb, end in ends.items():
            assert vb in self.vbuckets, (vb, self.vbuckets)
            if self.session.get(vb).seqno >= end:
                ended.add(vb)
            else:
                vbs.append(vb)
        async for batch in self._over_dcp(vbs, {vb: ends[vb] for vb in vbs}, ended):
            yield batch

    async def _over_dcp(
        self, vbs: list[int], ends: dict[int, int] | None, ended: set[int]
    ) -> AsyncIterator[pa.RecordBatch]:
        """Rows of `vbs` from the reader's position over DCP, to `ends` (None: to the node's
        high seqnos), until every stream ended (each added to `ended`)."""
        assert self._dcp is not None and self.session is not None
        session = self.session
        if not vbs:
            return
        config = dataclasses.replace(
            self._dcp, to_latest=ends is None, name=f"changefeed:local:{uuid.uuid4().hex[:12]}"
        )
        snaps = {vb: (session.get(vb).snap_start, session.get(vb).snap_end) for vb in vbs}
        client = DcpClient(config)
        try:
            await client.connect()
        except OSError:  # the node is down (a restart): the ring, or a later try, serves
            self.stats["dcp_unreachable"] += 1
            await asyncio.sleep(DCP_RETRY_S)
            return
        try:
            await client.stream(vbs, session, end_seqnos=ends)
            unfinished = set(vbs)
            rows = ChangeRows()
            async for event in client.events():
                if isinstance(event, Changes):
                    rows.append_changes(event.columns, snaps)
                elif isinstance(event, Snapshot):
                    snaps[event.vbucket] = (event.snap_start, event.snap_end)
                elif isinstance(event, Rollback):
                    rows.append_rollback(event.vbucket, event.seqno)
                elif isinstance(event, StreamEnded):
                    unfinished.discard(event.vbucket)
                    ended.add(event.vbucket)
                elif isinstance(event, StreamRefused):
                    raise IpcError(
                        f"the node refused the DCP stream of vbucket {event.vbucket}: "
                        f"{Status.name_of(event.status)} {event.message}"
                    )
                elif isinstance(event, Disconnected):
                    pass  # the client reconnects and resumes from its session
                if len(rows) >= DCP_ROWS_PER_BATCH or (rows and not unfinished):
                    yield self._from_dcp(rows.to_batch(), client, vbs)
                    rows = ChangeRows()
                if not unfinished:
                    break
            if len(rows):
                yield self._from_dcp(rows.to_batch(), client, vbs)
            self._take_session(client, vbs)
        finally:
            await client.close()

    def _from_dcp(self, batch: pa.RecordBatch, client: DcpClient, vbs: list[int]) -> pa.RecordBatch:
        self._take_session(client, vbs)
        self.stats["dcp_rows"] += batch.num_rows
        return batch

    def _take_session(self, client: DcpClient, vbs: list[int]) -> None:
        assert self.session is not None
        for vb in vbs:
            self.session.vbuckets[vb] = client.session.get(vb).copy()

    def _release(self) -> None:
        if self._held is not None:
            self._held.release()
            self._held = None

    def close(self) -> None:
        self._release()
        self._sub.close()

    def __enter__(self) -> LocalStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _to_session(group: tuple[int, ...], positions: NDArray[np.uint64]) -> SessionState:
    return _merge(group, None, positions)


def _merge(
    group: tuple[int, ...], session: SessionState | None, positions: NDArray[np.uint64]
) -> SessionState:
    """`session` moved on to `positions` (per vbucket, whichever is further).

    A position at a snapshot's end is a consistent point; it is added through the session's
    own rule (`VbSession.add_consistent_point`), which keeps the list bounded however many
    batches a reader takes (one point per batch, before: unbounded, issue 27).
    """
    state = session if session is not None else SessionState()
    vbuckets = state.vbuckets
    for vb, (vb_uuid, seqno, snap_start, snap_end, _before) in zip(
        group, positions.tolist(), strict=True
    ):
        mine = vbuckets.get(vb)
        if mine is None:
            mine = vbuckets[vb] = VbSession(vb)
        elif mine.seqno > seqno or (
            # Unchanged (a vbucket with no row in the batch): nothing to look at.
            seqno == mine.seqno
            and snap_start == mine.snap_start
            and snap_end == mine.snap_end
            and (not vb_uuid or mine.vb_uuid == vb_uuid)
        ):
            continue
        if vb_uuid and mine.vb_uuid != vb_uuid:
            mine.failover_log = FailoverLog([(vb_uuid, 0)])
        if seqno != mine.seqno or (snap_start, snap_end) != (mine.snap_start, mine.snap_end):
            assert seqno >= mine.seqno, (vb, seqno, mine.seqno)
            mine.seqno, mine.snap_start, mine.snap_end = seqno, snap_start, snap_end
            if seqno and seqno == snap_end:
                mine.add_consistent_point(seqno)
        assert len(mine.consistent_points) <= CONSISTENT_POINTS_MAX, len(mine.consistent_points)
    return state


def services_of(
    bucket: str, port: int, directory: str | os.PathLike[str] | None = None
) -> list[str]:
    """The services a node offers (live providers: their existence markers), by group index."""
    from changefeed.ipc.segments import service_dir

    prefix = f"{bucket}-{port}-g"
    names = [
        path.name[: -len(".exist")] for path in service_dir(directory).glob(f"{prefix}*.exist")
    ]
    return sorted(
        (n for n in names if n[len(prefix) :].isdigit()), key=lambda n: int(n[len(prefix) :])
    )


async def high_seqnos(config: ClientConfig) -> dict[int, int]:
    """Every vbucket's high seqno on the node now (STAT vbucket-seqno)."""
    conn = await connect(
        config.host,
        config.port,
        agent="changefeed-local",
        user=config.user,
        password=config.password,
        bucket=config.bucket,
    )
    try:
        opaque = conn.next_opaque()
        request = encode_request(Opcode.STAT, opaque=opaque, key=b"vbucket-seqno")
        frames = await conn.request_many(
            request, opaque, lambda f: not f.key or f.status != Status.SUCCESS
        )
    finally:
        await conn.close()
    found = {}
    for frame in frames:
        key = frame.key.decode()
        if key.startswith("vb_") and key.endswith(":high_seqno"):
            found[int(key[3 : key.index(":")])] = int(frame.value)
    return found


def open_local_streams(
    config: ClientConfig,
    vbuckets: set[int],
    start: LocalStart,
    *,
    directory: str | os.PathLike[str] | None = None,
    app_id: int | None = None,
) -> list[LocalStream]:
    """A `LocalStream` on each of the node's services that publishes any of `vbuckets`.

    Raises:
        UnpublishedError: some of `vbuckets` no service publishes (nothing is left open).
    """
    streams: list[LocalStream] = []
    try:
        for service in services_of(config.bucket, config.port, directory):
            local = LocalStream(
                service,
                directory=directory,
                app_id=app_id,
                start=start,
                dcp=config,
                vbuckets=vbuckets,
            )
            if local.vbuckets:
                streams.append(local)
            else:
                local.close()
        missing = vbuckets - {vb for local in streams for vb in local.vbuckets}
        if missing:
            raise UnpublishedError(sorted(missing), f"{config.host}:{config.port}")
    except BaseException:
        for local in streams:
            local.close()
        raise
    return streams


async def read_bounded(
    config: ClientConfig,
    starts: SessionState,
    ends: dict[int, int],
    *,
    directory: str | os.PathLike[str] | None = None,
    app_id: int | None = None,
) -> AsyncIterator[pa.RecordBatch]:
    """Change rows of the vbuckets in `ends`, after `starts` up to `ends`, from the node's
    shared-memory services (over DCP what the ring no longer holds): a bounded read, as a Spark
    micro-batch makes. Rows past a vbucket's end are left out and ``snap_end`` is cut to it, as
    ``ChangeRows.append_changes`` does for a bounded DCP read; rollback rows are kept. Returns
    once every vbucket reached its end: a stream that brought no row for ``BOUNDED_STALL_S``
    reads the rest over DCP and a vbucket is done when that stream ended, as a TCP read is
    (an end seqno that is a SyncWrite prepare or abort is never reached by a row: before,
    the read waited for it forever). The batches are copies (valid after the next one).

    Raises:
        UnpublishedError: a vbucket is not published over shared memory in `directory`.
    """
    wanted = {vb for vb, end in ends.items() if starts.get(vb).seqno < end}
    if not wanted:
        return
    dcp = dataclasses.replace(config, rollback_to_snapshot=False)
    streams = open_local_streams(dcp, wanted, starts, directory=directory, app_id=app_id)
    try:
        limit = np.zeros(max(ends) + 1, np.int64)
        limit[list(ends)] = [min(end, 2**63 - 1) for end in ends.values()]
        ended: set[int] = set()  # vbuckets read to their end over DCP (StreamEnded)
        loop = asyncio.get_running_loop()
        pending = {local: loop.time() for local in streams}  # -> when it last moved on
        while pending:  # until every vbucket reached its end
            for local in list(pending):
                batch = await local.next_batch(0.05 / len(pending))
                if batch is not None and batch.num_rows:
                    pending[local] = loop.time()
                    bounded = _bounded(batch, wanted, limit)
                    if bounded.num_rows:
                        yield bounded
                session = local.session
                left = {
                    vb
                    for vb in local.vbuckets
                    if vb not in ended and (session is None or session.get(vb).seqno < ends[vb])
                }
                if left and loop.time() - pending[local] >= BOUNDED_STALL_S:
                    # No row for a while: an end the ring may never reach (a prepare or an
                    # abort: no row carries its seqno), or the ring lags. Read to the ends
                    # over DCP, which finishes on StreamEnded whatever the last seqno is.
                    async for batch in local.read_to({vb: ends[vb] for vb in left}, ended):
                        bounded = _bounded(batch, wanted, limit)
                        if bounded.num_rows:
                            yield bounded
                    pending[local] = loop.time()
                    left -= ended
                if not left:
                    del pending[local]
    finally:
        for local in streams:
            local.close()


def _bounded(batch: pa.RecordBatch, wanted: set[int], limit: NDArray[np.int64]) -> pa.RecordBatch:
    """The rows of `wanted` vbuckets at or below their limit (rollbacks: all), snap_end cut."""
    vbs = batch.column("vbucket").to_numpy()
    known = vbs < len(limit)
    index = np.where(known, vbs, 0)
    mine = known & np.isin(vbs, list(wanted))
    rollback = np.asarray(batch.column("op").to_numpy(zero_copy_only=False) == "rollback")
    keep = mine & ((batch.column("seqno").to_numpy() <= limit[index]) | rollback)
    kept = batch.filter(pa.array(keep))
    snap_end = kept.column("snap_end").to_numpy()
    cut = np.minimum(snap_end, limit[kept.column("vbucket").to_numpy()])
    if bool(np.any(cut != snap_end)):
        kept = kept.set_column(
            kept.schema.get_field_index("snap_end"), "snap_end", pa.array(cut, pa.int64())
        )
    return kept
