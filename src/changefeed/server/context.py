"""What every connection of a node shares, handed to it at construction.

The node builds one `ServerContext`; connections, stats and metrics read it. Nothing below the
node reaches up to the node itself, so the server's modules import each other in one direction
(context ← connection ← node).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client.metrics_core import Metric

from changefeed.producer.backfill_slots import BackfillSlots
from changefeed.protocol.dcp import StreamEndReason
from changefeed.server.authenticator import AuthThrottle
from changefeed.server.bucket import Bucket
from changefeed.server.budget import PartialBytesBudget
from changefeed.server.compactor import Compactor
from changefeed.server.config import NodeConfig
from changefeed.server.expiry_pager import ExpiryPager
from changefeed.server.manifest import ManifestStore
from changefeed.server.rate_limit import ByteRate
from changefeed.server.registry import DcpRegistry
from changefeed.server.replication import ReplicationTracker
from changefeed.server.sync_writes import SyncWriteMonitor
from changefeed.server.users import Users
from changefeed.vbmap import ClusterMap, NodeAddress
from changefeed.vbucket import VBucket
from changefeed.vbucket_state import Effect, Transition, VBucketState


class MapSubscriber(Protocol):
    """A connection that negotiated a cluster map change notification (HELLO)."""

    def push_cluster_map(self, version: tuple[int, int], config: bytes) -> bool:
        """Send the map of ``version`` (epoch, revision) unless it saw that one or a newer one;
        return whether it was sent."""
        ...


class Closable(Protocol):
    """A live connection as the node sees it: closed at shutdown, checked for deadlines."""

    def close(self) -> None: ...

    def check_deadlines(self, now: float) -> None:
        """Close the connection if it overstayed a deadline (auth, idle, partial request)."""
        ...


@dataclasses.dataclass(slots=True)
class ServerContext:
    """The node's shared state.

    Attributes:
        config: the node's configuration.
        users: who may authenticate.
        bucket: the one bucket this node serves.
        dcp: live DCP connections by name.
        connections: every open client connection (stats, shutdown, deadlines).
        partial: the node-wide bound on bytes of unfinished requests.
        backfill_slots: the node-wide bound on disk backfills running at once.
        compactor, expiry_pager: the node's background workers (None until the node makes
            them): COMPACT_DB, STAT and /metrics reach them here.
        node_secret: derives stable decoy SCRAM salts for unknown users (users.py).
        auth_throttle: per-host failed-authentication budget, shared by all connections.
        monotonic: seconds for timeouts and noops; injected so tests replay.
        port: the bound KV port (known once listening; config.port may be 0).
        tls_port: the bound TLS port (0: no TLS listener); clients find it in the map (kvSSL).
        cluster_map: the map this node serves by (None: alone, every vbucket active here);
            set by the cluster layer as maps arrive, read by GET_CLUSTER_CONFIG and
            NOT_MY_VBUCKET replies.
        replication: acks and in-sync state of the replicas of this node's active vbuckets.
        catchup_rate: the node's bound on replica catch-up from disk (shared by replica pumps).
        stat_providers: STAT groups added by layers above the server (the cluster agent's
            replica feeds), by group name.
        metric_providers: /metrics families added by parts the node starts (the shared-memory
            publisher's `changefeed_shm_*`).
        map_subscribers: connections that asked to be told of cluster map changes
            (`push_cluster_map`).
        sync_writes: the durable writes pending on this node's active vbuckets.
        fence_check: called before a connection serves what it received: the cluster agent
            fences this node's actives there if its membership may have lapsed (a node
            resumed from a pause must not act on a lease it may have lost).
        manifests: the bucket's collections manifest (server/manifest.py).
    """

    config: NodeConfig
    users: Users
    bucket: Bucket
    dcp: DcpRegistry = dataclasses.field(default_factory=DcpRegistry)
    connections: set[Closable] = dataclasses.field(default_factory=set)
    partial: PartialBytesBudget = dataclasses.field(default_factory=PartialBytesBudget)
    backfill_slots: BackfillSlots = dataclasses.field(default_factory=BackfillSlots)
    compactor: Compactor | None = None
    expiry_pager: ExpiryPager | None = None
    node_secret: bytes | None = None
    auth_throttle: AuthThrottle = dataclasses.field(default_factory=AuthThrottle)
    monotonic: Callable[[], float] = time.monotonic
    port: int = 0
    tls_port: int = 0
    cluster_map: ClusterMap | None = None
    replication: ReplicationTracker | None = None
    catchup_rate: ByteRate | None = None
    stat_providers: dict[str, Callable[[], Iterable[tuple[str, str]]]] = dataclasses.field(
        default_factory=dict
    )
    metric_providers: list[Callable[[], Iterable[Metric]]] = dataclasses.field(default_factory=list)
    map_subscribers: set[MapSubscriber] = dataclasses.field(default_factory=set)
    sync_writes: SyncWriteMonitor | None = None
    fence_check: Callable[[], None] | None = None
    manifests: ManifestStore = dataclasses.field(default_factory=lambda: ManifestStore(None))

    def set_vbucket_state(self, vb: int, state: VBucketState) -> Transition | None:
        """The node's one entry to change a vbucket's state: the vbucket performs its own
        effects of the edge (`VBucket.set_state`), and this fans out the node's — durable
        writes waiting on it answered AMBIGUOUS, its streams ended STATE_CHANGED, its
        replicas' progress forgotten — all in this call, so no waiter or stream outlives the
        change by an event-loop turn.

        Returns:
            The edge taken, or None when the vbucket already was in `state`.
        """
        edge = change_vbucket_state(
            self.bucket.vbucket(vb),
            state,
            waiters=self.sync_writes,
            end_streams=lambda: self.dcp.end_streams(vb, StreamEndReason.STATE_CHANGED),
            replication=self.replication,
        )
        if edge is not None and state is VBucketState.ACTIVE:
            self.manifests.activated(vb)  # a promoted copy writes the system events it lacks
        return edge

    def current_map(self) -> ClusterMap:
        """The map clients route by: the cluster's, or this node alone with every vbucket."""
        if self.cluster_map is not None:
            return self.cluster_map
        me = NodeAddress(self.config.node_name, self.config.host, self.port, self.tls_port)
        return ClusterMap.single_node(me, self.config.vbuckets)

    def cluster_config_json(self) -> bytes:
        """GET_CLUSTER_CONFIG's body, and NOT_MY_VBUCKET's (Couchbase's format)."""
        config = self.current_map().couchbase_config(self.bucket.name, self.config.node_name)
        return json.dumps(config).encode()

    def cluster_map_version(self) -> tuple[int, int]:
        """(revEpoch, rev) of the map `cluster_config_json` serves: what clients compare."""
        config = self.current_map().couchbase_config(self.bucket.name, self.config.node_name)
        return int(config.get("revEpoch", 0)), int(config["rev"])  # type: ignore[call-overload]

    def push_cluster_map(self) -> int:
        """Tell every connection that negotiated ClustermapChangeNotification(Brief) about the
        current map (call after changing `cluster_map`). Each connection is sent a map once
        per version: one that fetched or was sent this version or a newer one is skipped.

        Returns:
            How many connections it was sent to.
        """
        if not self.map_subscribers:
            return 0
        version = self.cluster_map_version()
        config = self.cluster_config_json()
        return sum(s.push_cluster_map(version, config) for s in list(self.map_subscribers))


class StateWaiters(Protocol):
    """The durable writes a state change answers (`SyncWriteMonitor`; the simulator's shell)."""

    def on_state_changed(self, vb: int) -> object: ...

    def waiting_on(self, vb: int) -> int: ...


def change_vbucket_state(
    vbucket: VBucket,
    state: VBucketState,
    *,
    waiters: StateWaiters | None,
    end_streams: Callable[[], object],
    replication: ReplicationTracker | None,
) -> Transition | None:
    """`vbucket.set_state(state)`, then the node's effects of the edge fanned out in this call
    (`ServerContext.set_vbucket_state` is the node's entry; the cluster simulator calls this
    with its own streams): waiters answered AMBIGUOUS, streams ended (`end_streams`), the
    replicas' progress forgotten. Paired asserts check each effect's promise after.

    Returns:
        The edge taken, or None when the vbucket already was in `state`.
    """
    vb = vbucket.vb
    edge = vbucket.set_state(state)
    if edge is None:
        return None
    effects = edge.effects
    if Effect.WAITERS_AMBIGUOUS in effects and waiters is not None:
        waiters.on_state_changed(vb)
    if Effect.STREAMS_ENDED in effects:
        end_streams()
    if Effect.REPLICA_PROGRESS_FORGOTTEN in effects and replication is not None:
        replication.forget(vb)
    if state.is_active and replication is not None:
        replication.activated(vb)  # its replicas are connecting: CONNECT_GRACE_S
    # Paired with the effects above: what each one promises is now true.
    assert vbucket.state is state, (vb, state)
    assert Effect.WAITERS_AMBIGUOUS not in effects or (
        waiters is None or not waiters.waiting_on(vb)
    ), vb
    assert Effect.REPLICA_PROGRESS_FORGOTTEN not in effects or (
        replication is None or not replication.in_sync_set(vb)
    ), vb
    return edge
