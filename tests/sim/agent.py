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

Under the fencing rules (rules.py `FencedRules`, fae8c28), as the agent does since:
- the node fences itself once `cluster.rules.membership_valid_until` (from the send of the last
  keep-alive etcd answered) has passed: checked before a request or a replica's message is
  served and every `FENCE_POLL_S`; its actives go PENDING (`serving_state`) until a
  keep-alive sent after the fence is answered and the map has been read again;
- per vbucket active here an `InSyncKeeper` decides the record to write (`target`, `begin`,
  `written`, `failed`); the record is written in a transaction fenced by the mod revision of
  the map the node applied, and the keeper's `required` replicas are the ones each commit
  must hear from (durability.py).

Under the rules that judge activations (rules.py `refuses_stale_activation`), as the agent
does since: the map is read with its activations (one read: etcd stores them in the map's
document), and a vbucket the map makes active here on an earlier process's registration is
not taken unless the disk vouches for the copy (`cluster.rules.refuses_activation`,
`holds_branch` judged at start by `copy_holds_its_branch`); it waits as a REPLICA and the
agent asks for its failover (``vbfailover/<vb>``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from changefeed.cluster import rules as cluster_rules
from changefeed.vbmap import ClusterMap
from changefeed.vbucket_state import VBucketState

from . import keys

if TYPE_CHECKING:
    from .node import SimNode

STATUS_INTERVAL_S = 0.25  # node_agent.STATUS_INTERVAL_S
FENCE_POLL_S = 0.05  # node_agent.FENCE_POLL_S
ETCD_CALL_TIMEOUT_S = 1.0  # an etcd call not answered by then failed (outcome unknown)
# A restarted node refused an activation decided on its earlier process (scenario
# `promoted_while_dead`, docs/simulator.md).
DECLINED_ACTIVATION = "declined_activation"


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
        self.applied_revision = 0  # the applied map's mod revision: in-sync records' fence
        self.fenced_at: float | None = None
        self.fences = 0
        self.rereading = False
        self.keepers: dict[int, cluster_rules.InSyncKeeper] = {}
        # `NodeAgent.registrations`: each node's registration revision, and when first seen.
        self.registrations: dict[str, tuple[int, float]] = {}
        self.reconnected: dict[str, int] = {}
        # `NodeAgent`: this process's first registration, what the disk vouches for per
        # vbucket (set by the node at start), the applied map's activations, the refusals.
        self.registration = 0
        self.holds_branch: dict[int, bool] = {}
        self.activations: dict[int, Any] = {}
        self.refused_activations: dict[int, int] = {}  # vb -> the activation refused

    def start(self) -> None:
        self._register()
        self.node.timer(self.ttl_s / 3, self._keep_alive)
        self.node.timer(STATUS_INTERVAL_S, self._tick)
        if self.node.rules.fencing:
            self.node.timer(FENCE_POLL_S, self._watch_fence)

    # -- fencing --------------------------------------------------------------------------------

    @property
    def fenced(self) -> bool:
        return self.fenced_at is not None

    def membership_valid(self) -> bool:
        if self.lost:
            return False
        until = cluster_rules.membership_valid_until(self.lease_ok_sent_at, self.ttl_s)
        return self.node.sched.now < until

    def check_fence(self) -> None:
        """`NodeAgent.check_fence`: fence the actives if the membership may have lapsed."""
        if not self.node.rules.fencing or self.fenced_at is not None or self.membership_valid():
            return
        self.fenced_at = self.node.sched.now
        self.fences += 1
        self.node.sched.record("fenced", self.node.name)
        if self.node.applied is not None:
            self._apply_states(self.node.applied)

    def _watch_fence(self) -> None:
        """`NodeAgent._watch_fence`: fence on time; once renewed, re-read the map and serve.

        It polls every FENCE_POLL_S as the agent does, but skips the polls that cannot find
        anything: while not fenced, none before the first poll at or after the validity's
        end (keep-alives only move it later; each wake-up looks again)."""
        self._next_poll()
        self.check_fence()
        fenced_at = self.fenced_at
        if fenced_at is None or self.rereading or not self.membership_valid():
            return
        if self.lease_ok_sent_at <= fenced_at:
            return  # renewed by a keep-alive sent before the fence: not proof enough
        self.rereading = True
        self.node.timer(ETCD_CALL_TIMEOUT_S, self._reread_timeout)
        if self.node.rules.refuses_stale_activation:
            self._call("read_many", ((keys.MAP, keys.ACTIVATIONS), ()), self._reread)
        else:
            self._call("get", (keys.MAP,), lambda found: self._reread({keys.MAP: found}))

    def _next_poll(self) -> None:
        delay = FENCE_POLL_S
        if self.fenced_at is None and not self.lost:
            until = cluster_rules.membership_valid_until(self.lease_ok_sent_at, self.ttl_s)
            polls = max(1, math.ceil((until - self.node.sched.now) / FENCE_POLL_S))
            delay = polls * FENCE_POLL_S
        self.node.timer(delay, self._watch_fence)

    def _reread_timeout(self) -> None:
        self.rereading = False

    def _reread(self, found: dict[str, Any]) -> None:
        self.rereading = False
        if self.fenced_at is None or not self.membership_valid():
            return
        self.fenced_at = None
        self.node.sched.record("unfenced", self.node.name)
        stored = found[keys.MAP]
        if stored is not None:
            self.apply(stored.value, stored.mod_revision, self._activations(found), force=True)

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
        put = (keys.node(self.node.name), self.node.name, lease)
        if self.node.rules.refuses_stale_activation:
            self._call("put", put, self._put_node)
        else:  # the older rule sets asked for no answer (their seeds replay as recorded)
            self._call("put", put)

    def _own_key_read(self, found: Any) -> None:
        """The registration read back when the put's answer never came (a later one of this
        process, if the lease was lost meanwhile: refusing more, never less); put again when
        the put itself was lost (`ClusterMetadata.register_node` fails and is retried)."""
        if self.registration or self.lost:
            return
        if found is not None and found.lease == self.lease:
            self.registration = found.mod_revision
            return
        put = (keys.node(self.node.name), self.node.name, self.lease)
        self._call("put", put, self._put_node)

    def _put_node(self, revision: int | None) -> None:
        """`ClusterMetadata.register_node`'s put answered: the process's first registration."""
        if revision is not None and not self.registration:
            self.registration = revision

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
        if self.node.rules.refuses_stale_activation:  # the map with its activations
            if not self.registration and not self.lost:  # the put's answer was lost
                self._call("get", (keys.node(self.node.name),), self._own_key_read)
            self._call("read_many", ((keys.MAP, keys.ACTIVATIONS), ()), self._map_read)
        else:
            self._call("get", (keys.MAP,), lambda found: self._map_read({keys.MAP: found}))
        if self.node.rules.registration_aware:  # `NodeAgent._follow_registrations` (a watch)
            self._call("read_many", ((), (keys.NODES,)), self._registrations_read)

    def _registrations_read(self, found: dict[str, Any]) -> None:
        now = self.node.sched.now
        fresh: dict[str, tuple[int, float]] = {}
        for key, kv in found[keys.NODES].items():
            name = key[len(keys.NODES) :]
            known = self.registrations.get(name)
            fresh[name] = (
                known
                if known is not None and known[0] == kv.mod_revision
                else (
                    kv.mod_revision,
                    now,
                )
            )
        self.registrations = fresh

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
        if node.rules.fencing:
            self._ask_failovers()
            self._confirm_in_sync()
            return
        for vb, members in sorted(self.in_sync_sets().items()):
            if self.published.get(vb) != members:
                record = (node.name, members)
                self._call(
                    "put",
                    (keys.in_sync(vb), record, 0),
                    lambda _, vb=vb, members=members: self.published.__setitem__(vb, members),
                )

    def _ask_failovers(self) -> None:
        """`NodeAgent._ask_failovers`: a request per activation refused here, put again each
        round while it is missing (one the orchestrator deleted as stale)."""
        if not self.refused_activations:
            return
        self._call("read_many", ((), (keys.VB_FAILOVER,)), self._requests_read)

    def _requests_read(self, found: dict[str, Any]) -> None:
        name = self.node.name
        for vb in sorted(self.refused_activations):
            kv = found[keys.VB_FAILOVER].get(keys.vb_failover(vb))
            if kv is None or kv.value["node"] != name:
                request = {"node": name, "registration": self.registration}
                self._call("put", (keys.vb_failover(vb), request, 0))

    def _confirm_in_sync(self) -> None:
        """`NodeAgent._confirm_in_sync`: each active vbucket's record through its keeper,
        written only while the map is still the one this node applied."""
        node, cluster_map = self.node, self.node.applied
        if cluster_map is None or self.fenced:
            return
        tracker = node.tracker
        aware = node.rules.registration_aware
        revisions = {name: revision for name, (revision, _) in self.registrations.items()}
        for vb, keeper in sorted(self.keepers.items()):
            placed = {n.name for n in cluster_map.replica_nodes(vb)}
            high = node.vbuckets[vb].high_seqno
            in_sync, caught_up = cluster_rules.record_candidates(tracker, vb, placed, high)
            reregistered: frozenset[str] = frozenset()
            if aware:
                self._reconnect_stale(vb, in_sync)
                caught_up = frozenset(r for r in caught_up if self._since_registered(vb, r))
                reregistered = keeper.registered_since(revisions)
            members = keeper.target(in_sync, caught_up, reregistered)
            if members is None:
                continue
            keeper.begin(members)
            record = (node.name, tuple(sorted(members)), self.applied_revision)
            compares = [("mod", keys.MAP, self.applied_revision)]
            put = ("put", keys.in_sync(vb), record, 0)
            self._call(
                "txn",
                (compares, [put], []),
                lambda result, vb=vb, keeper=keeper, members=members: self._in_sync_written(
                    vb, keeper, members, result[0], result[1] or 0
                ),
            )
            node.timer(ETCD_CALL_TIMEOUT_S, self._in_sync_timeout, keeper, members)

    def _since_registered(self, vb: int, replica: str) -> bool:
        """`NodeAgent._streams_since_registered`."""
        seen = self.registrations.get(replica)
        return seen is not None and self.node.tracker.progress(vb, replica).opened_s >= seen[1]

    def _reconnect_stale(self, vb: int, in_sync: frozenset[str]) -> None:
        """`NodeAgent._reconnect_stale`: close an in-sync replica's connections here once per
        registration when its stream opened before the registration was seen."""
        node = self.node
        for replica in sorted(in_sync):
            seen = self.registrations.get(replica)
            if seen is None or self.reconnected.get(replica) == seen[0]:
                continue
            progress = node.tracker.progress(vb, replica)
            if not progress.connected or progress.opened_s >= seen[1]:
                continue
            self.reconnected[replica] = seen[0]
            node.sched.record("reconnect", node.name, replica, seen[0])
            node.disconnect_replica(replica)

    def _in_sync_written(
        self,
        vb: int,
        keeper: cluster_rules.InSyncKeeper,
        members: frozenset[str],
        ok: bool,
        revision: int,
    ) -> None:
        if keeper.writing != members:
            return  # timed out already: its outcome stayed unknown (failed)
        if self.keepers.get(vb) is not keeper:
            return
        if not ok:
            keeper.failed()
            return
        keeper.written(members, revision)
        self.node.sched.record("in-sync", self.node.name, vb, tuple(sorted(members)))
        self.node.durability.on_progress(vb)

    def _in_sync_timeout(self, keeper: cluster_rules.InSyncKeeper, members: frozenset[str]) -> None:
        if keeper.writing == members:
            keeper.failed()

    def in_sync_sets(self) -> dict[int, tuple[str, ...]]:
        """`NodeAgent._in_sync_sets`: per vbucket active here, its replicas in sync now."""
        node, cluster_map = self.node, self.node.applied
        if cluster_map is None:
            return {}
        found: dict[int, tuple[str, ...]] = {}
        for vb, v in sorted(node.vbuckets.items()):
            if v.state.is_active and cluster_map.role_of(node.name, vb) == 0:
                placed = {n.name for n in cluster_map.replica_nodes(vb)}
                found[vb] = tuple(r for r in node.tracker.in_sync_set(vb) if r in placed)
        return found

    def _map_read(self, found: dict[str, Any]) -> None:
        stored = found[keys.MAP]
        if stored is None:
            return
        if self.node.rules.refuses_stale_activation and not self.registration:
            return  # `NodeAgent.start` registers before it watches the map
        self.apply(stored.value, stored.mod_revision, self._activations(found))

    @staticmethod
    def _activations(found: dict[str, Any]) -> dict[int, Any]:
        stored = found.get(keys.ACTIVATIONS)
        return dict(stored.value) if stored is not None else {}

    def apply(
        self,
        cluster_map: ClusterMap,
        revision: int = 0,
        activations: dict[int, Any] | None = None,
        *,
        force: bool = False,
    ) -> None:
        """`NodeAgent.apply`: each copy's state from the map, then the replica feeds."""
        node = self.node
        if node.applied is not None and cluster_map.rev <= node.applied.rev and not force:
            return
        node.applied = cluster_map
        self.applied_revision = max(revision, self.applied_revision)
        self.activations = dict(activations or {})
        self._apply_states(cluster_map)
        sources: dict[str, set[int]] = {}
        for vb in range(cluster_map.vbuckets):
            active = cluster_map.active(vb)
            wanted = cluster_rules.wanted_state(cluster_map, node.name, vb)
            if wanted.is_replica and active is not None:
                sources.setdefault(active.name, set()).add(vb)
        node.sched.record("applied", node.name, cluster_map.rev)
        node.place_feeds(sources)

    def _apply_states(self, cluster_map: ClusterMap) -> None:
        """`NodeAgent._apply_states`: every copy's state through the node's one entry (a fenced
        node's actives PENDING), and a keeper per vbucket active here."""
        node = self.node
        fencing = node.rules.fencing
        for vb in range(cluster_map.vbuckets):
            wanted = cluster_rules.wanted_state(cluster_map, node.name, vb)
            state = cluster_rules.serving_state(wanted, fenced=self.fenced) if fencing else wanted
            if node.rules.refuses_stale_activation:
                leads = cluster_map.role_of(node.name, vb) == 0
                if leads and self._refuses(vb):
                    state = VBucketState.REPLICA  # waits, fed by no one, for the next decision
                elif not leads:
                    self.refused_activations.pop(vb, None)
            node.set_vbucket_state(vb, state)
            if not fencing:
                continue
            if state.is_active:
                if vb not in self.keepers:
                    placed = frozenset(n.name for n in cluster_map.replica_nodes(vb))
                    self.keepers[vb] = cluster_rules.InSyncKeeper(placed)
            else:
                self.keepers.pop(vb, None)

    def _refuses(self, vb: int) -> bool:
        """`NodeAgent._refuses`: whether this process refuses to be `vb`'s active."""
        activation = self.activations.get(vb)
        name = self.node.name
        judged = activation.registration if activation and activation.node == name else None
        decided = judged if judged is not None else self.applied_revision
        if self.refused_activations.get(vb) == decided:
            return True
        if not cluster_rules.refuses_activation(
            judged,
            self.applied_revision,
            self.registration,
            holds_branch=self.holds_branch.get(vb, False),
        ):
            self.refused_activations.pop(vb, None)
            return False
        self.refused_activations[vb] = decided
        self.node.sched.record("declined", name, vb, judged, self.registration)
        self.node.cluster.note(DECLINED_ACTIVATION)
        return True
