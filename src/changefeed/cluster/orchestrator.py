"""The orchestrator: the one elected process that writes the cluster map.

Every node runs an ``Orchestrator`` as a candidate; the one that wins the election leads. While
it leads it watches the live nodes and asks ``plan`` for a new map each time they change; a map
``plan`` returns is written fenced by the leadership token (``ClusterMetadata.write_map``). When
the leadership is lost it stops at once (the acting task is cancelled, and a write already on
its way fails inside etcd) and campaigns again.

Today ``plan`` does one thing: with no map yet and at least ``expected_nodes`` live nodes, it
places the initial map (rev 1). Then each step fails over what must be (failover.py), and
otherwise takes the next step of a rebalance requested (rebalance.py: one map revision per
step, so a rebalance interrupted here is carried on by the next orchestrator). Failover comes
first: a dead active matters more than a balanced map.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

from changefeed import limits
from changefeed.cluster.failover import plan_failover
from changefeed.cluster.metadata import (
    Activation,
    ClusterMetadata,
    Leadership,
    MetadataUnavailableError,
)
from changefeed.cluster.placement import initial_map
from changefeed.cluster.rebalance import STEP_INTERVAL_S as REBALANCE_STEP_INTERVAL_S
from changefeed.cluster.rebalance import Rebalancer
from changefeed.cluster.rules import (
    NOOP_PROBE_INTERVAL_S,
    NOOP_PROBE_TIMEOUT_S,
    SILENCE_GRACE_S,
    CrashConfirmer,
    SilenceDetector,
)
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.vbmap import ClusterMap, NodeAddress

log = logging.getLogger(__name__)

STEP_INTERVAL_S = 1.0  # the leader looks at the cluster at least this often (failover requests)
NOOP_OPAQUE = 0x6F72_6368  # "orch": the probe's NOOP, echoed in the answer
# A term won this soon after this candidate ended a silent orchestrator's term starts with that
# node silent (the election follows the revocation within milliseconds when nothing stalls).
TAKEOVER_WINDOW_S = 2.0


class Orchestrator:
    """A candidate for orchestrator of one cluster; ``run`` until cancelled.

    Args:
        metadata: the cluster's etcd client.
        candidate: this candidate's name (the node's name).
        vbuckets, replicas: the shape of the initial map.
        expected_nodes: live nodes to wait for before the initial map.
        expected_names: their names, if known (only to log which are missing).
        lease_ttl_s: the leadership lease TTL.
        nodes_wait_log_s: how long to wait for the expected nodes before logging which are
            missing (then again at this interval, waiting on).
        on_change: called with each map this orchestrator wrote (after the write).
        crash_failover: probe the nodes (the leader while leading, the leader's node while
            standing by) and revoke the leases of those whose crash is confirmed
            (rules.CrashConfirmer), so they are failed over in about a second, not a lease;
            while leading, fail over live nodes that answer no NOOP for
            `rules.SILENCE_FAILOVER_S` (rules.SilenceDetector: a pause, a partition).
    """

    def __init__(
        self,
        metadata: ClusterMetadata,
        candidate: str,
        *,
        vbuckets: int,
        replicas: int,
        expected_nodes: int,
        expected_names: Sequence[str] = (),
        lease_ttl_s: int = limits.ETCD_LEASE_TTL_S_DEFAULT,
        nodes_wait_log_s: float = limits.CLUSTER_NODES_WAIT_LOG_S,
        on_change: Callable[[ClusterMap], None] | None = None,
        crash_failover: bool = True,
    ) -> None:
        if expected_nodes < 1:
            raise ValueError(f"expected nodes {expected_nodes} must be at least 1")
        if not 1 <= vbuckets <= limits.VBUCKETS_MAX:
            raise ValueError(f"vbuckets {vbuckets} outside 1..{limits.VBUCKETS_MAX}")
        self.metadata = metadata
        self.candidate = candidate
        self.vbuckets = vbuckets
        self.replicas = replicas
        self.expected_nodes = expected_nodes
        self.expected_names = tuple(expected_names)
        self.lease_ttl_s = lease_ttl_s
        self.nodes_wait_log_s = nodes_wait_log_s
        self.on_change = on_change
        self.leadership: Leadership | None = None
        self.terms = 0  # how many times this candidate was elected
        self.maps_written = 0
        self._waiting_since: float | None = None
        self._waiting_logged_at = 0.0
        self._refused_logged: list[tuple[int, str]] = []
        self._quorum_logged = False
        self._term_started = time.monotonic()
        self.rebalancer = Rebalancer(metadata, candidate)
        self.crash_failover = crash_failover
        self.crashes = CrashConfirmer()
        self.confirmed_crashed: set[str] = set()  # leases revoked on a confirmed crash
        self.silence = SilenceDetector()
        self.silent: set[str] = set()  # live nodes answering no NOOP: failed over (rules)
        # The orchestrator this standby found silent and whose term it ended, and since when:
        # silent from the start of this candidate's own term (no second wait for it).
        self._ended_silent: tuple[str, float, float] | None = None  # node, since, ended at
        # When each live node joined the live set this term: silence counts only after
        # rules.SILENCE_GRACE_S of it (a starting node may be slow to answer at first).
        self._live_since: dict[str, float] = {}
        self._seen_this_term: set[str] = set()  # nodes live at some point of this term
        self._last_map: ClusterMap | None = None
        # The in-sync records a planned promotion relied on, by vbucket: their etcd revisions
        # (write_map compares them: rules.SilenceDetector); and the promoted nodes'
        # registrations, which must not change before the map lands (rules.promotable_members).
        self._in_sync_guard: dict[int, int] = {}
        self._registration_guard: dict[str, int] = {}
        self._answered: set[int] = set()  # per-vbucket requests the next map answers
        self._reinstated: dict[int, Activation] = {}  # FailoverPlan.reinstated, judged
        self._held_back_logged: dict[int, frozenset[str]] = {}

    @property
    def leading(self) -> bool:
        return self.leadership is not None and not self.leadership.lost.is_set()

    async def run(self) -> None:
        """Campaign; lead until the leadership is lost; campaign again. Forever (cancel to
        stop: the leadership, if held, is resigned so another candidate takes over at once)."""
        while True:
            prober = (
                asyncio.create_task(self._probe_leader(), name=f"leader probe {self.candidate}")
                if self.crash_failover
                else None
            )
            try:
                leadership = await self.metadata.campaign(self.candidate, self.lease_ttl_s)
            finally:
                if prober is not None:
                    prober.cancel()
                    await asyncio.wait({prober})
            self.leadership = leadership
            self._term_started = time.monotonic()
            self._seen_this_term = set()
            self._live_since = {}
            self._take_over_silence()
            self.terms += 1
            log.info("%s is the orchestrator (token %d)", self.candidate, leadership.token)
            try:
                await self._lead(leadership)
            finally:
                self.leadership = None
                await _shielded(leadership.resign())
            log.warning(
                "%s is no longer the orchestrator: %s; campaigning again",
                self.candidate,
                leadership.reason,
            )

    def _take_over_silence(self) -> None:
        """At the start of a term: a node whose term this candidate ended for its silence is
        silent in this term from when the standby saw it go silent (it is probed as any other:
        its first answer ends that)."""
        ended, self._ended_silent = self._ended_silent, None
        if ended is None or time.monotonic() - ended[2] > TAKEOVER_WINDOW_S:
            return  # another won that election: what this one saw is old news
        node, since, _ = ended
        self.silence.assume_silent(node, since)
        self.silent.add(node)
        log.warning("orchestrator %s: %s, the orchestrator before, is silent", self.candidate, node)

    async def _lead(self, leadership: Leadership) -> None:
        """Act until the leadership is lost (then the acting task is cancelled at once)."""
        acting = asyncio.create_task(self._act(leadership), name=f"orchestrator {self.candidate}")
        lost = asyncio.create_task(leadership.lost.wait())
        try:
            await asyncio.wait({acting, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (acting, lost):
                task.cancel()
            await asyncio.wait({acting, lost})
        if acting.done() and not acting.cancelled() and acting.exception() is not None:
            raise acting.exception()  # type: ignore[misc]  # a bug: let it surface

    async def _act(self, leadership: Leadership) -> None:
        """Follow the live nodes; plan after each change, and every ``nodes_wait_log_s`` (so a
        wait for missing nodes is reported even when nothing changes). Runs until cancelled."""
        latest: dict[str, NodeAddress] | None = None
        changed = asyncio.Event()

        async def follow() -> None:
            nonlocal latest
            async with contextlib.aclosing(self.metadata.watch_nodes()) as changes:
                async for live in changes:  # never ends; it retries through outages itself
                    latest = live
                    self._seen_this_term |= set(live)
                    now = time.monotonic()
                    self._live_since = {n: self._live_since.get(n, now) for n in live}
                    changed.set()

        follower = asyncio.create_task(follow(), name=f"live nodes for {self.candidate}")
        prober = (
            asyncio.create_task(self._probe_nodes(lambda: latest, changed.set), name="crash probe")
            if self.crash_failover
            else None
        )
        backoff = limits.ETCD_RETRY_BACKOFF_MIN_S
        try:
            while True:
                # A rebalance waits on the nodes' published statuses: look more often.
                interval = REBALANCE_STEP_INTERVAL_S if self.rebalancer.running else STEP_INTERVAL_S
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(self.nodes_wait_log_s, interval)):
                        await changed.wait()
                if follower.done():
                    follower.result()  # raises what broke it (a bug)
                if latest is None:
                    continue
                changed.clear()
                try:
                    await self._step(latest, leadership)
                    backoff = limits.ETCD_RETRY_BACKOFF_MIN_S
                except MetadataUnavailableError as error:
                    log.warning("orchestrator %s: %s; retrying", self.candidate, error)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, limits.ETCD_RETRY_BACKOFF_MAX_S)
                    changed.set()
        finally:
            follower.cancel()
            waited = {follower}
            if prober is not None:
                prober.cancel()
                waited.add(prober)
            await asyncio.wait(waited)

    async def _step(self, live: Mapping[str, NodeAddress], leadership: Leadership) -> None:
        """One reaction to the live set: read the map, plan, write if there is a new map.
        A CAS lost to a concurrent writer is simply read again on the next change."""
        stored = await self.metadata.read_map()
        current, revision = stored if stored is not None else (None, None)
        self._last_map = current
        new = self.plan(live, current)
        requests: dict[str, bool] = {}
        refusals: dict[int, str] = {}
        self._in_sync_guard = {}
        self._registration_guard = {}
        self._answered = set()
        self._reinstated = {}
        if current is not None:
            requests = await self.metadata.failover_requests()
            refusals = await self._refusals(current, leadership)
            new = await self._fail_over(live, current, requests, refusals)
            if new is None and not requests:  # a refusal no member can answer yet waits
                new = await self.rebalancer.step(live, current)
        if new is None:
            for node in requests:  # done earlier (or nothing to move): the request is answered
                await self.metadata.clear_failover_request(node)
            return
        absent = () if current is None else [n.name for n in current.nodes if n.name not in live]
        written = await self.metadata.write_map(
            new,
            revision,
            leadership,
            absent=absent,
            in_sync_revisions=self._in_sync_guard,
            registrations=self._registration_guard,
            answered=self._answered,
            reinstated=self._reinstated,
        )
        if written is None:
            log.info(
                "orchestrator %s: map rev %d not written (lost a race)", self.candidate, new.rev
            )
            return
        self.maps_written += 1
        log.info(
            "cluster map changed: rev %d, %d nodes (%s), %d replicas, %d vbuckets "
            "(written by %s, token %d)",
            new.rev,
            len(new.nodes),
            ", ".join(n.name for n in new.nodes),
            new.replicas,
            new.vbuckets,
            self.candidate,
            leadership.token,
        )
        if self.on_change is not None:
            self.on_change(new)

    async def _refusals(self, current: ClusterMap, leadership: Leadership) -> dict[int, str]:
        """The per-vbucket failover requests still to answer: vbucket -> the node that refused
        to become its active (rules.refuses_activation). A request whose vbucket the map no
        longer makes that node's (another step moved it) is answered: deleted, if it is still
        the request read and this term still leads (one put again since stays)."""
        pending: dict[int, str] = {}
        stored = await self.metadata.stored_vbucket_failover_requests()
        for vb, request in sorted(stored.items()):
            active = current.active(vb) if vb < current.vbuckets else None
            if active is not None and active.name == request.node:
                pending[vb] = request.node
            else:
                await self.metadata.clear_vbucket_failover_request(vb, request.revision, leadership)
        return pending

    async def _fail_over(
        self,
        live: Mapping[str, NodeAddress],
        current: ClusterMap,
        requests: Mapping[str, bool],
        refusals: Mapping[int, str],
    ) -> ClusterMap | None:
        """Promote in-sync replicas of actives that are gone (or failed over by hand, or that
        refused the vbucket: `refusals`) and give returning nodes their replica slots back
        (failover.py); None when nothing changes."""
        names = [n.name for n in current.nodes]
        hold: set[str] = set()
        if any(n not in live for n in names) and not self._may_fail_over(names, live):
            # Absent nodes keep their actives for now: only rejoins and requests act.
            hold = {n for n in names if n not in live and n not in requests}
        silent = self._silent_to_fail(names, live)
        failed = set(requests) | silent
        gone = bool(refusals) or any(
            c[0] == -1
            or (names[c[0]] not in live and names[c[0]] not in hold)
            or names[c[0]] in failed
            for c in current.chains
        )
        unplaced = any(
            -1 in chain and any(n in live and names.index(n) not in chain for n in names)
            for chain in current.chains
        )
        if not (gone or unplaced):
            return None
        # Only members registered before their record may be promoted from it: one that
        # registered again since (a restart) may have lost what it acknowledged from memory.
        view = await self.metadata.promotable_in_sync()
        statuses = await self.metadata.node_statuses()
        highs = {
            node: {int(vb): int(high) for vb, high in status.get("high", {}).items()}
            for node, status in statuses.items()
        }
        plan = plan_failover(
            current,
            set(live),
            view.records,
            highs,
            failed=failed,
            force=any(requests.values()),
            hold=hold,
            refusals=refusals,
        )
        self._answered = {vb for vb in plan.promoted if vb in refusals}
        self._reinstated = {
            vb: Activation(node, view.revisions.get(vb, 0)) for vb, node in plan.reinstated.items()
        }
        self._in_sync_guard = {vb: view.revisions.get(vb, 0) for vb in plan.promoted}
        self._registration_guard = {
            node: view.registrations[node]
            for node in plan.promoted.values()
            if node in view.registrations
        }
        refused = sorted(plan.refused.items())
        if refused and refused != self._refused_logged:
            for _, reason in refused:
                log.error("orchestrator %s: %s", self.candidate, reason)
        self._refused_logged = refused
        held_back = {vb: view.held_back[vb] for vb in plan.refused if vb in view.held_back}
        if held_back and held_back != self._held_back_logged:
            for vb, members in sorted(held_back.items()):
                log.error(
                    "orchestrator %s: vb %d: %s registered again after its in-sync record "
                    "(etcd revision %d), so may have restarted and lost what it acknowledged: "
                    "not promoted until its active writes a newer record (`changefeed cluster "
                    "failover NODE --force` promotes anyway)",
                    self.candidate, vb, ", ".join(sorted(members)), view.revisions[vb],
                )  # fmt: skip
        self._held_back_logged = held_back
        for vb, node in sorted(plan.promoted.items()):
            log.warning("orchestrator %s: vb %d fails over to %s", self.candidate, vb, node)
        return plan.new_map

    def _silent_to_fail(self, names: list[str], live: Mapping[str, NodeAddress]) -> set[str]:
        """The live nodes of the map this orchestrator finds silent, if it may fail them over:
        with the absent ones they must be fewer than half the map's nodes (an orchestrator cut
        off from most nodes hears none of them, and must not fail the majority over)."""
        silent = {n for n in self.silent if n in live and n in names}
        absent = sum(1 for n in names if n not in live)
        if silent and (len(silent) + absent) * 2 >= len(names):
            return set()
        return silent

    def _may_fail_over(self, names: list[str], live: Mapping[str, NodeAddress]) -> bool:
        """Automatic failover only while a majority of the map's nodes is live (a cluster
        restarting, or cut in two, must not fail its own majority over — Couchbase likewise
        refuses to auto-fail-over when several nodes are down at once), and not in the first
        lease TTL of a term: a new orchestrator lets nodes that are restarting register again
        before it calls them dead — unless each absent node's crash was confirmed or this term
        saw it live and then gone (its lease lapsed under this orchestrator's eyes)."""
        up = sum(1 for n in names if n in live)
        if up * 2 <= len(names):
            if not self._quorum_logged:
                log.error(
                    "orchestrator %s: only %d of %d nodes live: no automatic failover",
                    self.candidate, up, len(names),
                )  # fmt: skip
                self._quorum_logged = True
            return False
        self._quorum_logged = False
        if all(
            n in live or n in self.confirmed_crashed or n in self._seen_this_term for n in names
        ):
            # Every absent node crashed for sure, or this term saw its lease lapse (it was
            # live, then gone): no restarting node to wait for.
            return True
        return time.monotonic() - self._term_started >= self.lease_ttl_s

    async def _probe_nodes(
        self, live: Callable[[], Mapping[str, NodeAddress] | None], confirmed: Callable[[], None]
    ) -> None:
        """While leading: probe every node of the map but this one. A live node whose crash
        is confirmed has its leases revoked, so the live set drops it and its failover runs
        now; an absent one (its lease revoked by a standby that confirmed it, or expired) is
        marked confirmed, so this term need not wait a lease before failing it over. A live
        node that answers no NOOP for `rules.SILENCE_FAILOVER_S` is failed over as silent."""
        while True:  # ended by cancellation
            await asyncio.sleep(NOOP_PROBE_INTERVAL_S)
            now_live = live() or {}
            self.confirmed_crashed -= set(now_live)  # registered again: alive after all
            self.silent &= set(now_live)  # gone from etcd: the lease rules take over
            known = {n.name: n for n in self._last_map.nodes} if self._last_map else {}
            targets = [
                (name, address)
                for name, address in sorted({**known, **now_live}.items())
                if name != self.candidate
                and not (name in self.confirmed_crashed and name not in now_live)
            ]
            # All at once: a silent node's probe takes its whole timeout.
            sent = time.monotonic()
            outcomes = await asyncio.gather(
                *(self._probe(name, address) for name, address in targets)
            )
            crashed = any(crash for crash, _ in outcomes)
            heard = [
                (name, outcome) for (name, _), (_, outcome) in zip(targets, outcomes, strict=True)
            ]
            if self._observe_silences(heard, set(now_live), sent) or crashed:
                confirmed()  # plan now: a failover need not wait

    def _observe_silences(self, heard: list[tuple[str, str]], live: set[str], sent: float) -> bool:
        """Feed one round of NOOP probes to the silence detector; True when a live node became
        silent or answers again. A round in which nobody answered is no evidence against
        anyone (with more than one node probed): this orchestrator is then the suspect —
        stalled (its own timers fired before the answers were read) or cut off. A node live
        for less than `rules.SILENCE_GRACE_S` in this term is not judged yet (a starting node,
        a restarting cluster: the lease and the crash probes decide there, as before)."""
        if len(heard) > 1 and not any(outcome == "answered" for _, outcome in heard):
            return False
        now = time.monotonic()
        changed = False
        for name, outcome in heard:
            if name not in live or outcome == "unknown":  # "unknown": etcd did not answer
                continue
            if name not in self.silent and now - self._live_since.get(name, now) < SILENCE_GRACE_S:
                continue  # just live in this term: starting, not judged yet
            answered = outcome == "answered"
            silent = self.silence.observe(name, answered=answered, sent=sent, now=now)
            if silent == (name in self.silent):
                continue
            changed = True
            if silent:
                self.silent.add(name)
                log.warning(
                    "orchestrator %s: %s answers no NOOP for %.1f s: failing it over",
                    self.candidate, name, self.silence.silence_s,
                )  # fmt: skip
            else:
                self.silent.discard(name)
                log.info("orchestrator %s: %s answers again", self.candidate, name)
        return changed

    async def _probe_leader(self) -> None:
        """While standing by: probe the leader's node; on a confirmed crash revoke its leases,
        so this candidate's campaign wins now rather than after the leadership lease; when it
        answers no NOOP for `rules.SILENCE_FAILOVER_S` (paused, cut off), revoke its leadership
        lease only: its term ends now (its map writes are fenced by the leader key's create
        revision), and the next orchestrator finds it silent in turn and fails it over."""
        silence = SilenceDetector()
        while True:  # ended by cancellation
            await asyncio.sleep(NOOP_PROBE_INTERVAL_S)
            try:
                leader = await self.metadata.leader()
                if leader is None or leader[0] == self.candidate:
                    continue
                address = (await self.metadata.live_nodes()).get(leader[0])
            except MetadataUnavailableError:
                continue
            if address is None:
                continue
            sent = time.monotonic()
            crashed, outcome = await self._probe(leader[0], address)
            if crashed or outcome == "unknown":
                continue
            answered = outcome == "answered"
            if silence.observe(leader[0], answered=answered, sent=sent, now=time.monotonic()):
                since = silence.silent_since(leader[0])
                assert since is not None, leader  # observe said silent
                silence.forget(leader[0])
                if await self._end_silent_term(leader[0]):
                    self._ended_silent = (leader[0], since, time.monotonic())

    async def _end_silent_term(self, leader: str) -> bool:
        """Revoke `leader`'s leadership lease; True if this candidate revoked it."""
        try:
            lease = await self.metadata.leadership_lease(leader)
            if lease is None:
                return False
            log.warning(
                "%s: the orchestrator %s answers no NOOP for %.1f s: revoking its leadership",
                self.candidate, leader, self.silence.silence_s,
            )  # fmt: skip
            await self.metadata.revoke([lease])
        except MetadataUnavailableError as error:
            log.warning("%s: revoking %s's leadership: %s", self.candidate, leader, error)
            return False
        return True

    async def _probe(self, name: str, address: NodeAddress) -> tuple[bool, str]:
        """Probe `name` once with a NOOP: whether this probe confirmed its crash (its leases
        then revoked), and the probe's outcome (`_noop_probe`)."""
        try:
            leases = await self.metadata.leases_of(name)  # read before the probes: see rules
        except MetadataUnavailableError:
            return False, "unknown"
        outcome = await _noop_probe(address)
        if not self.crashes.observe(name, refused=outcome == "refused", now=time.monotonic()):
            return False, outcome
        if name not in self.confirmed_crashed:
            log.warning(
                "orchestrator %s: %s (%s) refuses connections: crash confirmed%s",
                self.candidate, name, address.server,
                ", revoking its lease to fail it over now" if leases else "",
            )  # fmt: skip
        self.confirmed_crashed.add(name)
        self.crashes.forget(name)
        if leases:
            try:
                await self.metadata.revoke(leases)
            except MetadataUnavailableError as error:
                log.warning("orchestrator %s: revoking %s's lease: %s", self.candidate, name, error)
        return True, outcome

    def plan(
        self, live: Mapping[str, NodeAddress], current: ClusterMap | None
    ) -> ClusterMap | None:
        """The next map for these live nodes and this current map, or None to keep it.

        Sans-IO (the failover and rebalance steps of issue 12 go here). Today: the initial map
        once ``expected_nodes`` are live, nothing once a map exists.
        """
        if current is not None:
            self._waiting_since = None
            return None
        if len(live) < self.expected_nodes:
            self._log_missing(live)
            return None
        self._waiting_since = None
        return initial_map(live.values(), self.replicas, self.vbuckets, rev=1)

    def _log_missing(self, live: Mapping[str, NodeAddress]) -> None:
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = self._waiting_logged_at = now
            return
        if now - self._waiting_logged_at < self.nodes_wait_log_s:
            return
        self._waiting_logged_at = now
        missing = [name for name in self.expected_names if name not in live]
        log.warning(
            "orchestrator %s: waiting %.0f s for %d nodes before the first map; live: %s%s",
            self.candidate,
            now - self._waiting_since,
            self.expected_nodes,
            ", ".join(live) or "none",
            f"; missing: {', '.join(missing)}" if missing else "",
        )


async def _noop_probe(address: NodeAddress) -> str:
    """``"answered"`` when `address` answered a NOOP within `NOOP_PROBE_TIMEOUT_S`,
    ``"refused"`` when nothing listens there, else ``"silent"`` (a paused or cut-off node: the
    kernel may still accept the connection of a frozen process; only an answer counts)."""
    writer = None
    try:
        async with asyncio.timeout(NOOP_PROBE_TIMEOUT_S):
            reader, writer = await asyncio.open_connection(address.host, address.port)
            writer.write(encode_request(Opcode.NOOP, opaque=NOOP_OPAQUE))
            header = await reader.readexactly(24)
    except ConnectionRefusedError:
        return "refused"
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return "silent"
    finally:
        if writer is not None:
            writer.close()
    answered = header[0] == Magic.RESPONSE and header[1] == Opcode.NOOP
    return "answered" if answered else "silent"


async def _shielded(coroutine: Awaitable[None]) -> None:
    """Finish a clean-up even if the caller is being cancelled (bounded by etcd timeouts)."""
    task = asyncio.ensure_future(coroutine)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise
