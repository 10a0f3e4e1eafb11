"""``DcpClient``: stream any set of vbuckets of a bucket, from the nodes that hold them.

Routing: on ``connect`` the client reads the cluster map (GET_CLUSTER_CONFIG) from the node it
bootstraps from, and streams each vbucket from the node holding its active copy, over one DCP
connection per node (``dcp_node_stream.NodeStream``, opened when first needed; the bootstrap
connection is one of them, so a single-node map means one connection). Requests carry
``ACTIVE_VB_ONLY``: a node holding only a replica refuses with NOT_MY_VBUCKET instead of
streaming a copy. A vbucket whose stream cannot go on where it is — refused NOT_MY_VBUCKET, ended
STATE_CHANGED (its node stopped being active), or on a connection that dropped — is placed
again: the map is taken from the refusal's body when newer, else read again from a node
(``dcp_map.MapFollower``), and the stream is requested from the new active from where the
vbucket really is (the producer answers with the rollback the DCP rules prescribe if history
diverged). Attempts are bounded and backed off (``dcp_routing.Retries``); the application
sees ``StreamRefused`` only when a vbucket cannot be placed, and ``events()`` raises
``ConnectionClosedError`` when nodes stay unreachable. With ``follow_map=False`` the client
streams from the configured node only, whatever state its copies are in (a tool or test
reading one node's replica).

Two views of each vbucket's session are kept on purpose:

* the *request* session, owned by the reader side, says what to ask for next — it is rolled
  back and re-requested the moment a ROLLBACK answer arrives, with no round trip through the
  app; a re-placed stream starts from the application session plus the events still queued
  (``dcp_routing.positions``), which is exactly what was received;
* the *application* session (``client.session``) moves only as the application takes events
  from ``events()``, so saving it after handling an event never claims data the application has
  not seen (exactly-once resume).

Events of all connections wait in one bounded queue, in arrival order (so in order per
vbucket; there is no order across vbuckets); when it is full every connection stops reading its
socket and the producers' flow-control windows fill, so a slow application never grows our
memory (the bound is ``limits.EVENT_QUEUE_MAX`` plus one read per connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from changefeed import limits
from changefeed.consumer.connection import (
    CloseReason,
    Connection,
    ConnectionClosedError,
    client_tls_context,
)
from changefeed.consumer.dcp_map import MapFollower
from changefeed.consumer.dcp_node_stream import NodeStream
from changefeed.consumer.dcp_routing import Retries, RetryKind, apply_event, positions
from changefeed.consumer.events import (
    Disconnected,
    Event,
    Rollback,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.handshake import call, connect
from changefeed.consumer.session import SessionState, VbSession
from changefeed.failover import FailoverLog
from changefeed.protocol.collections import StreamFilter, decode_id_extras
from changefeed.protocol.dcp import (
    StreamEndReason,
    StreamFlag,
    StreamRole,
    decode_failover_log,
    decode_rollback_seqno,
)
from changefeed.protocol.errors import StatusError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap

SEQNO_FOREVER = 0xFFFF_FFFF_FFFF_FFFF
RECONNECT_ATTEMPTS_MAX = 60  # with the backoff capped at 5 s: about 5 minutes
NOT_MY_VBUCKET_RETRIES = 10  # with the default backoff ~30 s: longer than a failover takes
# COLLECTIONS_MANIFEST_IS_AHEAD: the node has not applied the manifest the session saw; a
# cluster's nodes apply it from etcd within a watch round trip, so ~30 s is ample.
MANIFEST_BEHIND_RETRIES = 10
# While streams wait out a reconnect backoff, the map is read this often: a failover that
# moves them to a live node places them at once, not at the next attempt (up to 5 s later).
MAP_POLL_WHILE_WAITING_S = 0.25
Start = Literal["beginning", "now"] | SessionState


@dataclass(frozen=True, slots=True)
class ClientConfig:
    host: str = "127.0.0.1"  # the bootstrap node
    port: int = 11210
    bucket: str = "default"
    user: str = "Administrator"
    password: str = "password"
    name: str = ""  # DCP connection name; default "changefeed:consumer:<random>" (a reused
    # name makes the node close the older connection, dcp-wire.md §4)
    buffer_bytes: int = 8 * 1024 * 1024  # flow-control window per connection; acked at 20%
    noop_interval_s: float = 10.0
    end_seqno: int = SEQNO_FOREVER  # or stream only up to a seqno, then STREAM_END(Ok)
    to_latest: bool = False  # end each stream at the high seqno at request time
    reconnect_backoff_s: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
    # Roll back to the newest whole snapshot at or below the node's rollback seqno (safe for
    # any consumer). False: to the node's seqno exactly, for sinks that re-read the keys they
    # hold above it from the node (the Spark mirror does).
    rollback_to_snapshot: bool = True
    # Who reads (DCP_OPEN): application streams may fall back to disk under memory pressure;
    # REPLICA is for a cluster's replica vbuckets pulling from their active.
    role: StreamRole = StreamRole.APPLICATION
    # Stream each vbucket from its active node (the cluster map). False: from the node at
    # host:port only, active or replica copies alike.
    follow_map: bool = True
    # Connect over TLS trusting the CA in this PEM file (port is then the node's TLS port).
    # Other nodes of a map are dialled at the map's addresses: TLS across a cluster needs
    # their TLS ports in the map (kvSSL; docs/operations.md, "TLS and connection budgets").
    tls_ca: str | None = None
    # Collections (issue 28). Any of these negotiates HELLO Collections: keys then arrive with
    # their LEB128 collection id in front (protocol.collections.split_key), and system events
    # (`CollectionEvent`) and `SeqnoAdvanced` come too. `collections` ("scope.collection", ...)
    # or `scope` narrow the streams to those (the node then streams nothing else); neither:
    # every collection. Without any, the default collection only, as before collections.
    collections: tuple[str, ...] = ()
    scope: str | None = None
    collections_aware: bool = False

    @property
    def negotiates_collections(self) -> bool:
        return self.collections_aware or bool(self.collections) or self.scope is not None


class DcpClient:
    """Async DCP consumer. ``async with DcpClient(config) as c: await c.stream(...)``."""

    def __init__(self, config: ClientConfig, *, rng: random.Random | None = None) -> None:
        if not config.name:
            config = dataclasses.replace(
                config, name=f"changefeed:consumer:{uuid.uuid4().hex[:12]}"
            )
        self.config = config
        self.session = SessionState()
        self._map = MapFollower(config.host, config.port, self._dial)
        self._requests: dict[int, VbSession] = {}
        self._where: dict[int, NodeStream] = {}  # vb -> the node its request went to
        self._nodes: dict[str, NodeStream] = {}  # by host:port
        self._from_latest: set[int] = set()
        self._end_seqnos: dict[int, int] = {}
        # Bounded by pausing the sockets at limits.EVENT_QUEUE_MAX (plus one read each).
        self._events: deque[Event] = deque()
        self._event_ready = asyncio.Event()
        self._failure: BaseException | None = None
        self._rng = rng or random.Random()
        budget = {RetryKind.MOVED: NOT_MY_VBUCKET_RETRIES}
        budget[RetryKind.UNREACHABLE] = RECONNECT_ATTEMPTS_MAX
        budget[RetryKind.MANIFEST_BEHIND] = MANIFEST_BEHIND_RETRIES
        self._retries = Retries(config.reconnect_backoff_s, budget, self._rng)
        self._wake = asyncio.Event()
        self._placing = asyncio.Lock()
        self._placer: asyncio.Task[None] | None = None
        self._tls = None if config.tls_ca is None else client_tls_context(config.tls_ca)
        self.stream_filter: StreamFilter | None = None  # resolved on connect (collections)

    @property
    def cluster_map(self) -> ClusterMap | None:
        """The map streams are routed by (None: everything from the bootstrap node)."""
        return self._map.cluster_map

    async def __aenter__(self) -> DcpClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def connect(self) -> None:
        """Open the bootstrap connection (HELLO, auth, bucket), read the cluster map on it
        (``follow_map``), then DCP_OPEN it as the stream connection of its node."""
        conn = await self._dial(self.config.host, self.config.port)
        try:
            if self.config.negotiates_collections:
                self.stream_filter = await resolve_filter(conn, self.config)
                self.session.stream_filter = self.stream_filter
            if self.config.follow_map:
                await self._map.read(conn)
        except BaseException:
            await conn.close()
            raise
        server = self._map.bootstrap
        self._nodes[server] = await self._open_node(server, conn)
        self._placer = asyncio.get_running_loop().create_task(self._place_loop())

    def _controls(self) -> list[tuple[str, str]]:
        return [
            ("enable_noop", "true"),
            ("set_noop_interval", f"{self.config.noop_interval_s:g}"),
            ("connection_buffer_size", str(self.config.buffer_bytes)),
            ("enable_expiry_opcode", "true"),
            ("send_stream_end_on_client_close_stream", "true"),
        ]

    async def close(self) -> None:
        if self._placer is not None:
            self._placer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._placer
            self._placer = None
        nodes, self._nodes = list(self._nodes.values()), {}
        for node in nodes:
            await node.close()

    async def stream(
        self,
        vbuckets: list[int],
        start: Start = "beginning",
        *,
        end_seqnos: dict[int, int] | None = None,
    ) -> None:
        """Request streams for ``vbuckets`` from the beginning, from now, or from saved state,
        each from its active node (connections opened as needed).

        Args:
            end_seqnos: per-vbucket end seqno (the stream ends after the snapshot holding it);
                vbuckets not listed use ``config.end_seqno``.

        Raises:
            StatusError: a node refused the connection (e.g. authentication). Unreachable
                nodes are retried in the background instead.
        """
        if end_seqnos:
            self._end_seqnos.update(end_seqnos)
        if isinstance(start, SessionState):
            if start.stream_filter != self.stream_filter and start.vbuckets:
                raise ValueError(
                    f"the session state was recorded with the filter {start.stream_filter}, "
                    f"not {self.stream_filter}: its positions skip what that one left out"
                )
            for vb in vbuckets:
                self.session.vbuckets[vb] = start.get(vb).copy()
        for vb in vbuckets:
            self._retries.forget(vb)
            if start == "now":
                self._from_latest.add(vb)
            else:
                self._from_latest.discard(vb)
        await self._place(vbuckets, first=True)

    async def events(self) -> AsyncIterator[Event]:
        """Yield events in order, advancing ``self.session`` as each is taken.

        A dropped connection yields ``Disconnected``; its vbuckets are resumed from the
        session state on a new connection (or on the node the map names now), with backoff.

        Raises:
            ConnectionClosedError: a vbucket's node stayed unreachable for
                ``RECONNECT_ATTEMPTS_MAX`` attempts (after the events queued before it).
            StatusError: a node refused a new connection (e.g. authentication).
        """
        while True:  # the application's loop; ends when the caller stops iterating
            while not self._events:
                if self._failure is not None:
                    raise self._failure
                self._event_ready.clear()
                await self._event_ready.wait()
            event = self._events.popleft()
            if len(self._events) <= limits.EVENT_QUEUE_MAX // 2:
                for node in self._nodes.values():
                    node.resume_reading()
            apply_event(self.session, event)
            yield event

    # -- placement: which node streams which vbucket -------------------------------------------

    async def _place(self, vbuckets: list[int], *, first: bool = False) -> None:
        """Request each of ``vbuckets`` from its node: a ``first`` request from the session
        state, a stream placed again from where it really is (the events queued included)."""
        async with self._placing:
            if first:
                at = {vb: self.session.get(vb).copy() for vb in vbuckets}
            else:
                at = positions(self.session, self._events, vbuckets)
            by_server: dict[str | None, list[int]] = {}
            for vb in vbuckets:
                by_server.setdefault(self._map.route(vb), []).append(vb)
            for server, group in by_server.items():
                if server is None:
                    rev = self.cluster_map.rev if self.cluster_map else 0
                    self._moved(group, f"no active node in map rev {rev}", source=None)
                    continue
                try:
                    node = await self._node(server)
                    for vb in group:
                        self._request(node, vb, at[vb], first=first)
                except Exception as error:
                    if not _retriable(error):
                        raise
                    # What was sent before the loss is moved by the node's disconnect.
                    self._unreachable([vb for vb in group if vb not in self._where], error)

    def _request(self, node: NodeStream, vb: int, position: VbSession, *, first: bool) -> None:
        end = self._end_seqnos.get(vb, self.config.end_seqno)
        if not first and end != SEQNO_FOREVER and position.seqno >= end:
            self._put(StreamEnded(vb, StreamEndReason.OK))  # it moved after reaching its end
            return
        self._requests[vb] = position
        self._send_request(node, vb)

    def _send_request(self, node: NodeStream, vb: int) -> None:
        session = self._requests[vb]
        flags = StreamFlag.ACTIVE_VB_ONLY if self.cluster_map is not None else 0
        if vb in self._from_latest and session.seqno == 0:  # nothing received yet
            flags |= StreamFlag.FROM_LATEST
        if self.config.to_latest:
            flags |= StreamFlag.TO_LATEST
        end = self._end_seqnos.get(vb, self.config.end_seqno)
        node.request(session, flags=flags, end_seqno=end, stream_filter=self.stream_filter)
        self._where[vb] = node

    async def _node(self, server: str) -> NodeStream:
        """The stream connection to ``server``, opened on first use (or after it dropped)."""
        node = self._nodes.get(server)
        if node is not None and not node.closed:
            return node
        node = await self._open_node(server, await self._dial(*self._map.address(server)))
        self._nodes[server] = node
        if len(self._events) >= limits.EVENT_QUEUE_MAX:
            node.pause_reading()
        return node

    async def _dial(self, host: str, port: int) -> Connection:
        cfg = self.config
        features = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON]
        if cfg.negotiates_collections:
            features.append(Feature.COLLECTIONS)
        return await connect(
            host, port, agent=cfg.name, user=cfg.user, password=cfg.password,
            bucket=cfg.bucket, features=features, tls=self._tls,
        )  # fmt: skip

    async def _open_node(self, server: str, conn: Connection) -> NodeStream:
        cfg = self.config
        return await NodeStream.open(
            server, conn, self, name=cfg.name, role=cfg.role, controls=self._controls(),
            buffer_bytes=cfg.buffer_bytes,
        )  # fmt: skip

    async def _place_loop(self) -> None:
        """Background task: place again the vbuckets whose retry is due, until closed."""
        loop = asyncio.get_running_loop()
        while True:  # ends when close() cancels it, or on a failure events() raises
            self._wake.clear()
            delay = self._retries.next_delay(loop.time())
            polling = delay is not None and self.cluster_map is not None
            if polling and delay is not None:
                delay = min(delay, MAP_POLL_WHILE_WAITING_S)
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await self._wake.wait()
            due, refresh = self._retries.take_due(loop.time())
            if not due:
                if polling:
                    await self._follow_map_while_waiting()
                continue
            try:
                if refresh:
                    await self._map.refresh()
                await self._place(due)
            except Exception as error:  # not retriable (e.g. authentication): tell the app
                self._fail(error)
                return

    async def _follow_map_while_waiting(self) -> None:
        """Read the map (rate-limited by the follower); if it is newer, place the waiting
        vbuckets now — a failover moved them, or the node they wait for is back."""
        rev = self.cluster_map.rev if self.cluster_map is not None else 0
        await self._map.refresh()
        if self.cluster_map is not None and self.cluster_map.rev > rev:
            self._retries.hurry(self._retries.pending(), asyncio.get_running_loop().time())

    def _moved(
        self, vbuckets: list[int], message: str, *, source: str | None, immediate: bool = False
    ) -> None:
        """Place ``vbuckets`` again where the map points (``source``: the node that refused
        or ended them); refuse those out of attempts."""
        if source is not None:
            self._map.moved_by(source)
        now = asyncio.get_running_loop().time()
        spent = self._retries.schedule(vbuckets, RetryKind.MOVED, now, immediate=immediate)
        for vb in spent:
            self._put(StreamRefused(vb, Status.NOT_MY_VBUCKET, message))
        self._wake.set()

    def _manifest_behind(self, vb: int, message: str) -> None:
        """Ask for ``vb`` again after a backoff: its node has not applied the manifest the
        session saw (it will, from etcd); refuse it once the budget is spent."""
        now = asyncio.get_running_loop().time()
        for spent in self._retries.schedule([vb], RetryKind.MANIFEST_BEHIND, now):
            self._put(StreamRefused(spent, Status.COLLECTIONS_MANIFEST_IS_AHEAD, message))
        self._wake.set()

    def _unreachable(self, vbuckets: list[int], error: BaseException) -> None:
        now = asyncio.get_running_loop().time()
        if self._retries.schedule(vbuckets, RetryKind.UNREACHABLE, now):
            self._fail(ConnectionClosedError(CloseReason.IO_ERROR, f"reconnect failed: {error}"))
        self._wake.set()

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        self._event_ready.set()

    # -- StreamOwner: called by the node streams' reader tasks ---------------------------------

    def put(self, event: Event) -> None:
        self._put(event)

    def stream_answered(self, node: NodeStream, vb: int, frame: Frame) -> None:
        if self._where.get(vb) is not node:
            return  # an answer from a connection the vbucket has left
        if frame.status == Status.SUCCESS:
            log = decode_failover_log(frame.value)
            self._requests[vb].failover_log = FailoverLog(log)
            self._retries.succeeded(vb)
            self._put(StreamOpened(vb, log))
        elif frame.status == Status.ROLLBACK:
            server_seqno = decode_rollback_seqno(frame.value)
            request_session = self._requests[vb]
            seqno = server_seqno
            if self.config.rollback_to_snapshot:
                seqno = request_session.consistent_point_at_or_below(server_seqno)
            request_session.rollback_to(seqno)
            self._put(Rollback(vb, seqno, server_seqno))
            self._send_request(node, vb)
        elif frame.status == Status.NOT_MY_VBUCKET and self.cluster_map is not None:
            del self._where[vb]
            # At once when the map (the answer's, or one read since) routes vb elsewhere.
            learned = self._map.learn(frame.value)
            message = f"{node.server}: {frame.value[:200].decode(errors='replace')}"
            immediate = learned or self._map.route(vb) != node.server
            self._moved([vb], message, source=node.server, immediate=immediate)
        elif frame.status == Status.COLLECTIONS_MANIFEST_IS_AHEAD:
            del self._where[vb]
            self._manifest_behind(
                vb, f"{node.server}: {frame.value[:200].decode(errors='replace')}"
            )
        else:
            del self._where[vb]
            self._put(StreamRefused(vb, frame.status, frame.value.decode(errors="replace")))

    def stream_ended(self, node: NodeStream, vb: int, reason: StreamEndReason) -> None:
        if self._where.get(vb) is not node:
            return  # the end of a stream on a connection the vbucket has left
        del self._where[vb]
        if reason == StreamEndReason.STATE_CHANGED and self.cluster_map is not None:
            message = f"{node.server} is no longer vbucket {vb}'s active"
            self._moved([vb], message, source=node.server)
            return
        self._put(StreamEnded(vb, reason))

    def disconnected(self, node: NodeStream, error: ConnectionClosedError) -> None:
        if self._nodes.get(node.server) is node:
            del self._nodes[node.server]
        moved = sorted(vb for vb, n in self._where.items() if n is node)
        for vb in moved:
            del self._where[vb]
        self._put(Disconnected(f"{node.server}: {error}"))
        self._unreachable(moved, error)

    def _put(self, event: Event) -> None:
        self._events.append(event)
        self._event_ready.set()
        if len(self._events) >= limits.EVENT_QUEUE_MAX:
            for node in self._nodes.values():
                node.pause_reading()  # resumed by events() once the app catches up


async def resolve_filter(conn: Connection, config: ClientConfig) -> StreamFilter:
    """The stream filter of ``config``'s collection names, as ids the node resolves now
    (GET_COLLECTION_ID, GET_SCOPE_ID).

    Raises:
        StatusError: UNKNOWN_COLLECTION / UNKNOWN_SCOPE naming the path, or EINVAL.
    """
    if config.collections:
        ids = set()
        for path in config.collections:
            try:
                response = await call(conn, Opcode.GET_COLLECTION_ID, value=path.encode())
            except StatusError as error:
                raise type(error)(f"collection {path!r}: {error}", status=error.code) from None
            ids.add(decode_id_extras(response.extras)[1])
        return StreamFilter(collections=frozenset(ids))
    if config.scope is not None:
        try:
            response = await call(conn, Opcode.GET_SCOPE_ID, value=config.scope.encode())
        except StatusError as error:
            raise type(error)(f"scope {config.scope!r}: {error}", status=error.code) from None
        return StreamFilter(scope=decode_id_extras(response.extras)[1])
    return StreamFilter()


def _retriable(error: Exception) -> bool:
    """A node that may answer later: unreachable, gone (ConnectionClosedError is an
    OSError), slow, or answering a retriable status (e.g. TMPFAIL while it warms up)."""
    if isinstance(error, StatusError):
        return error.retriable
    return isinstance(error, OSError | TimeoutError)


__all__ = ["ClientConfig", "DcpClient", "call"]
