"""The orchestrator candidate of each simulated node: `cluster.orchestrator.Orchestrator`'s
election and failover steps on simulated time, deciding with the production functions.

- Campaign: a leadership lease of its own (TTL `lease_ttl_s`, kept alive every TTL/3, lost
  by the same rule as a membership) and a transaction that creates the leader key only if it
  does not exist; the key's create revision is the fencing token.
- Lead: every `STEP_INTERVAL_S` (the live-node watch, as a poll) read the map, the leader
  key, the live nodes, the in-sync records and the statuses in one read; with no map and the
  expected nodes live, write `placement.initial_map`; else, as `Orchestrator._fail_over`,
  hold absent nodes while a minority is live or in the first TTL of the term, and ask
  `cluster.failover.plan_failover` (looked up through its module, so a test can replace it)
  for the next map. A map is written by a transaction comparing the map's mod revision and
  the leader key's create revision: a deposed orchestrator cannot write.

Under the fencing rules (fae8c28), also: a map is written only while every node it was planned
without is still unregistered (a failover must not land once the failed node is back and may
serve) and while each promoted vbucket's in-sync record is still the one the plan read
(`Orchestrator._in_sync_guard`, 33652d9); members registered again since their record are
not promoted from it (`cluster.rules.promotable_members`), and a promoted node's registration
must not change before the map lands (`Orchestrator._registration_guard`); and crashes
confirmed by refused connections (`cluster.rules.CrashConfirmer`, probes every
`CRASH_PROBE_INTERVAL_S`: the leader probes every node, a standby the leader) revoke the
node's leases, so its failover runs without waiting out the lease. A probe is refused only
when the target is down and the prober's packets reach its host: a partition or a pause
gives a timeout, which proves nothing.

Under the rules that judge activations: every map is written with its activations
(`cluster.metadata.activations_of`, in the same transaction, comparing the registrations the
new ones were judged by), and the per-vbucket failover requests of nodes that refused a
vbucket are answered: the vbucket's active counts as failed for it (`plan_failover`'s
`refusals`), and the request is deleted in the transaction of the map that moves it (or at
once when the map no longer makes that node its active).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from changefeed.cluster import failover as cluster_failover
from changefeed.cluster import metadata as cluster_metadata
from changefeed.cluster import placement
from changefeed.cluster import rules as cluster_rules
from changefeed.vbmap import ClusterMap, NodeAddress

from . import keys

if TYPE_CHECKING:
    from .node import SimNode

STEP_INTERVAL_S = 0.25
# A node registered after its vbucket's in-sync record was promoted from it: it may have
# restarted and lost what it acknowledged from memory (docs/simulator.md, seed 8805).
PROMOTED_AFTER_RESTART = "promoted_after_restart"


class Candidate:
    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.meta = node.cluster.meta
        self.ttl_s = node.config.lease_ttl_s
        self.lease = 0
        self.lease_ok_sent_at = float("-inf")
        self.token = 0
        self.term_started = 0.0
        self.campaigning = False
        self.maps_written = 0
        self.crashes = cluster_rules.CrashConfirmer()
        self.confirmed_crashed: set[str] = set()
        self.last_map: ClusterMap | None = None
        self.live: set[str] = set()
        self.in_sync_guard: dict[int, int] = {}  # the records a failover map was planned from
        self.registration_guard: dict[str, int] = {}  # the promoted nodes' registrations
        self.answered: set[int] = set()  # per-vbucket requests the next map answers
        self.reinstated: dict[int, Any] = {}  # `Orchestrator._reinstated`

    @property
    def leading(self) -> bool:
        return self.token != 0

    def start(self) -> None:
        self.node.timer(STEP_INTERVAL_S, self._step)
        self.node.timer(self.ttl_s / 3, self._keep_alive)
        if self.node.rules.fencing:
            self.node.timer(cluster_rules.CRASH_PROBE_INTERVAL_S, self._probe_round)

    def _call(self, op: str, args: tuple[Any, ...], reply: Any = None) -> None:
        self.meta.call(self.node.name, op, args, None if reply is None else self.node.bound(reply))

    # -- leadership -----------------------------------------------------------------------------

    def _keep_alive(self) -> None:
        self.node.timer(self.ttl_s / 3, self._keep_alive)
        if not self.lease:
            return
        if self.node.sched.now - self.lease_ok_sent_at > self.ttl_s:
            self._resign("no keep-alive for a whole TTL")
            return
        sent_at, lease = self.node.sched.now, self.lease
        self._call("keep_alive", (lease,), lambda ttl: self._kept(lease, ttl, sent_at))

    def _kept(self, lease: int, ttl: int, sent_at: float) -> None:
        if lease != self.lease:
            return
        if ttl <= 0:
            self._resign("leadership lease unknown")
            return
        self.lease_ok_sent_at = max(self.lease_ok_sent_at, sent_at)

    def _resign(self, reason: str) -> None:
        if self.token:
            self.node.sched.record("resign", self.node.name, reason)
        self.token = 0
        self.lease = 0
        self.campaigning = False

    def _campaign(self) -> None:
        self.campaigning = True
        sent_at = self.node.sched.now
        self._call("grant", (self.ttl_s,), lambda lease: self._granted(lease, sent_at))

    def _granted(self, lease: int, sent_at: float) -> None:
        self.lease = lease
        self.lease_ok_sent_at = sent_at
        compares = [("create", keys.LEADER, 0)]
        put = ("put", keys.LEADER, self.node.name, lease)
        self._call("txn", (compares, [put], []), lambda result: self._elected(lease, result))

    def _elected(self, lease: int, result: tuple[bool, int | None]) -> None:
        self.campaigning = False
        succeeded, revision = result
        if lease != self.lease:
            return
        if not succeeded or revision is None:
            self._call("revoke", (lease,))
            self.lease = 0
            return
        self.token = revision
        self.term_started = self.node.sched.now
        self.node.sched.record("elected", self.node.name, revision)

    # -- acting ---------------------------------------------------------------------------------

    def _step(self) -> None:
        self.node.timer(STEP_INTERVAL_S, self._step)
        if not self.token:
            if not self.campaigning:
                self._call("get", (keys.LEADER,), self._leader_seen)
            return
        reads = (
            (keys.MAP, keys.LEADER, keys.ACTIVATIONS),
            (keys.NODES, keys.IN_SYNC, keys.STATUS, keys.VB_FAILOVER),
        )
        token = self.token
        self._call("read_many", reads, lambda found: self._decide(token, found))

    def _leader_seen(self, found: Any) -> None:
        if found is None and not self.token and not self.campaigning:
            self._campaign()

    def _decide(self, token: int, found: dict[str, Any]) -> None:
        if token != self.token:
            return
        leader = found[keys.LEADER]
        if leader is None or leader.create_revision != token:
            self._resign("leader key gone or taken")
            return
        live = sorted(found[keys.NODES].keys())
        live_names = {k[len(keys.NODES) :] for k in live}
        self.live = live_names
        stored = found[keys.MAP]
        if stored is None:
            config = self.node.config
            if len(live_names) < config.nodes:
                return
            addresses = [NodeAddress(n, "sim", 0) for n in sorted(live_names)]
            new = placement.initial_map(addresses, config.replicas, config.vbuckets, rev=1)
            self._write(new, 0, token, found=found)
            return
        self.last_map = stored.value
        self.in_sync_guard = {}
        self.registration_guard = {}
        self.answered = set()
        self.reinstated = {}
        new = self._fail_over(stored.value, live_names, found)
        if new is not None:
            absent = [n.name for n in stored.value.nodes if n.name not in live_names]
            self._write(new, stored.mod_revision, token, absent, found)

    def _fail_over(
        self, current: ClusterMap, live: set[str], found: dict[str, Any]
    ) -> ClusterMap | None:
        names = [n.name for n in current.nodes]
        hold: set[str] = set()
        if any(n not in live for n in names) and not self._may_fail_over(names, live):
            hold = {n for n in names if n not in live}
        gone = any(
            c[0] == -1 or (names[c[0]] not in live and names[c[0]] not in hold)
            for c in current.chains
        )
        unplaced = any(
            -1 in chain and any(n in live and names.index(n) not in chain for n in names)
            for chain in current.chains
        )
        refusals = self._refusals(current, found)
        if not (gone or unplaced or refusals):
            return None
        # A registration's revision is the node key's mod revision (`ClusterMetadata
        # .registrations`): a restart within the old lease puts over the key, which keeps its
        # create revision.
        registered = {k[len(keys.NODES) :]: v.mod_revision for k, v in found[keys.NODES].items()}
        in_sync = {
            int(k[len(keys.IN_SYNC) :]): cluster_failover.InSyncRecord(
                v.value[0],
                self.node.rules.in_sync_members(frozenset(v.value[1]), v.mod_revision, registered),
            )
            for k, v in found[keys.IN_SYNC].items()
        }
        highs = {
            k[len(keys.STATUS) :]: {int(vb): int(h) for vb, h in v.value.get("high", {}).items()}
            for k, v in found[keys.STATUS].items()
        }
        plan = self.node.rules.plan_failover(current, live, in_sync, highs, hold, refusals)
        self.answered = {vb for vb in plan.promoted if vb in refusals}
        # `Orchestrator._in_sync_guard`: the map is written only while each promoted vbucket's
        # record is still the one read (its active may be dropping the promoted replica).
        records = found[keys.IN_SYNC]
        self.in_sync_guard = {
            vb: records[keys.in_sync(vb)].mod_revision if keys.in_sync(vb) in records else 0
            for vb in plan.promoted
        }
        self.reinstated = {  # judged on the record's revision: the node's disk decides
            vb: cluster_metadata.Activation(node, self.in_sync_guard[vb])
            for vb, node in plan.reinstated.items()
        }
        if self.node.rules.registration_aware:  # `Orchestrator._registration_guard`
            self.registration_guard = {
                to: registered[to] for to in plan.promoted.values() if to in registered
            }
        for vb, to in sorted(plan.promoted.items()):
            self.node.sched.record("promote", vb, to)
            if vb not in plan.reinstated and registered.get(to, 0) > self.in_sync_guard[vb]:
                self.node.cluster.note(PROMOTED_AFTER_RESTART)
        return plan.new_map

    def _refusals(self, current: ClusterMap, found: dict[str, Any]) -> dict[int, str]:
        """`Orchestrator._refusals`: the requests to answer; stale ones deleted if still the
        ones read and this term still leads."""
        pending: dict[int, str] = {}
        if not self.node.rules.refuses_stale_activation:
            return pending
        for key, kv in sorted(found[keys.VB_FAILOVER].items()):
            vb, node = int(key[len(keys.VB_FAILOVER) :]), kv.value["node"]
            active = current.active(vb) if vb < current.vbuckets else None
            if active is not None and active.name == node:
                pending[vb] = node
            else:
                compares = [("mod", key, kv.mod_revision), ("create", keys.LEADER, self.token)]
                self._call("txn", (compares, [("delete", key)], []))
        return pending

    def _may_fail_over(self, names: list[str], live: set[str]) -> bool:
        up = sum(1 for n in names if n in live)
        if up * 2 <= len(names):
            return False
        if self.node.rules.fencing and all(n in live or n in self.confirmed_crashed for n in names):
            return True  # the only absent nodes crashed for sure: no one to wait for
        return self.node.sched.now - self.term_started >= self.ttl_s

    def _write(
        self,
        new: ClusterMap,
        map_revision: int,
        token: int,
        absent: list[str] | None = None,
        found: dict[str, Any] | None = None,
    ) -> None:
        compares = [("mod", keys.MAP, map_revision), ("create", keys.LEADER, token)]
        puts: list[tuple[Any, ...]] = [("put", keys.MAP, new, 0)]
        guard = dict(self.registration_guard)
        if self.node.rules.refuses_stale_activation and found is not None:
            # `ClusterMetadata.write_map`: the activations with the map, exact by compare.
            stored_map, stored = found[keys.MAP], found[keys.ACTIVATIONS]
            before = (
                cluster_metadata.StoredMap(
                    stored_map.value, stored_map.mod_revision, stored.value if stored else {}
                )
                if stored_map is not None
                else None
            )
            registered = {
                k[len(keys.NODES) :]: v.mod_revision for k, v in found[keys.NODES].items()
            }
            activations, judged = cluster_metadata.activations_of(new, before, registered)
            activations.update(self.reinstated)
            guard = {**judged, **guard}
            puts.append(("put", keys.ACTIVATIONS, activations, 0))
            puts += [("delete", keys.vb_failover(vb)) for vb in sorted(self.answered)]
        if self.node.rules.fencing:
            compares += [("create", keys.node(n), 0) for n in sorted(absent or ())]
            compares += [
                ("mod", keys.in_sync(vb), r) for vb, r in sorted(self.in_sync_guard.items())
            ]
            compares += [("mod", keys.node(n), r) for n, r in sorted(guard.items())]
        self._call("txn", (compares, puts, []), self._written)

    def _written(self, result: tuple[bool, int | None]) -> None:
        if result[0]:
            self.maps_written += 1
            self.node.sched.record("map-written", self.node.name, self.maps_written)

    # -- confirmed crashes (fencing rules) ------------------------------------------------------

    def _probe_round(self) -> None:
        """`Orchestrator._probe_nodes` while leading, `_probe_leader` while standing by."""
        self.node.timer(cluster_rules.CRASH_PROBE_INTERVAL_S, self._probe_round)
        if self.token:
            self.confirmed_crashed -= self.live  # registered again: alive after all
            known = {n.name for n in self.last_map.nodes} if self.last_map else set()
            for name in sorted(known | self.live):
                if name == self.node.name or (
                    name in self.confirmed_crashed and name not in self.live
                ):
                    continue
                self._probe(name)
        else:
            self._call("get", (keys.LEADER,), self._probe_leader)

    def _probe_leader(self, found: Any) -> None:
        if found is not None and found.value != self.node.name:
            self._probe(found.value)

    def _probe(self, name: str) -> None:
        """Read the node's leases, then try to connect (`Orchestrator._probe`); a confirmed
        crash revokes the leases read. A probe that would be answered (the node is up, or
        cannot be reached: a timeout) only resets the confirmer, so it is decided at once
        without the reads that would not be used."""
        if not self._refused(name):
            self.crashes.observe(name, refused=False, now=self.node.sched.now)
            return
        self._call("leases_of", (name,), lambda leases: self._probed(name, leases))

    def _refused(self, name: str) -> bool:
        net, me = self.node.net, self.node.name
        target = self.node.cluster.nodes_by_name.get(name)
        reachable = not (net.is_cut(me, name) or net.is_cut(name, me))
        return reachable and target is not None and not target.up

    def _probed(self, name: str, leases: list[int]) -> None:
        me = self.node.name
        refused = self._refused(name)  # the probe proper, after the leases were read
        if not self.crashes.observe(name, refused=refused, now=self.node.sched.now):
            return
        self.node.sched.record("crash-confirmed", me, name)
        if self.token:
            self.confirmed_crashed.add(name)
        self.crashes.forget(name)
        for lease in leases:
            self._call("revoke", (lease,))
