"""A node's membership of a cluster: it registers, stands for orchestrator, and follows the map.

The agent is the only place where the cluster map turns into node state. For every map revision
it sees (etcd watch), it:
- sets each vbucket's state from the node's place in the vbucket's chain: first → ACTIVE (a new
  failover branch when promoted), later → REPLICA, absent → DEAD; a vbucket that stops being
  active here ends its DCP streams with STATE_CHANGED, so consumers re-request where the map
  now points;
- follows a rebalance's moves (``ClusterMap.moves``, rebalance.py): a node in a move's chain
  that holds no copy yet is a REPLICA fed by the active (the copy being built); the active of
  a move in takeover goes PENDING — writes are refused (NOT_MY_VBUCKET) but its streams are
  *not* ended, so the new copies receive everything it acknowledged; the streams end when the
  map moves the vbucket away (PENDING → REPLICA or DEAD). The active publishes, per moving
  vbucket, its state, high seqno and its replicas' acked seqnos, with the map revision applied,
  which is what the orchestrator waits on before each step;
- stops the node when a map no longer lists it after one did (``changefeed cluster remove``:
  everything has moved off it);
- runs one `ReplicaFeed` per active node it replicates from, restarting a feed only when its
  set of vbuckets or its source changed (a running catch-up is not disturbed by unrelated
  map changes);
- publishes the map to the node's `ServerContext` (GET_CLUSTER_CONFIG, NOT_MY_VBUCKET bodies);
- refuses to become the active of a vbucket whose activation (stored with the map) was
  decided on an earlier process of this node, unless its disk vouches for the copy
  (`rules.refuses_activation`): the copy waits as a REPLICA and the agent asks for that
  vbucket's failover (``vbfailover/<vb>``), so the orchestrator promotes another member.

A map older than one applied already is ignored (revisions only move forward).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Iterator

from changefeed.cluster.manifest_store import ClusterManifest
from changefeed.cluster.metadata import Activation, ClusterMetadata, EtcdTls, Membership
from changefeed.cluster.orchestrator import Orchestrator
from changefeed.cluster.replica_stream import FeedOptions, ReplicaFeed
from changefeed.cluster.rules import (
    InSyncKeeper,
    copy_holds_its_branch,
    membership_valid_until,
    record_candidates,
    recovered_state,
    refuses_activation,
    serving_state,
    wanted_state,
)
from changefeed.server.config import NodeConfig
from changefeed.server.node import Node
from changefeed.vbmap import ClusterMap, NodeAddress
from changefeed.vbucket_state import VBucketState

log = logging.getLogger("changefeed.cluster")

REPLICATION_USER = "Administrator"
STOP_WAIT_S = 5.0
STATUS_INTERVAL_S = 0.25
FENCE_POLL_S = 0.05  # a fence is noticed this late at worst when no request arrives


def replication_password() -> str:
    """The password replicas authenticate with at their actives: every node of a cluster has
    the user (created from ``CHANGEFEED_PASSWORD`` on first start, see server/node.py)."""
    return os.environ.get("CHANGEFEED_PASSWORD", "password")


def etcd_tls(config: NodeConfig) -> EtcdTls | None:
    """What the node presents to an https etcd: its own certificate and key, the cluster CA
    trusted (config checked they are all given); None for a plain-http etcd."""
    if not config.etcd.lstrip().startswith("https://"):
        return None
    assert config.tls_ca and config.tls_cert and config.tls_key, "NodeConfig.validate checks"
    return EtcdTls(config.tls_ca, config.tls_cert, config.tls_key)


class NodeAgent:
    """Joins `node` to the cluster its config names; a `Companion` of `Node.run`."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.config = node.config
        self.metadata: ClusterMetadata | None = None
        self.membership: Membership | None = None
        self.applied: ClusterMap | None = None
        self.applied_revision = 0  # etcd mod revision of the applied map: in-sync records' fence
        self.activations: dict[int, Activation] = {}  # stored with the applied map
        self.registration = 0  # etcd revision of this process's first registration
        # Vbuckets refused here -> the activation refused (the registration it was decided on:
        # rules.refuses_activation's); a later map's activation is judged afresh.
        self.refused_activations: dict[int, int] = {}
        self._swept = False  # requests left by an earlier process of this node deleted
        self.fenced_at: float | None = None  # monotonic time the membership went invalid
        self.fences = 0  # times this node fenced itself (STAT, tests)
        self.removed = False  # the map no longer lists this node: it leaves the cluster
        self.keepers: dict[int, InSyncKeeper] = {}  # per vbucket active here
        # Each registered node's registration (etcd revision) and when this agent first saw
        # it: a replica counts as caught up only on a stream it opened after that (a stream
        # opened before may be its previous process's, which held what the new one lost).
        self.registrations: dict[str, tuple[int, float]] = {}
        self._reconnected: dict[str, int] = {}  # replica -> registration it was made to reconnect
        self.feeds: dict[str, tuple[ReplicaFeed, asyncio.Task[None]]] = {}
        # Before the node listens: nothing recovered from disk acts as active until a map
        # (read after registering) says so, and the fence is checked from the first request.
        context = node.context
        clean = context.bucket.store.was_clean_shutdown
        # What each recovered copy's disk vouches for (rules.copy_holds_its_branch), judged
        # before anything changes its state.
        self.holds_branch = {
            vb: copy_holds_its_branch(v.state, clean, bool(v.failover_log.dropped_above))
            for vb, v in context.bucket.vbuckets.items()
        }
        for vb, vbucket in sorted(context.bucket.vbuckets.items()):
            recovered = recovered_state(vbucket.state, holds_branch=self.holds_branch[vb])
            context.set_vbucket_state(vb, recovered)
        context.fence_check = self.check_fence
        self._tasks: list[asyncio.Task[None]] = []
        self.map_applied = asyncio.Event()

    @property
    def me(self) -> NodeAddress:
        return NodeAddress(
            self.config.node_name, self.config.host, self.node.port, self.node.tls_port
        )

    async def start(self) -> None:
        """Connect to etcd, register, and start the orchestrator candidate and the map watch.

        Raises:
            MetadataUnavailableError: etcd did not answer (the node does not serve without it).
        """
        cfg = self.config
        self.metadata = await ClusterMetadata.connect(cfg.etcd, cfg.cluster, tls=etcd_tls(cfg))
        self.membership = await self.metadata.register_node(self.me, cfg.failover_timeout_s)
        self.registration = self.membership.registration
        orchestrator = Orchestrator(
            self.metadata,
            cfg.node_name,
            vbuckets=cfg.vbuckets,
            replicas=cfg.replicas,
            expected_nodes=cfg.expected_nodes,
            lease_ttl_s=cfg.failover_timeout_s,
            crash_failover=cfg.crash_failover,
        )
        context = self.node.context
        context.stat_providers["replica-feeds"] = self.feed_stats
        if context.sync_writes is not None:
            context.sync_writes.required_of = self.required_replicas
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(orchestrator.run(), name="orchestrator"),
            loop.create_task(self._follow_maps(), name="map-watch"),
            loop.create_task(self._follow_registrations(), name="registrations"),
            loop.create_task(self._publish(), name="status"),
            loop.create_task(self._keep_membership(), name="membership"),
            loop.create_task(self._watch_fence(), name="fence"),
        ]
        # The collections manifest lives in etcd; this node applies it (issue 28).
        self.manifest = ClusterManifest(self.metadata, context.manifests, cfg.node_name)
        self._tasks.append(loop.create_task(self.manifest.follow(), name="manifest-watch"))

    # -- fencing --------------------------------------------------------------------------------

    @property
    def fenced(self) -> bool:
        return self.fenced_at is not None

    def membership_valid(self) -> bool:
        """Whether this node may act as active now (`rules.membership_valid_until`)."""
        membership = self.membership
        if membership is None or membership.lost.is_set():
            return False
        until = membership_valid_until(membership.renewal_sent_s, self.config.failover_timeout_s)
        return time.monotonic() < until

    def check_fence(self) -> None:
        """Fence this node's actives if its membership may have lapsed. Called before a
        connection serves anything it received (so a node resumed from a pause checks before
        it acts) and every FENCE_POLL_S."""
        if self.fenced_at is not None or self.membership is None or self.membership_valid():
            return
        self.fenced_at = time.monotonic()
        self.fences += 1
        fenced = self._apply_states(self.applied) if self.applied is not None else 0
        log.warning(
            "membership not renewed in time: fenced %d active vbuckets (writes refused until "
            "the lease is renewed and the map re-read)",
            fenced,
        )

    async def _watch_fence(self) -> None:
        """Fence on time; after a fence, once the membership is renewed, read the map afresh
        and serve by it again (a map that failed this node over meanwhile is applied as is)."""
        assert self.metadata is not None
        while True:  # ended by cancellation
            await asyncio.sleep(FENCE_POLL_S)
            self.check_fence()
            fenced_at = self.fenced_at
            membership = self.membership
            if fenced_at is None or membership is None or not self.membership_valid():
                continue
            if membership.renewal_sent_s <= fenced_at:
                continue  # renewed by a keep-alive sent before the fence: not proof enough
            try:
                stored = await self.metadata.read_map_activations()
            except (ConnectionError, ValueError) as error:
                log.warning("re-reading the map after a fence: %s", error)
                continue
            if not self.membership_valid():
                continue
            self.fenced_at = None
            log.warning("membership renewed: serving by the map again")
            if stored is not None:
                self.apply(stored.map, stored.revision, stored.activations, force=True)

    def required_replicas(self, vb: int) -> frozenset[str]:
        """The replicas every commit on `vb` must hear from (its InSyncKeeper)."""
        keeper = self.keepers.get(vb)
        return keeper.required if keeper is not None else frozenset()

    def feed_stats(self) -> Iterator[tuple[str, str]]:
        """STAT replica-feeds: per active this node replicates from, what its feed did."""
        for source, (feed, _) in sorted(self.feeds.items()):
            for counter, value in dataclasses.asdict(feed.stats).items():
                yield f"{source}:{counter}", str(value)
            yield f"{source}:vbuckets", ",".join(map(str, sorted(feed.vbuckets)))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for _, task in self.feeds.values():
            task.cancel()
        tasks = [*self._tasks, *(t for _, t in self.feeds.values())]
        if tasks:  # bounded: a task stuck in an etcd call must not hold the shutdown
            _, stuck = await asyncio.wait(tasks, timeout=STOP_WAIT_S)
            for task in stuck:
                log.warning("cluster task %s did not stop in %g s", task.get_name(), STOP_WAIT_S)
        self.feeds.clear()
        try:
            async with asyncio.timeout(STOP_WAIT_S):
                if self.membership is not None:
                    # Not revoked, unless the map no longer lists this node (removed: it
                    # leaves now): the lease runs out by itself, so a restart within the
                    # failover timeout finds the map unchanged (with --no-crash-failover).
                    await self.membership.close(revoke=self.removed)
                if self.metadata is not None:
                    await self.metadata.close()
        except (TimeoutError, ConnectionError) as error:
            log.warning("leaving the cluster: %s (the lease expires by itself)", error or "timeout")

    async def _follow_maps(self) -> None:
        assert self.metadata is not None
        while True:  # the watch; restarted after an etcd hiccup, ended by cancellation
            try:
                async for stored in self.metadata.watch_map_activations():
                    self.apply(stored.map, stored.revision, stored.activations)
            except (ConnectionError, TimeoutError) as error:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from error  # stopping: the client gave up
                log.warning("map watch interrupted: %s; watching again", error)
                await asyncio.sleep(0.5)

    async def _follow_registrations(self) -> None:
        """Keep `registrations` current: the etcd revision of each node's registration, and
        when this agent first saw it (rules.promotable_members)."""
        assert self.metadata is not None
        async for found in self.metadata.watch_registrations():  # never ends; retries itself
            now = self.node.context.monotonic()  # the replication tracker's clock
            self.registrations = {
                name: known
                if (known := self.registrations.get(name)) is not None and known[0] == revision
                else (revision, now)
                for name, revision in found.items()
            }

    async def _keep_membership(self) -> None:
        """Register again whenever the lease is lost (etcd unreachable, the loop stalled past
        the TTL): a node that is up must not stay out of the cluster — the orchestrator would
        have failed it over, and it rejoins as a replica."""
        assert self.metadata is not None
        backoff = 0.1
        while True:  # ended by cancellation
            membership = self.membership
            assert membership is not None
            await membership.lost.wait()
            log.error("cluster membership lost; registering again")
            try:
                self.membership = await self.metadata.register_node(
                    self.me, self.config.failover_timeout_s
                )
                backoff = 0.1
            except (ConnectionError, TimeoutError) as error:
                log.warning("registering again failed: %s; retrying in %.1f s", error, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    async def _publish(self) -> None:
        """Every STATUS_INTERVAL_S: this node's high seqno per vbucket it holds (the
        orchestrator promotes the in-sync replica with the highest), and, for each vbucket
        active here, its in-sync set when it changed (kept in etcd past this node's death)."""
        assert self.metadata is not None
        last_status: dict[str, object] = {}
        membership = self.membership
        while True:  # ended by cancellation
            await asyncio.sleep(STATUS_INTERVAL_S)
            try:
                status = self._status()
                if self.membership is not membership:  # registered again: publish afresh
                    membership, last_status = self.membership, {}
                if (
                    membership is not None
                    and status != last_status
                    and not membership.lost.is_set()
                ):
                    await membership.put_status(status)
                    last_status = status
                await self._ask_failovers()
                await self._confirm_in_sync()
            except ConnectionError as error:
                log.warning("publishing status: %s", error)

    async def _ask_failovers(self) -> None:
        """Keep a failover request in etcd for each vbucket refused here, every round (the
        orchestrator deletes one it finds stale, which a later map may make current again),
        and delete this node's requests for vbuckets it does not refuse (a later map's
        activation was decided on this process, or an earlier process of it asked): the
        orchestrator would fail such a vbucket over. An answered request is deleted by the
        map that answers it."""
        assert self.metadata is not None
        if not self.refused_activations and self._swept:
            return
        name = self.config.node_name
        stored = await self.metadata.stored_vbucket_failover_requests()
        for vb, request in sorted(stored.items()):
            if request.node == name and vb not in self.refused_activations:
                await self.metadata.clear_vbucket_failover_request(vb, request.revision)
        for vb in sorted(self.refused_activations):
            asked = stored.get(vb)
            if asked is None or asked.node != name:
                await self.metadata.request_vbucket_failover(vb, name, self.registration)
        # Swept once with nothing refused: later rounds read only while something is.
        self._swept = not self.refused_activations

    async def _confirm_in_sync(self) -> None:
        """Write each active vbucket's in-sync record where it changed, through its keeper
        (rules.InSyncKeeper: newcomers required before the write, leavers released after),
        fenced by the applied map's revision: a node failed over meanwhile writes nothing."""
        assert self.metadata is not None
        tracker = self.node.context.replication
        cluster_map = self.applied
        if tracker is None or cluster_map is None or self.fenced:
            return
        bucket = self.node.context.bucket
        revisions = {name: revision for name, (revision, _) in self.registrations.items()}
        for vb, keeper in list(self.keepers.items()):
            placed = {n.name for n in cluster_map.replica_nodes(vb)}
            high = bucket.vbucket(vb).high_seqno
            in_sync, caught_up = record_candidates(tracker, vb, placed, high)
            self._reconnect_stale(vb, in_sync)
            caught_up = frozenset(r for r in caught_up if self._streams_since_registered(vb, r))
            members = keeper.target(in_sync, caught_up, keeper.registered_since(revisions))
            if members is None:
                continue
            keeper.begin(members)
            try:
                written = await self.metadata.put_in_sync(
                    vb, self.config.node_name, sorted(members), self.applied_revision, revisions
                )
            except BaseException:
                keeper.failed()
                raise
            if self.keepers.get(vb) is not keeper:
                continue  # the vbucket changed state meanwhile: the keeper is gone
            if not written:
                # The map moved on (the next map's apply decides), or a member registered
                # again unseen (the registration watch brings it; the next round judges it).
                keeper.failed()
                continue
            keeper.written(members, written)
            if self.node.context.sync_writes is not None:
                self.node.context.sync_writes.on_progress(vb)  # leavers no longer awaited

    def _streams_since_registered(self, vb: int, replica: str) -> bool:
        """Whether `replica`'s stream of `vb` opened after this agent saw its registration:
        then it is its registered process's, and what it acknowledged that process holds."""
        tracker = self.node.context.replication
        seen = self.registrations.get(replica)
        if tracker is None or seen is None:
            return False
        return tracker.progress(vb, replica).opened_s >= seen[1]

    def _reconnect_stale(self, vb: int, in_sync: frozenset[str]) -> None:
        """Close the replica connection of each in-sync replica of `vb` whose stream opened
        before its registration was seen here (it restarted, or only lost its lease and took
        it again), once per registration: it reconnects at once, and its new stream shows
        what its process holds, so it can be caught up again, and named in a record again."""
        tracker = self.node.context.replication
        if tracker is None:
            return
        for replica in sorted(in_sync):
            seen = self.registrations.get(replica)
            if seen is None or self._reconnected.get(replica) == seen[0]:
                continue
            progress = tracker.progress(vb, replica)
            if not progress.connected or progress.opened_s >= seen[1]:
                continue
            self._reconnected[replica] = seen[0]
            closed = 0
            for pump in self.node.context.dcp:
                if pump.replica_name == replica:
                    pump.disconnect()
                    closed += 1
            log.info(
                "%s's registration (etcd revision %d) is newer than its replica stream here: "
                "closed its %d connections, so that it reconnects and counts as caught up afresh",
                replica, seen[0], closed,
            )  # fmt: skip

    def _status(self) -> dict[str, object]:
        bucket = self.node.context.bucket
        high = {str(vb): v.high_seqno for vb, v in bucket.vbuckets.items() if v.state.holds_copy}
        status: dict[str, object] = {"high": high}
        cluster_map = self.applied
        if cluster_map is None:
            return status
        status["rev"] = cluster_map.rev
        moving = {
            m.vb: bucket.vbuckets[m.vb]
            for m in cluster_map.moves
            if cluster_map.role_of(self.config.node_name, m.vb) == 0 and m.vb in bucket.vbuckets
        }
        if moving:
            acked: dict[int, dict[str, int]] = {vb: {} for vb in moving}
            tracker = self.node.context.replication
            for progress in tracker.snapshot() if tracker is not None else ():
                if progress.vb in acked:
                    acked[progress.vb][progress.replica] = progress.received_seqno
            status["moving"] = {
                str(vb): {"state": v.state.value, "high": v.high_seqno, "acked": acked[vb]}
                for vb, v in moving.items()
            }
        # A copy a move builds or promotes says itself what it holds and has persisted: the
        # takeover waits for the future active to have persisted the final high seqno (what
        # the copy itself reports, whichever stream its active's tracker last saw).
        me = cluster_map.node_index(self.config.node_name)
        copies = {
            str(m.vb): [bucket.vbuckets[m.vb].high_seqno, bucket.vbuckets[m.vb].persisted_seqno]
            for m in cluster_map.moves
            if me is not None and me in m.chain and m.vb in bucket.vbuckets
        }
        if copies:
            status["copies"] = copies
        return status

    def apply(
        self,
        cluster_map: ClusterMap,
        revision: int = 0,
        activations: dict[int, Activation] | None = None,
        *,
        force: bool = False,
    ) -> None:
        """Make the node's vbucket states and replica feeds what `cluster_map` says
        (`revision`: its key's etcd mod revision; `activations`: stored with it; `force`:
        apply it even if not newer, after a fence)."""
        if self.applied is not None and cluster_map.rev <= self.applied.rev and not force:
            return
        if cluster_map.vbuckets != self.config.vbuckets:
            log.error(
                "map rev %d has %d vbuckets, this node %d: ignored",
                cluster_map.rev, cluster_map.vbuckets, self.config.vbuckets,
            )  # fmt: skip
            return
        context = self.node.context
        name = self.config.node_name
        removed = (
            self.applied is not None
            and self.applied.node_index(name) is not None
            and cluster_map.node_index(name) is None
        )
        self.applied, self.applied_revision = cluster_map, max(revision, self.applied_revision)
        self.activations = dict(activations or {})
        self._apply_states(cluster_map)
        sources: dict[str, set[int]] = {}
        addresses: dict[str, NodeAddress] = {}
        for vb in range(cluster_map.vbuckets):
            active = cluster_map.active(vb)
            if wanted_state(cluster_map, name, vb).is_replica and active is not None:
                sources.setdefault(active.name, set()).add(vb)
                addresses[active.name] = active
        context.cluster_map = cluster_map
        pushed = context.push_cluster_map()  # SDK connections that asked to be told
        self._place_feeds(sources, addresses)
        self.map_applied.set()
        log.info(
            "applied map rev %d: %d replica feeds, pushed to %d connections",
            cluster_map.rev, len(self.feeds), pushed,
        )  # fmt: skip
        if removed:
            log.warning("map rev %d no longer lists this node (removed): stopping", cluster_map.rev)
            self.removed = True
            self.node.request_stop()

    def _apply_states(self, cluster_map: ClusterMap) -> int:
        """Set every vbucket's state from `cluster_map` (a fenced node's actives PENDING), each
        through the node's one entry; keep an InSyncKeeper per vbucket active here. Returns how
        many vbuckets the map makes active here."""
        context = self.node.context
        name = self.config.node_name
        actives = 0
        for vb in range(cluster_map.vbuckets):
            wanted = wanted_state(cluster_map, name, vb)
            actives += wanted.is_active
            state = serving_state(wanted, fenced=self.fenced)
            # Judged as its active, ACTIVE or PENDING (in takeover): a refused copy never
            # goes PENDING, which a later start would read as one a process took.
            if cluster_map.role_of(name, vb) == 0 and self._refuses(vb):
                state = VBucketState.REPLICA  # waits, fed by no one, for the next decision
            elif cluster_map.role_of(name, vb) != 0:
                self.refused_activations.pop(vb, None)  # moved away: the request is answered
            context.set_vbucket_state(vb, state)
            if state.is_active:
                if vb not in self.keepers:
                    placed = frozenset(n.name for n in cluster_map.replica_nodes(vb))
                    self.keepers[vb] = InSyncKeeper(placed)
            else:
                self.keepers.pop(vb, None)
        return actives

    def _refuses(self, vb: int) -> bool:
        """Whether this process refuses to be `vb`'s active under the applied map
        (rules.refuses_activation), judged once per activation (a later map's, decided on
        this process, stands); logs and records a new refusal (`_ask_failovers`)."""
        activation = self.activations.get(vb)
        name = self.config.node_name
        judged = activation.registration if activation and activation.node == name else None
        decided = judged if judged is not None else self.applied_revision
        if self.refused_activations.get(vb) == decided:
            return True
        if not refuses_activation(
            judged,
            self.applied_revision,
            self.registration,
            holds_branch=self.holds_branch.get(vb, False),
        ):
            self.refused_activations.pop(vb, None)
            return False
        self.refused_activations[vb] = decided
        log.warning(
            "vb %d: not taking it as active: it was made active here on registration %s, "
            "before this process registered (etcd revision %d), and this copy may lack what "
            "the node acknowledged then; asking for its failover",
            vb, judged if judged is not None else "unknown", self.registration,
        )  # fmt: skip
        return True

    def _place_feeds(self, sources: dict[str, set[int]], addresses: dict[str, NodeAddress]) -> None:
        for source_name in list(self.feeds):
            feed, task = self.feeds[source_name]
            wanted = sources.get(source_name)
            if wanted != set(feed.vbuckets) or addresses.get(source_name) != feed.source:
                task.cancel()
                del self.feeds[source_name]
        # With a cluster CA (serve --tls-ca) replicas dial their actives' TLS ports and
        # authenticate by this node's certificate; the password serves plain-TCP clusters.
        tls = self.node.tls
        options = FeedOptions(
            node_name=self.config.node_name,
            bucket=self.config.bucket,
            user=REPLICATION_USER,
            password=replication_password(),
            tls=tls.client if tls is not None and tls.authenticates_nodes else None,
        )
        loop = asyncio.get_running_loop()
        for source_name, vbs in sources.items():
            if source_name not in self.feeds:
                feed = ReplicaFeed(self.node.context.bucket, addresses[source_name], vbs, options)
                task = loop.create_task(feed.run(), name=feed.name)
                self.feeds[source_name] = (feed, task)
