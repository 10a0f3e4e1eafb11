"""A node's cluster agent in the simulator: `cluster.node_agent.NodeAgent` on simulated time.

As the real agent does today:
- registers with a lease (TTL `lease_ttl_s`) and keeps it alive every TTL/3; the lease is lost
  once no keep-alive succeeded for a whole TTL counted from when the last good one was *sent*
  (cluster/metadata.py `_KeptLease`), or etcd answers it is unknown; then it registers again;
- every `STATUS_INTERVAL_S` publishes its high seqno per vbucket held (when it changed and
  the lease is held), and per vbucket active here its in-sync set (by
  `ReplicationTracker.in_sync_set`, the replicas of the map) when it differs from what it last
  published — remembered for the agent's whole life, as today;
- applies each newer map (`apply`): each copy's state by `cluster.rules.wanted_state`, through
  the node's one state-change entry, then the feeds. A map is read by polling (the watch).

The membership's validity is tracked (`valid_until`: last good keep-alive sent + TTL) for the
rules that fence an active by its lease (rules.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from changefeed.cluster import rules as cluster_rules
from changefeed.vbmap import ClusterMap
from changefeed.vbucket_state import VBucketState

from . import keys

if TYPE_CHECKING:
    from .node import SimNode

STATUS_INTERVAL_S = 0.25  # node_agent.STATUS_INTERVAL_S


class Agent:
    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.meta = node.cluster.meta
        self.ttl_s = node.config.lease_ttl_s
        self.lease = 0
        self.lease_ok_sent_at = float("-inf")
        self.lost = True
        self.registering = False
        self.last_status: dict[str, Any] | None = None
        self.published: dict[int, tuple[str, ...]] = {}
        self.map_seen: ClusterMap | None = None

    @property
    def valid_until(self) -> float:
        """When the membership may have expired at etcd, by this node's clock."""
        return self.lease_ok_sent_at + self.ttl_s

    def start(self) -> None:
        self._register()
        self.node.timer(self.ttl_s / 3, self._keep_alive)
        self.node.timer(STATUS_INTERVAL_S, self._tick)

    def _call(self, op: str, args: tuple[Any, ...], reply: Any = None) -> None:
        self.meta.call(self.node.name, op, args, None if reply is None else self.node.bound(reply))

    # -- membership -----------------------------------------------------------------------------

    def _register(self) -> None:
        if self.registering:
            return
        self.registering = True
        sent_at = self.node.sched.now
        self._call("grant", (self.ttl_s,), lambda lease: self._granted(lease, sent_at))
        self.node.timer(1.0, self._register_timeout)

    def _register_timeout(self) -> None:
        if self.registering and self.lost:
            self.registering = False
            self._register()

    def _granted(self, lease: int, sent_at: float) -> None:
        if not self.registering:
            return
        self.registering = False
        self.lease = lease
        self.lease_ok_sent_at = sent_at
        self.lost = False
        self.last_status = None
        self.node.sched.record("registered", self.node.name, lease)
        self._call("put", (keys.node(self.node.name), self.node.name, lease))

    def _keep_alive(self) -> None:
        self.node.timer(self.ttl_s / 3, self._keep_alive)
        if self.lost:
            if not self.registering:
                self._register()
            return
        if self.node.sched.now - self.lease_ok_sent_at > self.ttl_s:
            self._lose("no keep-alive for a whole TTL")
            return
        sent_at, lease = self.node.sched.now, self.lease
        self._call("keep_alive", (lease,), lambda ttl: self._kept(lease, ttl, sent_at))

    def _kept(self, lease: int, ttl: int, sent_at: float) -> None:
        if lease != self.lease or self.lost:
            return
        if ttl <= 0:
            self._lose("lease unknown to etcd")
            return
        self.lease_ok_sent_at = max(self.lease_ok_sent_at, sent_at)

    def _lose(self, reason: str) -> None:
        self.lost = True
        self.node.sched.record("lease-lost", self.node.name, reason)
        self._register()

    # -- status and maps ------------------------------------------------------------------------

    def _tick(self) -> None:
        self.node.timer(STATUS_INTERVAL_S, self._tick)
        self._publish()
        self._call("get", (keys.MAP,), self._map_read)

    def _publish(self) -> None:
        node = self.node
        held = (VBucketState.ACTIVE, VBucketState.REPLICA, VBucketState.PENDING)
        high = {vb: v.high_seqno for vb, v in sorted(node.vbuckets.items()) if v.state in held}
        status: dict[str, Any] = {"high": high}
        if node.applied is not None:
            status["rev"] = node.applied.rev
        if status != self.last_status and not self.lost:
            self._call("put", (keys.status(node.name), status, self.lease))
            self.last_status = status
        for vb, members in sorted(self.in_sync_sets().items()):
            if self.published.get(vb) != members:
                record = (node.name, members)
                self._call(
                    "put",
                    (keys.in_sync(vb), record, 0),
                    lambda _, vb=vb, members=members: self.published.__setitem__(vb, members),
                )

    def in_sync_sets(self) -> dict[int, tuple[str, ...]]:
        """`NodeAgent._in_sync_sets`: per vbucket active here, its replicas in sync now."""
        node, cluster_map = self.node, self.node.applied
        if cluster_map is None:
            return {}
        found: dict[int, tuple[str, ...]] = {}
        for vb, v in sorted(node.vbuckets.items()):
            if v.state is VBucketState.ACTIVE and cluster_map.role_of(node.name, vb) == 0:
                placed = {n.name for n in cluster_map.replica_nodes(vb)}
                found[vb] = tuple(r for r in node.tracker.in_sync_set(vb) if r in placed)
        return found

    def _map_read(self, found: Any) -> None:
        if found is not None:
            self.apply(found.value)

    def apply(self, cluster_map: ClusterMap) -> None:
        """`NodeAgent.apply`: each copy's state from the map, then the replica feeds."""
        node = self.node
        if node.applied is not None and cluster_map.rev <= node.applied.rev:
            return
        sources: dict[str, set[int]] = {}
        for vb in range(cluster_map.vbuckets):
            wanted = cluster_rules.wanted_state(cluster_map, node.name, vb)
            node.set_vbucket_state(vb, wanted)
            active = cluster_map.active(vb)
            if wanted is VBucketState.REPLICA and active is not None:
                sources.setdefault(active.name, set()).add(vb)
        node.applied = cluster_map
        node.sched.record("applied", node.name, cluster_map.rev)
        node.place_feeds(sources)
