"""Replica feeds and the active's replica streams over a simulated connection, in real code.

The replica side is the production `cluster.replica_stream.ReplicaFeed`: its stream requests
(`VBucket.replica_request_range`), its handling of answers (ROLLBACK truncates first, the
active's failover log adopted), markers, mutations, prepares, commits and aborts applied
through `VBucket`, and its DCP_SEQNO_ACKNOWLEDGED — fed the bytes the active sent, decoded by
`protocol.batch.decode_batch`. Only its asyncio shell is replaced: `SimFeed` overrides the
three methods that read the event loop's clock (`_retry_later`, `_retry_due`) or report a
failure (`_fail`), and a `_ConnShim` stands in for `consumer.connection.Connection`.

The active side is the production `producer.DcpProducer` (role REPLICA, `consumer_name` = the
replica node): `decide_stream_request` and the failover log decide each request, a
`StreamReader` over the vbucket's checkpoints or store feeds `pump`, the real encoder frames
the items. `ProducerEnd` is the connection handler's part (server/connection.py
`_dcp_stream_req`, `_dcp_seqno_acknowledged`, `connection_lost`): answers, and the
`ReplicationTracker` told of opened, acknowledged and closed streams.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_request import Accepted, Refused, RollbackTo
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp import (
    StreamRole,
    decode_buffer_ack,
    decode_dcp_control,
    decode_dcp_open,
    decode_seqno_acknowledged,
    decode_stream_request,
    encode_failover_log,
    encode_rollback_seqno,
)
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import NodeAddress

from .network import Conn

if TYPE_CHECKING:
    from .node import SimNode

BUFFER_BYTES = 8 * 1024 * 1024
PUMP_BYTES_MAX = 1 << 20
RECONNECT_S = (0.1, 0.2, 0.5)


class _BucketShim:
    """What `ReplicaFeed` reads of a bucket: `vbucket(vb)`."""

    def __init__(self, node: SimNode) -> None:
        self._node = node

    def vbucket(self, vb: int) -> Any:
        return self._node.vbuckets[vb]


class _ConnShim:
    """What `ReplicaFeed` uses of `consumer.connection.Connection`."""

    def __init__(self, conn: Conn, end: str) -> None:
        self.conn = conn
        self.end = end
        self._opaque = 0

    def next_opaque(self) -> int:
        self._opaque += 1
        return self._opaque

    def send(self, data: bytes) -> None:
        self.conn.send(self.end, data)

    def pause_reading(self) -> None:  # memory full: the sim's budget is never reached
        pass

    def resume_reading(self) -> None:
        pass


class SimFeed:
    """The production `ReplicaFeed` core over a simulated connection, on the scheduler's clock:
    this is only its shell (connect, reconnect with backoff, the tick timer)."""

    def __init__(self, node: SimNode, source: str, vbuckets: set[int]) -> None:
        options = FeedOptions(node_name=node.name, buffer_bytes=BUFFER_BYTES)
        self.feed = ReplicaFeed(
            _BucketShim(node),  # type: ignore[arg-type]
            NodeAddress(source, "sim", 0),
            vbuckets,
            options,
            clock=lambda: node.sched.now,
        )
        self.node = node
        self.source = self.feed.source
        self.vbuckets = self.feed.vbuckets
        self.options = options
        self.name = self.feed.name
        self.sim_conn: Conn | None = None
        self.closed = False
        self._attempt = 0
        self._tick_due = False

    # -- session --------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect: the session's DCP_OPEN (role REPLICA) and controls, then a stream request
        per vbucket, from what each vbucket holds."""
        if self.closed:
            return
        node = self.node
        conn = node.net.connect(node.name, self.source.name)
        node.own_conns[conn.id] = conn
        self.sim_conn = conn
        me = node.name
        incarnation = node.incarnation
        conn.on_message[me] = lambda data: node.if_current(incarnation, self._receive, data)
        conn.on_close[me] = lambda: node.if_current(incarnation, self._lost, conn)
        link = _ConnShim(conn, me)
        self.feed.attach(link)
        opens = self.feed.session.open_messages(
            iter(link.next_opaque, None),
            name=self.name,
            role=StreamRole.REPLICA,
            consumer_name=me,
            controls=self.feed.control_messages(),
        )
        # DCP_OPEN and the controls in one write; the active answers each (the session
        # leaves those answers to the shell, which has nothing to wait for here).
        conn.send(me, b"".join(data for _, data in opens))
        target = node.cluster.nodes_by_name[self.source.name]
        conn.on_message[self.source.name] = lambda payload: target.on_conn_message(conn, payload)
        self.feed.request_all()
        self.poke(self.options.ack_interval_s)

    def close(self) -> None:
        """The node no longer wants this feed (map changed): hang up."""
        self.closed = True
        conn, self.sim_conn = self.sim_conn, None
        self.feed.detach()
        if conn is not None:
            self.node.own_conns.pop(conn.id, None)
            conn.close(self.node.name)

    def on_persisted(self, vbs: list[int]) -> None:
        if not self.closed and self.sim_conn is not None:
            self.feed.on_persisted(vbs)

    def _receive(self, data: bytes) -> None:
        if self.closed or self.sim_conn is None:
            return
        batch = decode_batch(data)
        assert batch.consumed == len(data), (batch.consumed, len(data))
        self.feed.on_push(batch)
        failure = self.feed.failure
        if failure is not None:
            if isinstance(failure, AssertionError):  # production code's own invariant broke
                self.node.cluster.violation(f"{self.name}: assert in the replica feed: {failure!r}")
            self.node.sched.record("feed-fail", self.name, type(failure).__name__)
        self.node.request_flush()
        self.poke(self.options.ack_interval_s)

    def _lost(self, conn: Conn) -> None:
        if self.sim_conn is not conn:
            return
        self.node.own_conns.pop(conn.id, None)
        self.sim_conn = None
        self.feed.detach()
        if self.closed:
            return
        backoff = RECONNECT_S[min(self._attempt, len(RECONNECT_S) - 1)]
        self._attempt += 1
        self.node.timer(backoff, self.start)

    def poke(self, delay_s: float) -> None:
        """Run the feed's tick (acks, retries, backlog) after `delay_s` (one pending at most)."""
        if not self._tick_due and not self.closed:
            self._tick_due = True
            self.node.timer(delay_s, self._tick)

    def _tick(self) -> None:
        self._tick_due = False
        if self.closed or self.sim_conn is None:
            return
        if self.feed.failure is not None:
            conn = self.sim_conn
            conn.close(self.node.name)
            self._lost(conn)
            return
        self._attempt = 0
        self.feed.tick()
        if self.feed.retries_pending:
            self.poke(self.options.retry_s)


class ProducerEnd:
    """The active's side of one DCP connection: a real `DcpProducer`, made by the DCP_OPEN the
    connection starts with, and the connection handler's duties (server/connection.py
    `_dcp_open`, `_dcp_control`, `_dcp_stream_req`, `_dcp_seqno_acknowledged`,
    `connection_lost`): answers, one write per received message, and the replication
    tracker told of a replica's opened, acknowledged and closed streams."""

    def __init__(self, node: SimNode, conn: Conn) -> None:
        self.node = node
        self.conn = conn
        self.replica: str | None = None
        self.producer: DcpProducer | None = None
        self._replies: list[bytes] = []

    @staticmethod
    def opens(data: bytes) -> bool:
        """Whether `data` starts with a DCP_OPEN (the first bytes of a DCP connection)."""
        controls = decode_batch(data).controls
        return bool(controls) and controls[0][1].opcode == Opcode.DCP_OPEN

    def receive(self, data: bytes) -> None:
        batch = decode_batch(data)
        assert not len(batch.changes), "a consumer sends no changes"
        for _, frame in batch.controls:
            self._on_frame(frame)
        if self._replies:
            replies, self._replies = self._replies, []
            self.conn.send(self.node.name, b"".join(replies))

    def _on_frame(self, f: Frame) -> None:
        node, tracker = self.node, self.node.tracker
        if f.magic in (Magic.RESPONSE, Magic.ALT_RESPONSE):
            return  # marker acks, noop replies
        if f.opcode == Opcode.DCP_OPEN:
            message = decode_dcp_open(f)
            replica = message.role is StreamRole.REPLICA and message.consumer_name
            self.replica = message.consumer_name if replica else None
            self.producer = DcpProducer(
                message.name,
                message.flags,
                source=node,
                role=message.role,
                consumer_name=message.consumer_name,
                clock=node.sched.monotonic,
            )
            self._reply(encode_response(f))
            return
        producer = self.producer
        if producer is None:
            self._reply(encode_response(f, Status.EINVAL, value=b"DCP_OPEN first"))
            return
        if f.opcode == Opcode.DCP_CONTROL:
            control = decode_dcp_control(f)
            status, text = producer.control(control.key, control.value)
            self._reply(encode_response(f, status, value=text.encode()))
        elif f.opcode == Opcode.DCP_STREAM_REQ:
            match producer.stream_request(decode_stream_request(f)):
                case Accepted(failover_log=entries, start_seqno=start):
                    self._reply(encode_response(f, value=encode_failover_log(list(entries))))
                    if self.replica is not None:
                        tracker.stream_opened(f.vbucket, self.replica, start)
                        node.durability.on_progress(f.vbucket)
                        if node.applied is None and node.incarnation > 1:
                            node.cluster.note("served_before_map")  # a replica stream
                    node.request_pump()
                case RollbackTo(seqno=seqno):
                    value = encode_rollback_seqno(seqno)
                    self._reply(encode_response(f, Status.ROLLBACK, value=value))
                case Refused(status=status, message=message):
                    self._reply(encode_response(f, status, value=message.encode()))
        elif f.opcode == Opcode.DCP_SEQNO_ACKNOWLEDGED and self.replica is not None:
            ack = decode_seqno_acknowledged(f)
            persisted = ack.persisted if ack.persisted is not None else 0
            tracker.acknowledged(f.vbucket, self.replica, ack.received, persisted)
            node.durability.on_progress(f.vbucket)
        elif f.opcode == Opcode.DCP_BUFFER_ACK:
            producer.on_buffer_ack(decode_buffer_ack(f))
            node.request_pump()

    def _reply(self, data: bytes) -> None:
        self._replies.append(data)

    def pump(self) -> bool:
        """Send what the streams have; True if more is ready."""
        if self.producer is None:
            return False
        out: list[bytes] = []
        self.producer.pump(out, PUMP_BYTES_MAX)
        if out:
            self.conn.send(self.node.name, b"".join(out))
        return self.producer.ready

    def closed(self) -> None:
        """The connection is gone (server/connection.py `connection_lost`)."""
        if self.producer is None:
            return
        tracker = self.node.tracker
        if self.replica is not None:
            for vb in sorted(self.producer.streams):
                tracker.stream_closed(vb, self.replica)
                self.node.durability.on_progress(vb)
        self.producer.close()
