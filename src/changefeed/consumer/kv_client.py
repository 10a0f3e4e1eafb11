"""SDK-style KV client: ``upsert``, ``insert``, ``replace``, ``get``, ``get_replica``,
``remove``, pipelined ``upsert_many``, and durability ``persist`` (wait until the node has the
write on disk).

The vbucket of a key is hashed as Couchbase does (``vbmap.vbucket_for_key``) and the node that
holds it comes from the cluster map (GET_CLUSTER_CONFIG, refreshed by NOT_MY_VBUCKET).
``persist`` polls OBSERVE_SEQNO with the mutation token the write returned, the way Couchbase
SDKs implement ``PersistTo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal
from zlib import crc32

from changefeed.consumer.connection import (
    Connection,
    ConnectionClosedError,
    TlsError,
    client_tls_context,
)
from changefeed.consumer.dcp_routing import read_cluster_config
from changefeed.consumer.handshake import call, connect
from changefeed.protocol.errors import NotMyVbucketError, StatusError, error_for_status
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.frame_info import DurabilityLevel, DurabilityRequirement, encode_durability
from changefeed.protocol.kv import (
    CompactDb,
    CompactionSummary,
    MutationResult,
    ObserveSeqnoResult,
    StoreCommand,
    decode_compaction_summary,
    decode_get_response_flags,
    decode_mutation_token,
    decode_observe_seqno_result,
    encode_compact_db,
    encode_request,
    encode_seqno_persistence,
    encode_store,
)
from changefeed.protocol.kv_pipeline import FRAME, OPAQUE_MASK, TOKEN, StoreReplies, encode_stores
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap, NodeAddress, vbucket_for_key

# "persist": wait until the active node has the write on disk (SEQNO_PERSISTENCE; OBSERVE_SEQNO
# polls on a node without it). The others are the SyncWrite levels of the durability frame: the
# node answers once a majority of the vbucket's copies hold the write (and, per level, have
# persisted it) — or answers SYNC_WRITE_AMBIGUOUS when that did not happen within the timeout,
# never a false success.
Durability = Literal["none", "persist", "majority", "majorityAndPersistActive", "persistToMajority"]
SYNC_LEVELS: Final[Mapping[str, DurabilityLevel]] = {
    "majority": DurabilityLevel.MAJORITY,
    "majorityAndPersistActive": DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
    "persistToMajority": DurabilityLevel.PERSIST_TO_MAJORITY,
}
SYNC_WRITE_TIMEOUT_MS = 10_000  # the SDKs' default durable-write timeout
SYNC_WRITE_PENDING_RETRY_S = 10.0  # SYNC_WRITE_IN_PROGRESS on the key is retried this long
# Requests per upsert_many window (two windows are in flight). A node applies a received
# burst of SETs as one run whose cost is largely per vbucket touched: windows of 4096 (~600 KB
# of 100-byte values) took one node from ~185k to ~255k SETs/s against 1024 (bench_node).
PIPELINE_DEPTH_MAX = 4096
WINDOW_REPLY_TIMEOUT_S = 60.0  # how long a window's node may take to answer all of it
ROUTE_RETRY_S = 15.0  # how long a request follows the map (a failover takes a few seconds)
NOT_MY_VBUCKET_BACKOFF_S = 0.05  # times the attempt number, when the answer had no newer map
ROUTE_BACKOFF_MAX_S = 0.5
TEMPORARY_FAILURE_RETRY_S = 2.5  # TMPFAIL is retried this long (the SDKs' KV timeout), then raised
TEMPORARY_FAILURE_BACKOFF_MAX_S = 0.05  # the flusher frees memory within milliseconds
Connector = Callable[[str, int], Awaitable[Connection]]
# A window sent: the connection, the item indexes in it, their replies and its one future.
_SentWindow = tuple[Connection, Sequence[int], StoreReplies, asyncio.Future[StoreReplies]]
PERSIST_POLL_S = 0.002  # OBSERVE_SEQNO polls, with a node that has no SEQNO_PERSISTENCE
PERSIST_WAIT_S = 30.0  # how long a persist write waits for the node to persist it


def _durability_frame(durability: Durability, timeout_ms: int) -> bytes:
    level = SYNC_LEVELS.get(durability)
    if level is None:
        return b""
    return encode_durability(DurabilityRequirement(level, timeout_ms))


@dataclass(frozen=True, slots=True)
class GetResult:
    value: bytes
    cas: int
    flags: int
    datatype: int


class MutationLostError(Exception):
    """A write a node acknowledged is not on its vbucket's history any more (a failover or
    rollback took it before it was persisted): waiting for its persistence cannot succeed."""


class KvClient:
    """Key-value operations on a node, or on a cluster by its map.

    Built by `connect`, the client reads the cluster map from the node it bootstraps from and
    sends each request to the node holding the key's active vbucket, opening a connection
    per node as needed. A NOT_MY_VBUCKET answer carries the node's current map: the client
    adopts it when it is newer and retries (with backoff, for up to ``ROUTE_RETRY_S``), and so
    does a node that cannot be reached: a moved vbucket or a failover costs retries, not an
    error. Built directly on one connection (no map) it sends everything there and retries
    only TMPFAIL.
    """

    def __init__(
        self,
        conn: Connection,
        vbuckets: int,
        *,
        cluster_map: ClusterMap | None = None,
        connector: Connector | None = None,
        tmpfail_retry_s: float = TEMPORARY_FAILURE_RETRY_S,
    ) -> None:
        assert vbuckets >= 1, vbuckets
        assert cluster_map is None or connector is not None, "a map needs a connector"
        self._conn = conn
        self.vbuckets = vbuckets
        self.cluster_map = cluster_map
        self._connector = connector
        self.tmpfail_retry_s = tmpfail_retry_s  # 0: a TMPFAIL is raised at once
        # How long the node may take to meet a durable write's level (then AMBIGUOUS).
        self.durability_timeout_ms = SYNC_WRITE_TIMEOUT_MS
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self.retries = 0  # NOT_MY_VBUCKET answers retried (tests and stats read it)
        self.temporary_failures = 0  # TMPFAIL answers retried
        self.reconnects = 0  # connections found closed and opened again
        # False once a node answered SEQNO_PERSISTENCE with UNKNOWN_COMMAND: poll instead.
        self._waits_for_persistence = True

    @classmethod
    async def connect(
        cls,
        host: str = "127.0.0.1",
        port: int = 11210,
        *,
        bucket: str = "default",
        user: str = "Administrator",
        password: str = "password",
        tmpfail_retry_s: float = TEMPORARY_FAILURE_RETRY_S,
        tls_ca: str | Path | None = None,
    ) -> KvClient:
        """Connect to the node at ``host:port`` and read its cluster map.

        Args:
            tls_ca: connect over TLS, trusting the CA in this PEM file; ``port`` is then the
                node's TLS port, and other nodes are reached on the TLS ports (``kvSSL``) the
                map advertises.

        Raises:
            OSError, TimeoutError: the node cannot be reached.
            TlsError: the node's certificate is not trusted (one line saying why).
            AuthError, StatusError: the handshake was refused.
        """
        features = [Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON]
        tls = None if tls_ca is None else client_tls_context(tls_ca)
        tls_addresses: dict[str, tuple[str, int]] = {}  # map server -> its TLS address

        async def dial(node_host: str, node_port: int) -> Connection:
            return await connect(
                node_host, node_port, agent="changefeed-kv", user=user, password=password,
                bucket=bucket, features=features, tls=tls,
            )  # fmt: skip

        async def connector(node_host: str, node_port: int) -> Connection:
            if tls is None:
                return await dial(node_host, node_port)
            address = tls_addresses.get(f"{node_host}:{node_port}")
            if address is None:
                raise TlsError(
                    f"TLS: node {node_host}:{node_port} advertises no TLS port (kvSSL) in "
                    "the cluster map"
                )
            return await dial(*address)

        conn = await dial(host, port)
        try:
            config = json.loads((await call(conn, Opcode.GET_CLUSTER_CONFIG)).value)
            cluster_map = ClusterMap.from_couchbase_config(config)
        except BaseException:
            await conn.close()
            raise
        server = f"{host}:{port}"
        if tls is not None:  # the map names nodes by their plain KV address
            _, server = read_cluster_config(config, server)
            tls_addresses.update(_tls_addresses(config))
            tls_addresses[server] = (host, port)  # the node dialled, whatever it advertises
        client = cls(
            conn,
            cluster_map.vbuckets,
            cluster_map=cluster_map,
            connector=connector,
            tmpfail_retry_s=tmpfail_retry_s,
        )
        client._conns[server] = conn
        return client

    async def close(self) -> None:
        await self._conn.close()
        for conn in self._conns.values():
            await conn.close()
        self._conns.clear()

    async def __aenter__(self) -> KvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def vbucket_of(self, key: bytes) -> int:
        return vbucket_for_key(key, self.vbuckets)

    # -- routing ----------------------------------------------------------------------------

    @property
    def _can_fail_over(self) -> bool:
        """Whether a lost node may come back elsewhere: a map of more than one node. Alone,
        a node that is gone is gone; the loss is raised at once, as before clusters."""
        return self.cluster_map is not None and len(self.cluster_map.nodes) > 1

    async def _conn_for(self, vb: int) -> Connection:
        """The connection to vb's active node (opened on first use)."""
        if self.cluster_map is None:
            return self._conn
        node = self.cluster_map.active(vb)
        if node is None:
            raise NotMyVbucketError(f"vb {vb} has no active node in map rev {self.cluster_map.rev}")
        return await self._node_conn(node)

    async def _node_conn(self, node: NodeAddress) -> Connection:
        """The connection to `node`, opened (again) when needed — once, however many requests
        ask for it at the same time (a lock per node: no connection opened twice and leaked)."""
        conn = self._conns.get(node.server)
        if conn is not None and conn.closed is None:
            return conn
        lock = self._connecting.setdefault(node.server, asyncio.Lock())
        async with lock:
            conn = self._conns.get(node.server)
            if conn is not None and conn.closed is None:
                return conn
            assert self._connector is not None
            if conn is not None:
                self.reconnects += 1  # the node closed it (idle, restarted) or it broke
            conn = await self._connector(node.host, node.port)
            self._conns[node.server] = conn
            return conn

    def _learn_map(self, body: bytes) -> bool:
        """Adopt the map in a NOT_MY_VBUCKET body when it is newer; True if it was."""
        try:
            found = ClusterMap.from_couchbase_config(json.loads(body))
        except ValueError:  # not a map (JSONDecodeError is a ValueError): refresh instead
            return False
        if self.cluster_map is None or found.rev <= self.cluster_map.rev:
            return False
        self.cluster_map = found
        return True

    async def _request(
        self, vb: int, build: Callable[[int], bytes], *, timeout_s: float = 30.0, sync: bool = False
    ) -> Frame:
        """Send a request for `vb` to its active node and return the answer.

        With a map, the client follows it: NOT_MY_VBUCKET (adopt the map in the answer, or
        ask another node), a node that cannot be reached or drops the connection, a vbucket
        without an active (a failover in progress) — each is retried with backoff for up to
        ROUTE_RETRY_S, the time a failover takes. TMPFAIL is retried for
        TEMPORARY_FAILURE_RETRY_S, and a durable (``sync``) write meeting another one's pending
        prepare (SYNC_WRITE_IN_PROGRESS) for SYNC_WRITE_PENDING_RETRY_S. Without a map, only
        TMPFAIL and SYNC_WRITE_IN_PROGRESS are retried.
        """
        start = time.monotonic()
        attempt = tmpfails = 0
        while True:  # bounded by ROUTE_RETRY_S and TEMPORARY_FAILURE_RETRY_S
            try:
                conn = await self._conn_for(vb)
                opaque = conn.next_opaque()
                response = await conn.request(build(opaque), opaque, timeout_s=timeout_s)
            except (OSError, ConnectionClosedError, NotMyVbucketError) as error:
                # OSError covers refused connections and TimeoutError.
                if not self._can_fail_over or time.monotonic() - start > ROUTE_RETRY_S:
                    raise
                attempt += 1
                self.retries += 1
                await asyncio.sleep(min(ROUTE_BACKOFF_MAX_S, NOT_MY_VBUCKET_BACKOFF_S * attempt))
                await self._refresh_map_anywhere(error)
                continue
            if (
                response.status == Status.ETMPFAIL
                and time.monotonic() - start < self.tmpfail_retry_s
            ):
                # The node is catching up (checkpoint memory full, persistence stalled): SDKs
                # retry such answers with backoff, and so do we, for a bounded time.
                tmpfails += 1
                self.temporary_failures += 1
                await asyncio.sleep(min(TEMPORARY_FAILURE_BACKOFF_MAX_S, 0.001 * 2**tmpfails))
                continue
            if (
                sync
                and response.status == Status.SYNC_WRITE_IN_PROGRESS
                and time.monotonic() - start < SYNC_WRITE_PENDING_RETRY_S
            ):
                tmpfails += 1
                await asyncio.sleep(min(TEMPORARY_FAILURE_BACKOFF_MAX_S, 0.001 * 2**tmpfails))
                continue
            if response.status != Status.NOT_MY_VBUCKET or self.cluster_map is None:
                return response
            if time.monotonic() - start > ROUTE_RETRY_S:
                return response
            attempt += 1
            self.retries += 1
            if not self._learn_map(response.value):
                await asyncio.sleep(min(ROUTE_BACKOFF_MAX_S, NOT_MY_VBUCKET_BACKOFF_S * attempt))
                await self._refresh_map_anywhere(None)

    async def _refresh_map_anywhere(self, error: BaseException | None) -> None:
        """Ask the nodes of the map, in turn, for their map (GET_CLUSTER_CONFIG) and adopt a
        newer one; a node that cannot be reached is skipped (it may be the one that died)."""
        assert self.cluster_map is not None
        for node in self.cluster_map.nodes:
            try:
                conn = await self._node_conn(node)
                response = await call(conn, Opcode.GET_CLUSTER_CONFIG)
            except (OSError, ConnectionClosedError, StatusError):
                continue
            self._learn_map(response.value)
            return

    # -- operations -------------------------------------------------------------------------

    async def upsert(
        self, key: bytes, value: bytes, *, durability: Durability = "none", **meta: int
    ) -> MutationResult:
        """Write ``value`` at ``key``. ``meta``: cas, flags, expiry, datatype."""
        return await self._store(Opcode.SET, key, value, durability, **meta)

    async def insert(
        self, key: bytes, value: bytes, *, durability: Durability = "none", **meta: int
    ) -> MutationResult:
        """Like ``upsert``; raises KeyExistsError when the key exists."""
        return await self._store(Opcode.ADD, key, value, durability, **meta)

    async def replace(
        self, key: bytes, value: bytes, *, durability: Durability = "none", **meta: int
    ) -> MutationResult:
        """Like ``upsert``; raises KeyNotFoundError if absent, KeyExistsError on CAS mismatch."""
        return await self._store(Opcode.REPLACE, key, value, durability, **meta)

    async def _store(
        self,
        opcode: int,
        key: bytes,
        value: bytes,
        durability: Durability,
        *,
        cas: int = 0,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
    ) -> MutationResult:
        vb = self.vbucket_of(key)
        framing = _durability_frame(durability, self.durability_timeout_ms)

        def build(opaque: int) -> bytes:
            command = StoreCommand(opcode, vb, opaque, key, value, flags, expiry, cas, datatype)
            return encode_store(command, framing)

        result = _mutation_result(await self._request(vb, build, sync=bool(framing)), vb)
        if durability == "persist":
            await self.wait_persisted(result)
        return result

    async def get(self, key: bytes) -> GetResult:
        """Raises KeyNotFoundError when the key does not exist."""
        vb = self.vbucket_of(key)
        response = await self._request(
            vb, lambda opaque: encode_request(Opcode.GET, vbucket=vb, opaque=opaque, key=key)
        )
        _check(response)
        flags = decode_get_response_flags(response.extras)
        return GetResult(response.value, response.cas, flags, response.datatype)

    async def get_replica(self, key: bytes, replica: int = 1) -> GetResult:
        """Read the key's `replica`-th replica copy (GET_REPLICA to the node holding it).

        Raises:
            KeyNotFoundError: the replica does not hold the key (yet).
            NotMyVbucketError: no such replica in the map.
        """
        vb = self.vbucket_of(key)
        if self.cluster_map is None or not 1 <= replica <= self.cluster_map.replicas:
            raise NotMyVbucketError(f"vb {vb} has no replica {replica}")
        index = self.cluster_map.chains[vb][replica]
        if index == -1:
            raise NotMyVbucketError(f"vb {vb} replica {replica} is not placed")
        conn = await self._node_conn(self.cluster_map.nodes[index])
        opaque = conn.next_opaque()
        request = encode_request(Opcode.GET_REPLICA, vbucket=vb, opaque=opaque, key=key)
        response = await conn.request(request, opaque)
        _check(response)
        flags = decode_get_response_flags(response.extras)
        return GetResult(response.value, response.cas, flags, response.datatype)

    async def remove(
        self, key: bytes, *, cas: int = 0, durability: Durability = "none"
    ) -> MutationResult:
        vb = self.vbucket_of(key)
        framing = _durability_frame(durability, self.durability_timeout_ms)

        def build(opaque: int) -> bytes:
            return encode_frame(
                Magic.ALT_REQUEST if framing else Magic.REQUEST,
                Opcode.DELETE,
                framing_extras=framing,
                vbucket=vb,
                opaque=opaque,
                key=key,
                cas=cas,
            )

        result = _mutation_result(await self._request(vb, build, sync=bool(framing)), vb)
        if durability == "persist":
            await self.wait_persisted(result)
        return result

    async def upsert_many(
        self, items: list[tuple[bytes, bytes]], *, durability: Durability = "none"
    ) -> list[MutationResult]:
        """Pipelined SETs in windows of ``PIPELINE_DEPTH_MAX``, results in input order.

        Each window is sent to the nodes holding its keys' vbuckets, all nodes at once; a
        write answered NOT_MY_VBUCKET is retried on its own after the map is updated. The
        next window goes out while the replies to one are still coming (two windows in
        flight, so a node never waits for this client to turn around) — unless the two share
        a key: a retried write must not land after a later write of its key, so such a
        window waits for the one before. A stale map therefore costs up to two windows of
        NOT_MY_VBUCKET retries, not one. If a window fails, the call raises; the window after
        it may have been applied too.
        """
        results: list[MutationResult | None] = [None] * len(items)
        vbuckets = _vbuckets_of(items, self.vbuckets)
        framing = _durability_frame(durability, self.durability_timeout_ms)
        previous: asyncio.Future[None] | None = None  # the window whose replies are due
        previous_keys: set[bytes] = set()
        sending: asyncio.Future[None] | None = None
        try:
            for first in range(0, len(items), PIPELINE_DEPTH_MAX):
                window = range(first, min(len(items), first + PIPELINE_DEPTH_MAX))
                keys = {key for key, _ in items[window.start : window.stop]}
                if previous is not None and not previous_keys.isdisjoint(keys):
                    await previous
                    previous = None
                sending = asyncio.ensure_future(
                    self._store_window(items, vbuckets, window, results, framing)
                )
                if previous is not None:
                    await previous  # while `sending` goes out
                previous, previous_keys, sending = sending, keys, None
            if previous is not None:
                await previous
        except BaseException:
            for window_task in (previous, sending):  # the other window: stopped and collected
                if window_task is None:
                    continue
                window_task.cancel()  # no-op when done
                with contextlib.suppress(BaseException):
                    await window_task
            raise
        done = [r for r in results if r is not None]
        assert len(done) == len(items), (len(done), len(items))
        if durability == "persist" and done:
            await self.wait_all_persisted(done)
        return done

    async def wait_all_persisted(
        self, done: Sequence[MutationResult], *, timeout_s: float = PERSIST_WAIT_S
    ) -> None:
        """Wait until every write of `done` is persisted on the history it was written on:
        per vbucket its newest write is waited for with one SEQNO_PERSISTENCE, followed in the
        same write by an OBSERVE_SEQNO that checks the write is on the node's history; a
        node's requests go together. The node answers the wait as soon as the flush round
        that persists the write ends, and refuses it (TMPFAIL) if the vbucket's state or
        history changes meanwhile. A node that does not know the opcode (UNKNOWN_COMMAND)
        is polled with OBSERVE_SEQNO from then on; a wait answered TMPFAIL (too many waits,
        a failing store, a changed history) is polled.

        Raises:
            TimeoutError: not persisted within `timeout_s`.
            MutationLostError: a write is not on its vbucket's history any more.
            TemporaryFailureError: the node cannot persist (its message says why).
            StatusError: a node refused a wait (NOT_MY_VBUCKET: the vbucket moved).
        """
        deadline = time.monotonic() + timeout_s
        newest: dict[int, MutationResult] = {}
        for result in done:
            newest[result.vbucket] = result
        unanswered = list(newest.values())
        if self._waits_for_persistence:
            by_conn: dict[int, tuple[Connection, list[MutationResult]]] = {}
            for result in unanswered:
                conn = await self._conn_for(result.vbucket)
                by_conn.setdefault(id(conn), (conn, []))[1].append(result)
            waits = [
                self._wait_persisted_together(conn, results, timeout_s)
                for conn, results in by_conn.values()
            ]
            unanswered = [result for polled in await asyncio.gather(*waits) for result in polled]
        await asyncio.gather(*(self._poll_persisted(r, deadline) for r in unanswered))

    async def _wait_persisted_together(
        self, conn: Connection, results: list[MutationResult], timeout_s: float
    ) -> list[MutationResult]:
        """For each of `results` on `conn`, a SEQNO_PERSISTENCE and then an OBSERVE_SEQNO, all
        in one write. The node handles a connection's requests in order, so each check sees
        the history the wait was registered on, and a wait is answered success only if that
        history is still the vbucket's. Returns the results that must be polled."""
        count = len(results)
        first = conn.reserve_opaques(2 * count)
        opaques = [(first + i) & OPAQUE_MASK for i in range(2 * count)]
        requests = b"".join(
            [
                *(
                    encode_seqno_persistence(r.vbucket, r.seqno, opaque)
                    for r, opaque in zip(results, opaques[:count], strict=True)
                ),
                *(
                    encode_request(
                        Opcode.OBSERVE_SEQNO,
                        vbucket=r.vbucket,
                        opaque=opaque,
                        value=r.vb_uuid.to_bytes(8, "big"),
                    )
                    for r, opaque in zip(results, opaques[count:], strict=True)
                ),
            ]
        )
        try:  # a little longer than the node waits (30 s): its TMPFAIL comes first
            frames = await conn.request_batch(requests, opaques, timeout_s=timeout_s + 5.0)
        except TimeoutError:
            raise TimeoutError(
                f"{count} vbuckets' writes not persisted within {timeout_s:g} s"
            ) from None
        polled = []
        for result, waited, observed in zip(results, frames[:count], frames[count:], strict=True):
            if observed.status != Status.SUCCESS:
                raise error_for_status(observed.status, observed.value.decode(errors="replace"))
            _check_history(result, decode_observe_seqno_result(observed.value))
            if waited.status == Status.SUCCESS:
                continue
            if waited.status in (Status.UNKNOWN_COMMAND, Status.NOT_SUPPORTED):
                self._waits_for_persistence = False
            elif waited.status != Status.ETMPFAIL:
                raise error_for_status(waited.status, waited.value.decode(errors="replace"))
            polled.append(result)
        return polled

    async def _window_connections(
        self, vbuckets: list[int], pending: Sequence[int]
    ) -> dict[int, Connection | BaseException]:
        """The connection to each vbucket of `pending`'s active node, or why there is none
        (raised at once when the client cannot fail over)."""
        routes: dict[int, Connection | BaseException] = {}
        for vb in dict.fromkeys(vbuckets[i] for i in pending):  # first use first, as sent
            try:
                routes[vb] = await self._conn_for(vb)
            except (OSError, ConnectionClosedError, NotMyVbucketError) as error:
                if not self._can_fail_over:
                    raise
                routes[vb] = error
        return routes

    async def _store_window(
        self,
        items: list[tuple[bytes, bytes]],
        vbuckets: list[int],
        indexes: range,
        results: list[MutationResult | None],
        framing: bytes = b"",
    ) -> None:
        """Send one window pipelined, to every node it needs at once, and fill `results`.
        ``framing``: a durability frame on every write (their replies come as each commits).

        Each node's share of the window is encoded at once (``kv_pipeline.encode_stores``) and
        sent in one write; its replies are decoded by the connection into one ``StoreReplies``
        (one future per node, none per write). Plain successes become results directly; any
        other answer goes through the per-frame handling, in input order.

        Writes answered TMPFAIL, NOT_MY_VBUCKET (the map moved) or lost with their node go
        again together, pipelined, after a backoff — not one by one, so a node shedding load
        is not also slowed to one round trip per write — until they succeed or the retry time
        (TEMPORARY_FAILURE_RETRY_S, ROUTE_RETRY_S with a map) runs out.
        """
        following = self.cluster_map is not None
        lost = (OSError, ConnectionClosedError, NotMyVbucketError)
        start = time.monotonic()
        pending: Sequence[int] = indexes
        gone: BaseException | None = None  # the last connection loss, raised if it persists
        rounds = 0
        while pending:  # bounded by the retry times
            # -- route: each write to its vbucket's node; the unroutable go again -----------
            if self.cluster_map is None:
                targets: list[tuple[Connection, Sequence[int]]] = [(self._conn, pending)]
                unsent: list[tuple[int, BaseException]] = []
            else:
                targets, unsent = _split_by_connection(
                    await self._window_connections(vbuckets, pending), vbuckets, pending
                )
                if unsent:
                    gone = unsent[-1][1]
            # -- send: one encoded buffer and one window per connection ----------------------
            sent: list[_SentWindow] = []
            for conn, group in targets:
                if isinstance(group, range) and group.step == 1:  # all of a first round
                    group_items = items[group.start : group.stop]
                    group_vbuckets = vbuckets[group.start : group.stop]
                else:
                    group_items = [items[i] for i in group]
                    group_vbuckets = [vbuckets[i] for i in group]
                try:
                    first = conn.reserve_opaques(len(group))
                    data = encode_stores(Opcode.SET, group_items, group_vbuckets, first, framing)
                    replies, done = conn.expect_window(first, len(group))
                    conn.send(data)
                except lost as error:
                    if not self._can_fail_over:
                        raise
                    gone = error
                    unsent.extend((i, error) for i in group)
                    continue
                sent.append((conn, group, replies, done))
            for conn, *_ in sent:
                with contextlib.suppress(*lost):  # a lost node: its writes go again
                    await conn.drain()
            # -- answers: plain successes at once, the rest per frame, in input order ------
            again: list[int] = []
            last: Frame | None = None
            others: list[tuple[int, StoreReplies | None, int, BaseException | None]] = [
                (i, None, 0, error) for i, error in unsent
            ]
            for conn, group, replies, done in sent:
                failed: BaseException | None = None
                try:
                    async with asyncio.timeout(WINDOW_REPLY_TIMEOUT_S):  # keeps a cancel
                        await done
                except lost as error:  # the replies that came before are kept
                    failed = error
                finally:
                    conn.forget_window(replies)
                if failed is None and not replies.frames:
                    _fill_results(results, group, vbuckets, replies)
                else:
                    others.extend((i, replies, j, failed) for j, i in enumerate(group))
            others.sort(key=_first)
            for i, answers, j, reason in others:
                vb = vbuckets[i]
                response = None
                if answers is not None:
                    state = answers.state[j]
                    if state == TOKEN:
                        results[i] = MutationResult(
                            vbucket=vb,
                            seqno=answers.seqno[j],
                            cas=answers.cas[j],
                            vb_uuid=answers.vb_uuid[j],
                        )
                        continue
                    if state == FRAME:
                        response = answers.frames[j]
                if response is None:
                    assert reason is not None, (i, j)
                    if not self._can_fail_over:
                        raise reason
                    gone = reason
                    self.retries += 1
                elif response.status == Status.NOT_MY_VBUCKET and following:
                    self.retries += 1
                    self._learn_map(response.value)
                elif response.status in (Status.ETMPFAIL, Status.SYNC_WRITE_IN_PROGRESS):
                    self.temporary_failures += 1
                    last = response
                else:
                    results[i] = _mutation_result(response, vb)
                    continue
                again.append(i)
            pending = again
            if not pending:
                return
            elapsed = time.monotonic() - start
            limit = ROUTE_RETRY_S if following and last is None else self.tmpfail_retry_s
            if elapsed > limit:
                if last is not None:
                    _check(last)  # raises the TMPFAIL's error
                if gone is not None:
                    raise gone
                raise NotMyVbucketError(
                    f"{len(pending)} writes found no active after {elapsed:.1f} s"
                )
            rounds += 1
            await asyncio.sleep(min(TEMPORARY_FAILURE_BACKOFF_MAX_S, 0.001 * 2**rounds))
            if following and last is None:
                await self._refresh_map_anywhere(None)

    async def compact(
        self,
        vb: int,
        *,
        purge_age_s: float | None = None,
        drop_deletes: bool = False,
        timeout_s: float = 600.0,
    ) -> CompactionSummary:
        """COMPACT_DB: purge vbucket ``vb``'s old tombstones now; returns once the node is done.

        Args:
            purge_age_s: purge tombstones deleted at least this long ago. The node compares
                delete times with its own clock, so this becomes a cutoff time on this host's
                clock (kv_engine's purge_before_ts); None uses the node's tombstone_purge_age_s.
            drop_deletes: purge every tombstone, whatever its age.

        Raises:
            NotMyVbucketError: ``vb`` is not an active vbucket of the node.
            TimeoutError: no answer within ``timeout_s``.
        """
        purge_before_ts = 0  # the node's own purge age
        if purge_age_s is not None:
            purge_before_ts = max(1, int(time.time() - purge_age_s) + 1)  # "deleted before"

        def build(opaque: int) -> bytes:
            return encode_compact_db(
                CompactDb(vb, opaque, purge_before_ts, drop_deletes=drop_deletes)
            )

        response = await self._request(vb, build, timeout_s=timeout_s)
        _check(response)
        return decode_compaction_summary(response.value)

    async def wait_persisted(
        self, result: MutationResult, *, timeout_s: float = PERSIST_WAIT_S
    ) -> None:
        """Wait until the write is persisted on the history it was written on
        (`wait_all_persisted` of it alone).

        Raises:
            TimeoutError, MutationLostError, TemporaryFailureError, StatusError: as
                `wait_all_persisted`.
        """
        await self.wait_all_persisted([result], timeout_s=timeout_s)

    async def _poll_persisted(self, result: MutationResult, deadline: float) -> None:
        """OBSERVE_SEQNO until the write's seqno is persisted on the history it was written
        on (its mutation token's vb_uuid), or raise MutationLostError once the node's history
        is shown not to hold it."""
        value = result.vb_uuid.to_bytes(8, "big")
        while True:  # bounded by the deadline
            response = await call(
                await self._conn_for(result.vbucket),
                Opcode.OBSERVE_SEQNO,
                vbucket=result.vbucket,
                value=value,
            )
            observed = decode_observe_seqno_result(response.value)
            _check_history(result, observed)
            if observed.persisted_seqno >= result.seqno:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"seqno {result.seqno} of vb {result.vbucket} not persisted")
            await asyncio.sleep(PERSIST_POLL_S)


def _check_history(result: MutationResult, observed: ObserveSeqnoResult) -> None:
    """Raise MutationLostError if the node's history of the vbucket (`observed`, asked with
    the write's vb_uuid) does not hold the write: a failover or rollback since took it. A
    write without a mutation token (vb_uuid 0) cannot be checked."""
    if not result.vb_uuid or observed.vb_uuid == result.vb_uuid:
        return
    # The write survives only if the history it was written on ended past it
    # (OBSERVE_SEQNO's failover answer says where; none: the node never had that history).
    branch_end = observed.old_seqno if observed.old_vb_uuid is not None else None
    if branch_end is None or branch_end < result.seqno:
        raise MutationLostError(
            f"vb {result.vbucket}: seqno {result.seqno} written on history "
            f"{result.vb_uuid:#x} is not on the node's history {observed.vb_uuid:#x} "
            "(a failover or rollback took it)"
        )


def _tls_addresses(config: object) -> dict[str, tuple[str, int]]:
    """Each node's TLS address by its ``host:port`` name, from a Couchbase config's
    ``nodesExt`` (``services.kvSSL``, Couchbase's TLS KV port); nodes without one are left out."""
    found: dict[str, tuple[str, int]] = {}
    nodes_ext = config.get("nodesExt") if isinstance(config, dict) else None
    for entry in nodes_ext if isinstance(nodes_ext, list) else ():
        services = entry.get("services") if isinstance(entry, dict) else None
        if not isinstance(services, dict):
            continue
        host, kv, kv_ssl = entry.get("hostname"), services.get("kv"), services.get("kvSSL")
        if isinstance(host, str) and isinstance(kv, int) and isinstance(kv_ssl, int):
            found[f"{host}:{kv}"] = (host, kv_ssl)
    return found


def _vbuckets_of(items: list[tuple[bytes, bytes]], vbuckets: int) -> list[int]:
    """``vbmap.vbucket_for_key`` of each item's key, in one pass (its formula, inlined)."""
    assert vbuckets >= 1, vbuckets
    return [((crc32(key) >> 16) & 0x7FFF) % vbuckets for key, _ in items]


def _split_by_connection(
    routes: dict[int, Connection | BaseException], vbuckets: list[int], pending: Sequence[int]
) -> tuple[list[tuple[Connection, Sequence[int]]], list[tuple[int, BaseException]]]:
    """Group `pending` by the connection of its vbucket (input order kept in each group);
    writes whose vbucket has none come back with the reason."""
    found = {id(target): target for target in routes.values()}
    if len(found) == 1:  # one node takes the whole window (always, on a single node)
        (target,) = found.values()
        if isinstance(target, Connection):
            return [(target, pending)], []
        return [], [(i, target) for i in pending]
    groups: dict[int, tuple[Connection, list[int]]] = {}
    unsent: list[tuple[int, BaseException]] = []
    for i in pending:
        route = routes[vbuckets[i]]
        if isinstance(route, Connection):
            groups.setdefault(id(route), (route, []))[1].append(i)
        else:
            unsent.append((i, route))
    return list(groups.values()), unsent


def _fill_results(
    results: list[MutationResult | None],
    group: Sequence[int],
    vbuckets: list[int],
    replies: StoreReplies,
) -> None:
    """Results for a window answered with plain successes only (replies index = group index)."""
    if isinstance(group, range) and group.step == 1:
        results[group.start : group.stop] = _mutation_results(
            vbuckets[group.start : group.stop], replies
        )
        return
    for i, result in zip(
        group, _mutation_results([vbuckets[i] for i in group], replies), strict=True
    ):
        results[i] = result


# MutationResult is a frozen slots dataclass: its __init__ sets each field through
# object.__setattr__, half the cost of a pipelined write's result. Setting the slots directly
# makes the same objects (equal, same repr and hash) at twice the speed; only while the fields
# are the four below (checked here; otherwise the constructor is used).
_RESULT_SLOTS = ("vbucket", "seqno", "cas", "vb_uuid")
_FAST_RESULTS = (
    tuple(field.name for field in dataclasses.fields(MutationResult)) == _RESULT_SLOTS
    and MutationResult.__slots__ == _RESULT_SLOTS
    and not hasattr(MutationResult, "__post_init__")
)


def _mutation_results(vbuckets: list[int], replies: StoreReplies) -> list[MutationResult]:
    """``MutationResult`` of each plain success of ``replies`` (all of them are)."""
    columns = zip(vbuckets, replies.seqno, replies.cas, replies.vb_uuid, strict=True)
    if not _FAST_RESULTS:
        return [
            MutationResult(vbucket=vb, seqno=seqno, cas=cas, vb_uuid=uuid)
            for vb, seqno, cas, uuid in columns
        ]
    new = object.__new__
    cls = MutationResult
    set_vbucket, set_seqno, set_cas, set_uuid = (
        vars(MutationResult)[name].__set__ for name in _RESULT_SLOTS
    )
    made: list[MutationResult] = []
    append = made.append
    for vb, seqno, cas, uuid in columns:
        result = new(cls)
        set_vbucket(result, vb)
        set_seqno(result, seqno)
        set_cas(result, cas)
        set_uuid(result, uuid)
        append(result)
    return made


def _first(entry: tuple[int, StoreReplies | None, int, BaseException | None]) -> int:
    return entry[0]


def _check(response: Frame) -> None:
    if response.status != Status.SUCCESS:
        raise error_for_status(response.status, response.value.decode(errors="replace"))


def _mutation_result(response: Frame, vb: int) -> MutationResult:
    _check(response)
    token = decode_mutation_token(response.extras)
    uuid, seqno = token if token is not None else (0, 0)
    return MutationResult(vbucket=vb, seqno=seqno, cas=response.cas, vb_uuid=uuid)
