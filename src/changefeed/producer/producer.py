"""``DcpProducer``: the DCP side of one connection — controls, streams, flow control, noops.

No sockets: the server's connection hands it stream requests and gets a typed outcome back,
calls ``pump`` to get frames to write and feeds it acks, noop replies and the clock. The producer
owns its streams: it decides a request (stream_request.py), opens the reader through its
`VbucketSource` and builds the stream. Streams are served round-robin in quanta so one busy
vbucket cannot starve the others; a pump never produces more than the flow-control window allows
(plus one message, dcp-wire.md §8.1), so a slow consumer cannot grow server memory.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from changefeed import limits
from changefeed.checkpoint import CursorKind, StreamReader
from changefeed.producer.backfill_slots import BackfillSlots
from changefeed.producer.collection_stream import (
    CollectionEncoder,
    CollectionView,
    VbEncoder,
    backfill_key_ranges,
)
from changefeed.producer.encoder import DcpEncoder, StreamEncoder
from changefeed.producer.flow_control import FlowControl
from changefeed.producer.item_encoding import ItemOptions
from changefeed.producer.stream import Stream
from changefeed.producer.stream_machine import StreamMachine
from changefeed.producer.stream_request import (
    Accepted,
    Refused,
    RollbackTo,
    VbucketView,
    decide_stream_request,
)
from changefeed.protocol.collections import (
    StreamFilter,
    manifest_uid_of_request,
    stream_filter_of,
    unknown_collection_body,
)
from changefeed.protocol.dcp import (
    OpenFlag,
    StreamEndReason,
    StreamRequest,
    StreamRole,
    encode_dcp_noop,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.snapshot_marker import MarkerVersion
from changefeed.protocol.status import Status

NOOP_INTERVAL_DEFAULT_S = 20.0  # dcp-wire.md §8.2, when never set
NOOP_INTERVAL_MIN_S = 0.1  # connection_manager_interval
NOOP_OPAQUE_FIRST = 10_000_000  # dcp-wire.md §7.9

# Keys we accept and act on, plus keys we accept for compatibility (no effect here).
KNOWN_CONTROLS = frozenset(
    {
        "connection_buffer_size",
        "enable_noop",
        "set_noop_interval",
        "set_priority",
        "supports_cursor_dropping",
        "supports_cursor_dropping_vulcan",
        "supports_hifi_MFU",
        "send_stream_end_on_client_close_stream",
        "enable_expiry_opcode",
        "enable_stream_id",
        "v7_dcp_status_codes",
        "max_marker_version",
        "backfill_order",
        "stream_buffer_size",
        "force_value_compression",
        "enable_sync_writes",
        "consumer_name",
        "enable_out_of_order_snapshots",
        "include_deleted_user_xattrs",
        "flatbuffers_system_events",
        "change_streams",
        "cache_transfer",
    }
)


class VbucketSource(Protocol):
    """What a producer needs of the node's vbuckets (the server's bucket implements it)."""

    def vbucket_view(self, vb: int) -> VbucketView | None:
        """The vbucket's state, seqnos and failover log now; None if it does not exist here."""
        ...

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
        """A reader of every change of `vb` after `start_seqno`."""
        ...


class ManifestView(CollectionView, Protocol):
    """What the producer needs of the bucket's manifest (server/manifest.py)."""

    @property
    def uid(self) -> int: ...

    def collection_ids(self) -> frozenset[int]: ...

    def scope_uids(self) -> frozenset[int]: ...


_CURSOR_KIND = {StreamRole.APPLICATION: CursorKind.STREAM, StreamRole.REPLICA: CursorKind.REPLICA}


class DcpProducer:
    """The producer side of one DCP connection.

    Args:
        name: the connection name from DCP_OPEN (cursor names and logs).
        flags: DCP_OPEN flags; must include Producer.
        source: the vbuckets streams read from.
        role: who reads (DCP_OPEN); decides the cursor kind and default droppability.
        consumer_name: DCP_OPEN's consumer_name (a replica's node name).
        clock: monotonic seconds (noops, idle time); injected so tests replay.
        streams_max: streams this connection may hold at once.
        backfill_slots: the node's running-backfill slots (a private set if None).
        backfills_max: backfills this connection may run at once.
        encoder_factory: the encoder of each accepted stream (None: DCP frames, `DcpEncoder`);
            the shared-memory publisher builds change rows instead (server/shm_rows.py).
        collections: the connection negotiated HELLO Collections (its application streams
            carry collection ids, system events and take filters: collection_stream.py).
        manifest: the bucket's collections (what a filter may name).
    """

    def __init__(
        self,
        name: str,
        flags: int,
        *,
        source: VbucketSource,
        role: StreamRole = StreamRole.APPLICATION,
        consumer_name: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        streams_max: int = limits.STREAMS_PER_CONNECTION_MAX,
        backfill_slots: BackfillSlots | None = None,
        backfills_max: int = limits.BACKFILLS_PER_CONNECTION_MAX,
        encoder_factory: Callable[[StreamRequest], VbEncoder] | None = None,
        collections: bool = False,
        manifest: ManifestView | None = None,
    ) -> None:
        assert flags & OpenFlag.PRODUCER, flags
        assert streams_max > 0, streams_max
        self.name = name
        self.flags = flags
        self.role = role
        self.consumer_name = consumer_name
        self.clock = clock
        self._source = source
        self._streams_max = streams_max
        self.backfill_slots = backfill_slots if backfill_slots is not None else BackfillSlots()
        self._backfills_max = backfills_max
        self._backfills_running = 0
        self._encoder_factory = encoder_factory
        self.collections = collections
        self.manifest = manifest
        self._filters: dict[int, StreamFilter] = {}  # per vb, of the last accepted request
        self.streams: dict[int, Stream] = {}
        self.flow = FlowControl()
        self.options = ItemOptions(
            delete_times=bool(flags & OpenFlag.INCLUDE_DELETE_TIMES),
            no_value=bool(flags & (OpenFlag.NO_VALUE | OpenFlag.NO_VALUE_WITH_UNDERLYING_DATATYPE)),
            sync_writes=role
            is StreamRole.REPLICA,  # replicas hold prepares; readers never see them
        )
        # V2.0 markers (max visible and high completed seqnos) for replicas, which take
        # SyncWrites; a plain client sees V1 unless it asks for V2.2 (dcp-wire.md §7.2).
        self.marker_version = MarkerVersion.V2_0 if role is StreamRole.REPLICA else MarkerVersion.V1
        self.stream_ids_enabled = False
        self.send_stream_end_on_close = False
        self.v7_status_codes = False  # v7_dcp_status_codes: STREAM_NOT_FOUND for a missing stream
        # dcp-wire.md §10: application cursors may be dropped, replica cursors by request only.
        self.cursor_dropping = role is StreamRole.APPLICATION
        self.noop_enabled = False
        self.noop_interval_s = NOOP_INTERVAL_DEFAULT_S
        self._noop_opaque = NOOP_OPAQUE_FIRST
        self._noop_outstanding = False
        now = clock()
        self._last_noop_s = now
        self.last_received_s = now
        self._rotation: list[int] = []

    # -- controls -------------------------------------------------------------------------------

    def control(self, key: str, value: str) -> tuple[Status, str]:
        """Apply DCP_CONTROL; unknown keys are EINVAL (clients probe with them)."""
        if key not in KNOWN_CONTROLS:
            return Status.EINVAL, f"unknown control {key!r}"
        handler = _CONTROL_HANDLERS.get(key)
        if handler is None:
            return _unsupported_or_ok(key, value)
        return handler(self, value)

    # -- streams --------------------------------------------------------------------------------

    def has_stream(self, vb: int) -> bool:
        stream = self.streams.get(vb)
        return stream is not None and not stream.ended

    def stream_request(self, request: StreamRequest) -> Accepted | RollbackTo | Refused:
        """Decide DCP_STREAM_REQ and, when accepted, start the stream.

        Returns:
            The outcome the connection answers with: the failover log (Accepted), ROLLBACK with
            a seqno (RollbackTo), or an error status (Refused).
        """
        vb = request.vbucket
        live = sum(1 for stream in self.streams.values() if not stream.ended)
        if live >= self._streams_max and not self.has_stream(vb):
            return Refused(
                Status.ENOMEM, f"connection holds {live} streams, the most allowed (streams_max)"
            )
        stream_filter = self._stream_filter(request)
        if isinstance(stream_filter, Refused):
            return stream_filter
        view = self._source.vbucket_view(vb)
        outcome = decide_stream_request(
            request,
            view,
            stream_exists=self.has_stream(vb),
            stream_ids_enabled=self.stream_ids_enabled,
        )
        if isinstance(outcome, Accepted):
            assert view is not None, vb
            self._filters[vb] = stream_filter
            self._add_stream(self._new_stream(request, outcome, view.purge_seqno))
        return outcome

    def _stream_filter(self, request: StreamRequest) -> StreamFilter | Refused:
        """The request's collection filter (dcp-wire.md §6.1): only a collections connection
        may send one; an id the manifest does not hold is UNKNOWN_COLLECTION (UNKNOWN_SCOPE)
        with the manifest uid, as kv_engine answers."""
        value = request.value
        if not ("collections" in value or "scope" in value or "uid" in value):
            return StreamFilter()
        if not self.collections:
            return Refused(Status.EINVAL, "a stream filter or manifest uid needs HELLO Collections")
        try:
            stream_filter = stream_filter_of(value)
            uid = manifest_uid_of_request(value)
        except ProtocolError as error:
            return Refused(Status.EINVAL, str(error))
        manifest = self.manifest
        if manifest is not None:
            body = unknown_collection_body(manifest.uid).decode()
            if uid is not None and uid > manifest.uid:
                # kv_engine collections_manifest_is_ahead: the client saw a manifest this node
                # has not applied yet (a cluster's nodes apply it from etcd one by one); it
                # retries, and a filter naming a collection of it is not called unknown.
                return Refused(Status.COLLECTIONS_MANIFEST_IS_AHEAD, body)
            wanted = stream_filter.collections
            if wanted is not None and not wanted <= manifest.collection_ids():
                return Refused(Status.UNKNOWN_COLLECTION, body)
            if stream_filter.scope is not None and stream_filter.scope not in manifest.scope_uids():
                return Refused(Status.UNKNOWN_SCOPE, body)
        return stream_filter

    def _new_stream(self, request: StreamRequest, accepted: Accepted, purge_seqno: int) -> Stream:
        vb = request.vbucket
        reader = self._source.open_reader(
            vb,
            self._cursor_name(vb),
            accepted.start_seqno,
            kind=_CURSOR_KIND[self.role],
            droppable=self.cursor_dropping,
            end_seqno=accepted.end_seqno,
        )
        inner: VbEncoder
        if self._encoder_factory is not None:
            inner = self._encoder_factory(request)  # rows: the default collection only
        else:
            inner = DcpEncoder(
                vb,
                request.opaque,
                self.options,
                marker_version=self.marker_version,
                stream_id=request.stream_id,
            )
        encoder: StreamEncoder = inner
        if self.role is StreamRole.APPLICATION:  # a replica takes everything as stored
            aware = self.collections and self._encoder_factory is None
            stream_filter = self._filters.get(vb, StreamFilter()) if aware else StreamFilter()
            encoder = CollectionEncoder(
                inner,
                aware=aware,
                stream_filter=stream_filter,
                manifest=self.manifest,
                opaque=request.opaque,
                stream_id=request.stream_id,
            )
            ranges = backfill_key_ranges(stream_filter) if aware else None
            if ranges is not None:  # its backfill reads only what it may send
                reader.narrow(ranges)
        machine = StreamMachine(
            accepted.start_seqno, accepted.end_seqno, visible_only=not self.options.sync_writes
        )
        return Stream(vb, reader=reader, machine=machine, encoder=encoder, purge_seqno=purge_seqno)

    def _cursor_name(self, vb: int) -> str:
        """A replica's cursor is named by the replica node, so a reconnecting replica takes
        over the cursor its last connection left (`close`); other cursors are unique."""
        if self.role is StreamRole.REPLICA and self.consumer_name is not None:
            return f"replica:{self.consumer_name}:{vb}"
        return f"dcp:{self.name}:{vb}:{id(self)}"

    def _add_stream(self, stream: Stream) -> None:
        old = self.streams.get(stream.vb)
        if old is not None:
            assert old.ended, old.vb
            self._give_back_slot(old)
            old.close()
        self.streams[stream.vb] = stream
        if stream.vb not in self._rotation:
            self._rotation.append(stream.vb)

    def close_stream(self, vb: int) -> Status:
        """CLOSE_STREAM: end the stream; a STREAM_END(CLOSED) follows only if asked for."""
        stream = self.streams.get(vb)
        if stream is None or stream.ended:
            # dcp-wire.md §5: with v7 status codes a missing stream is DCP_STREAM_NOT_FOUND.
            return Status.DCP_STREAM_NOT_FOUND if self.v7_status_codes else Status.KEY_ENOENT
        if self.send_stream_end_on_close:
            stream.end(StreamEndReason.CLOSED)
        else:
            self._remove(vb)
        return Status.SUCCESS

    def end_stream(self, vb: int, reason: StreamEndReason) -> None:
        """End a stream from the server side (state change, slow consumer...)."""
        stream = self.streams.get(vb)
        if stream is not None:
            stream.end(reason)

    def close(self) -> None:
        """Connection gone: release every reader (cursors, backfill scans). A replica's cursors
        stay, droppable, so that when it reconnects it catches up from memory if it can."""
        retain = self.role is StreamRole.REPLICA and self.consumer_name is not None
        for vb in list(self.streams):
            self._remove(vb, retain_cursor=retain)

    # -- data path ------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        if not self.flow.can_send:
            return False
        return any(s.ready and self._may_fill(s) for s in self.streams.values())

    @property
    def reading_disk(self) -> bool:
        """True while a stream of this connection backfills from disk."""
        return any(s.needs_disk for s in self.streams.values() if not s.ended)

    def _may_fill(self, stream: Stream) -> bool:
        """A stream that must read disk needs a backfill slot (held, or free to take)."""
        if not stream.needs_disk or stream.holds_backfill_slot:
            return True
        return self._backfills_running < self._backfills_max and self.backfill_slots.available

    def _take_slot(self, stream: Stream) -> bool:
        if stream.holds_backfill_slot:
            return True
        if self._backfills_running >= self._backfills_max or not self.backfill_slots.take():
            return False
        stream.holds_backfill_slot = True
        self._backfills_running += 1
        return True

    def _give_back_slot(self, stream: Stream) -> None:
        if stream.holds_backfill_slot:
            stream.holds_backfill_slot = False
            self._backfills_running -= 1
            assert self._backfills_running >= 0, self._backfills_running
            self.backfill_slots.give_back()

    def pump(self, out: list[bytes], bytes_max: int) -> int:
        """Append frames from ready streams, round-robin, within the window and ``bytes_max``."""
        written = 0
        idle_rounds = 0
        while written < bytes_max and self.flow.can_send and self._rotation:
            vb = self._rotation.pop(0)
            self._rotation.append(vb)
            stream = self.streams[vb]
            room = max(1, self.flow.room_bytes)
            budget = min(limits.STREAM_QUANTUM_BYTES, bytes_max - written, room)
            produced = 0
            if stream.ready and (not stream.needs_disk or self._take_slot(stream)):
                produced = stream.fill(out, budget)
                if not stream.needs_disk:
                    self._give_back_slot(stream)  # back in memory (or ended)
            self.flow.sent(produced)
            written += produced
            if stream.ended:
                self._remove(vb)
            idle_rounds = 0 if produced else idle_rounds + 1
            if idle_rounds >= len(self._rotation):
                break
        return written

    def stats(self) -> dict[str, int]:
        """This connection's counters, for STAT dcp and /metrics."""
        return {
            "streams": sum(1 for stream in self.streams.values() if not stream.ended),
            "unacked_bytes": self.flow.outstanding_bytes,
            "acked_bytes": self.flow.acked_bytes_total,
        }

    def lag_items(self) -> dict[int, int]:
        """Per streamed vbucket: seqnos between the last one sent and the vbucket's high seqno."""
        lags: dict[int, int] = {}
        for vb, stream in self.streams.items():
            view = self._source.vbucket_view(vb)
            behind = 0 if view is None else view.high_seqno - stream.last_sent_seqno
            lags[vb] = max(0, behind)
        return lags

    def on_buffer_ack(self, nbytes: int) -> None:
        self.flow.ack(nbytes)

    # -- liveness -------------------------------------------------------------------------------

    def on_received(self) -> None:
        self.last_received_s = self.clock()

    def on_noop_response(self, opaque: int) -> None:
        if opaque == self._noop_opaque:
            self._noop_outstanding = False

    def due_noop(self) -> bytes | None:
        """A NOOP to send now, if enabled, none outstanding and the interval passed."""
        now = self.clock()
        if not self.noop_enabled or self._noop_outstanding:
            return None
        if now - self._last_noop_s < self.noop_interval_s:
            return None
        self._noop_opaque += 1
        self._noop_outstanding = True
        self._last_noop_s = now
        return encode_dcp_noop(self._noop_opaque)

    def idle_for_s(self) -> float:
        return self.clock() - self.last_received_s

    def _remove(self, vb: int, *, retain_cursor: bool = False) -> None:
        stream = self.streams.pop(vb, None)
        if stream is not None:
            self._give_back_slot(stream)
            stream.close(retain_cursor=retain_cursor)
        if vb in self._rotation:
            self._rotation.remove(vb)


def _set_buffer(p: DcpProducer, value: str) -> tuple[Status, str]:
    if not value.isdigit() or int(value) >= 2**32:
        return Status.EINVAL, "connection_buffer_size must be a u32"
    p.flow.window_bytes = int(value)
    return Status.SUCCESS, ""


def _set_noop(p: DcpProducer, value: str) -> tuple[Status, str]:
    p.noop_enabled = value == "true"
    return Status.SUCCESS, ""


def _set_noop_interval(p: DcpProducer, value: str) -> tuple[Status, str]:
    try:
        interval = float(value)
    except ValueError:
        return Status.EINVAL, "set_noop_interval must be seconds"
    if not interval >= NOOP_INTERVAL_MIN_S or interval != interval:
        return Status.EINVAL, f"set_noop_interval must be >= {NOOP_INTERVAL_MIN_S}"
    p.noop_interval_s = interval
    return Status.SUCCESS, ""


def _set_expiry_opcode(p: DcpProducer, value: str) -> tuple[Status, str]:
    # Takes effect only with IncludeDeleteTimes; silently ignored otherwise (§5).
    p.options = replace(p.options, expiry_opcode=value == "true")
    return Status.SUCCESS, ""


def _set_stream_end_on_close(p: DcpProducer, value: str) -> tuple[Status, str]:
    if value != "true":
        return Status.EINVAL, "send_stream_end_on_client_close_stream can only be turned on"
    p.send_stream_end_on_close = True
    return Status.SUCCESS, ""


def _set_stream_id(p: DcpProducer, value: str) -> tuple[Status, str]:
    if value != "true":
        return Status.EINVAL, "enable_stream_id takes 'true'"
    if p.streams:
        return Status.EINVAL, "enable_stream_id must precede stream requests"
    p.stream_ids_enabled = True
    return Status.SUCCESS, ""


def _set_marker_version(p: DcpProducer, value: str) -> tuple[Status, str]:
    if value != "2.2":
        return Status.EINVAL, "max_marker_version takes '2.2'"
    p.marker_version = MarkerVersion.V2_2
    return Status.SUCCESS, ""


def _set_cursor_dropping(p: DcpProducer, value: str) -> tuple[Status, str]:
    p.cursor_dropping = value == "true"
    return Status.SUCCESS, ""


def _set_v7_status_codes(p: DcpProducer, value: str) -> tuple[Status, str]:
    if value != "true":
        return Status.EINVAL, "v7_dcp_status_codes takes 'true'"
    p.v7_status_codes = True
    return Status.SUCCESS, ""


def _set_backfill_order(p: DcpProducer, value: str) -> tuple[Status, str]:
    # Backfills are served round-robin with every other stream (the pump's rotation).
    if value == "round-robin":
        return Status.SUCCESS, ""
    if value == "sequential":
        return Status.NOT_SUPPORTED, "backfill_order 'sequential' is not supported (round-robin)"
    return Status.EINVAL, "backfill_order takes 'round-robin' or 'sequential'"


def _set_priority(p: DcpProducer, value: str) -> tuple[Status, str]:
    if value not in ("high", "medium", "low"):
        return Status.EINVAL, "set_priority takes high, medium or low"
    return Status.SUCCESS, ""


def _unsupported_or_ok(key: str, value: str) -> tuple[Status, str]:
    """Keys we know but do not implement: NOT_SUPPORTED, as the reference's producer answers."""
    if key == "supports_hifi_MFU":
        return Status.SUCCESS, ""  # only tells the producer the client can take MFU values
    return Status.NOT_SUPPORTED, f"{key} is not supported by this producer"


_CONTROL_HANDLERS: dict[str, Callable[[DcpProducer, str], tuple[Status, str]]] = {
    "connection_buffer_size": _set_buffer,
    "enable_noop": _set_noop,
    "set_noop_interval": _set_noop_interval,
    "enable_expiry_opcode": _set_expiry_opcode,
    "send_stream_end_on_client_close_stream": _set_stream_end_on_close,
    "enable_stream_id": _set_stream_id,
    "max_marker_version": _set_marker_version,
    "supports_cursor_dropping": _set_cursor_dropping,
    "supports_cursor_dropping_vulcan": _set_cursor_dropping,
    "set_priority": _set_priority,
    "v7_dcp_status_codes": _set_v7_status_codes,
    "backfill_order": _set_backfill_order,
}
