"""A DCP consumer reading every vbucket's changes from its active, checking invariant 3.

One connection per node it reads from (DCP_OPEN with role APPLICATION, served by a real
`DcpProducer` through `ProducerEnd`); per vbucket, the production `consumer.session.VbSession`
keeps the resume state: the stream is requested from `request_range()` with the failover log's
uuid, ACTIVE_VB_ONLY, re-requested where the map points after STREAM_END, NOT_MY_VBUCKET or a
lost connection, and a ROLLBACK answer is taken with `rollback_to` before anything else.
`VbSession.on_items` asserts that seqnos rise; the consumer checks it too and reports a
violation (seqnos went backwards outside a rollback) instead of an assert.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from changefeed.consumer.session import VbSession
from changefeed.failover import FailoverLog
from changefeed.protocol.batch import decode_batch
from changefeed.protocol.dcp import (
    DcpOpen,
    OpenFlag,
    StreamFlag,
    StreamRequest,
    decode_failover_log,
    decode_rollback_seqno,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import decode_snapshot_marker
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap

from .network import Conn

if TYPE_CHECKING:
    from .cluster import SimCluster

SEQNO_FOREVER = 0xFFFF_FFFF_FFFF_FFFF
RETRY_S = 0.25


@dataclasses.dataclass(slots=True)
class _Stream:
    node: str
    opaque: int
    open: bool = False


class Consumer:
    def __init__(self, cluster: SimCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.sched = cluster.sched
        self.rng = cluster.sched.stream(f"consumer:{name}")
        self.map: ClusterMap | None = None
        self.sessions: dict[int, VbSession] = {}
        self.conns: dict[str, Conn] = {}
        self.streams: dict[int, _Stream] = {}
        self.opaque_vb: dict[int, int] = {}
        self._opaque = 0
        self.running = False
        self.items = 0
        self.rollbacks = 0
        cluster.net.register(name, lambda: self.sched.now)

    def start(self, cluster_map: ClusterMap) -> None:
        self.map = cluster_map
        self.running = True
        for vb in range(cluster_map.vbuckets):
            self.sessions[vb] = VbSession(vb)
            self._request(vb)
        self.sched.after(0.5, self._config_poll)

    def stop(self) -> None:
        self.running = False

    # -- requests -------------------------------------------------------------------------------

    def _request(self, vb: int) -> None:
        if not self.running or vb in self.streams or self.map is None:
            return
        active = self.map.active(vb)
        if active is None:
            self.sched.after(RETRY_S, self._request, vb)
            return
        conn = self._conn(active.name)
        session = self.sessions[vb]
        start, snap_start, snap_end = session.request_range()
        self._opaque += 1
        request = StreamRequest(
            vb, self._opaque, StreamFlag.ACTIVE_VB_ONLY, start, SEQNO_FOREVER,
            session.vb_uuid, snap_start, snap_end, {},
        )  # fmt: skip
        self.streams[vb] = _Stream(active.name, self._opaque)
        self.opaque_vb[self._opaque] = vb
        conn.send(self.name, encode_stream_request(request))

    def _conn(self, node_name: str) -> Conn:
        conn = self.conns.get(node_name)
        if conn is not None and conn.alive:
            return conn
        conn = self.cluster.net.connect(self.name, node_name)
        self.conns[node_name] = conn
        node = self.cluster.nodes_by_name[node_name]
        conn.on_message[node_name] = lambda payload: node.on_conn_message(conn, payload)
        conn.on_message[self.name] = lambda data: self._receive(conn, data)
        conn.on_close[self.name] = lambda: self._lost(node_name, conn)
        flags = OpenFlag.PRODUCER | OpenFlag.INCLUDE_DELETE_TIMES
        conn.send(self.name, encode_dcp_open(DcpOpen(0, self.name, flags)))  # role APPLICATION
        return conn

    def _lost(self, node_name: str, conn: Conn) -> None:
        if self.conns.get(node_name) is conn:
            del self.conns[node_name]
        for vb, stream in sorted(self.streams.items()):
            if stream.node == node_name:
                del self.streams[vb]
                self.sched.after(RETRY_S, self._request, vb)

    def _retry(self, vb: int) -> None:
        self.streams.pop(vb, None)
        self.sched.after(RETRY_S, self._request, vb)

    # -- what arrives ---------------------------------------------------------------------------

    def _receive(self, conn: Conn, data: bytes) -> None:
        batch = decode_batch(data)
        changes = batch.changes
        done = 0
        for position, frame in batch.controls:
            if position > done:
                self._items(changes, done, position)
                done = position
            self._control(frame)
        if len(changes) > done:
            self._items(changes, done, len(changes))

    def _items(self, changes: Any, start: int, stop: int) -> None:
        vbs = changes.array("vbucket")[start:stop]
        seqnos = changes.array("seqno")[start:stop]
        for vb in sorted({int(v) for v in vbs}):
            mine = seqnos[vbs == vb].astype(np.uint64)
            session = self.sessions[vb]
            if int(mine[0]) <= session.seqno or bool(np.any(mine[1:] <= mine[:-1])):
                self.cluster.violation(
                    f"consumer vb {vb}: seqno {int(mine[0])} after {session.seqno} without a "
                    "rollback"
                )
                self._retry(vb)
                continue
            session.on_items(mine)
            self.items += len(mine)

    def _control(self, f: Frame) -> None:
        if f.magic in (Magic.RESPONSE, Magic.ALT_RESPONSE):
            if f.opcode == Opcode.DCP_STREAM_REQ:
                self._answer(f)
            return
        if f.opcode == Opcode.DCP_SNAPSHOT_MARKER:
            marker = decode_snapshot_marker(f)
            self.sessions[f.vbucket].on_marker(marker.snap_start, marker.snap_end)
        elif f.opcode == Opcode.DCP_STREAM_END:
            self._retry(f.vbucket)

    def _answer(self, f: Frame) -> None:
        vb = self.opaque_vb.pop(f.opaque, None)
        if vb is None or self.streams.get(vb) is None or self.streams[vb].opaque != f.opaque:
            return
        session = self.sessions[vb]
        if f.status == Status.SUCCESS:
            session.failover_log = FailoverLog(decode_failover_log(f.value))
            self.streams[vb].open = True
        elif f.status == Status.ROLLBACK:
            session.rollback_to(decode_rollback_seqno(f.value))
            self.rollbacks += 1
            self.sched.record("consumer-rollback", vb, session.seqno)
            self.streams.pop(vb, None)
            self._request(vb)
        else:
            self._retry(vb)

    # -- maps -----------------------------------------------------------------------------------

    def _config_poll(self) -> None:
        if not self.running:
            return
        target = self.rng.choice(sorted(self.cluster.nodes_by_name))
        node = self.cluster.nodes_by_name[target]
        self.cluster.net.send(self.name, target, node.on_config, self.name)
        self.sched.after(0.5, self._config_poll)

    def on_config(self, cluster_map: ClusterMap | None) -> None:
        if cluster_map is not None and (self.map is None or cluster_map.rev > self.map.rev):
            self.map = cluster_map
