"""The cluster's decisions about one node, as pure functions of what the node knows.

The node agent (node_agent.py) and the deterministic cluster simulator (tests/sim/) both decide
with these, so a rule is written once and a simulated schedule exercises the real rule. The
orchestrator's decision is `failover.plan_failover`; the commit rule is
`server.sync_writes.durability_met`; the in-sync rule is `server.replication.ReplicationTracker`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from changefeed.server.replication import ReplicationTracker
from changefeed.vbmap import ClusterMap
from changefeed.vbucket_state import VBucketState


def wanted_state(cluster_map: ClusterMap, name: str, vb: int) -> VBucketState:
    """Node `name`'s state for `vb` under `cluster_map`: its place in the chain (first →
    ACTIVE, or PENDING while a rebalance takes the vbucket over; later → REPLICA), a REPLICA
    when a rebalance builds a copy on it, else DEAD."""
    role = cluster_map.role_of(name, vb)
    move = cluster_map.move_of(vb)
    if role == 0:
        return VBucketState.PENDING if move is not None and move.takeover else VBucketState.ACTIVE
    if role is not None:
        return VBucketState.REPLICA
    index = cluster_map.node_index(name)
    if move is not None and index is not None and index in move.chain:
        return VBucketState.REPLICA
    return VBucketState.DEAD


# -- fencing: how long an active may act on a lease it cannot renew --------------------------

# Clocks are assumed to run at rates within 1 % of each other (etcd's and ours), and the
# lease's expiry at etcd is counted from when etcd *received* a keep-alive, which is after we
# sent it. So, measured on our monotonic clock from the send of the last keep-alive etcd
# answered, etcd cannot expire the lease (and the orchestrator cannot fail us over) before
# ``ttl * (1 - CLOCK_RATE_ERROR)``; we stop FENCE_MARGIN_S before that, which also covers the
# time from the check to the end of the write it admits (one event-loop step).
CLOCK_RATE_ERROR = 0.01
FENCE_MARGIN_S = 0.5


def membership_valid_until(renewal_sent_s: float, ttl_s: float) -> float:
    """The monotonic time until which a node whose last successful lease keep-alive was sent
    at `renewal_sent_s` may still act as active (write, commit, ack as a member)."""
    until = renewal_sent_s + ttl_s * (1 - CLOCK_RATE_ERROR) - FENCE_MARGIN_S
    assert until > renewal_sent_s, (ttl_s, until)  # config keeps the TTL at 2 s or more
    return until


def serving_state(wanted: VBucketState, *, fenced: bool) -> VBucketState:
    """The state a copy takes: what the map wants, except that a fenced node's actives wait
    PENDING (writes refused NOT_MY_VBUCKET, durable waiters answered AMBIGUOUS, streams go
    on so replicas still receive all it acknowledged) until the membership is renewed and
    the map re-read."""
    if fenced and wanted.is_active:
        return VBucketState.PENDING
    return wanted


def recovered_state(state: VBucketState, *, holds_branch: bool) -> VBucketState:
    """The state a clustered node gives a vbucket it recovered from disk, before it has a
    membership and a map: a copy that was active (or PENDING) waits PENDING until a map read
    after registering says it still is (it may have been failed over while it was down, and
    with no map its durable writes would count a chain of one) — if its disk vouches for it
    (`holds_branch`: `copy_holds_its_branch`), else it waits a REPLICA, as a refused copy
    does, so that a later start never reads PENDING from a copy no process took. Other
    states stay as they were."""
    if state not in (VBucketState.ACTIVE, VBucketState.PENDING):
        return state
    return VBucketState.PENDING if holds_branch else VBucketState.REPLICA


# -- the confirmed in-sync set ------------------------------------------------------------------


def record_candidates(
    tracker: ReplicationTracker, vb: int, placed: Collection[str], high_seqno: int
) -> tuple[frozenset[str], frozenset[str]]:
    """``(in_sync, caught_up)`` for `InSyncKeeper.target`: the replicas of `vb` placed in the
    map that the in-sync rule keeps, and those of them that acknowledged `high_seqno`."""
    in_sync = frozenset(r for r in tracker.in_sync_set(vb) if r in placed)
    caught_up = frozenset(
        r for r in in_sync if tracker.progress(vb, r).received_seqno >= high_seqno
    )
    return in_sync, caught_up


# -- members registered since their record -------------------------------------------------------

# A member of an in-sync record acknowledged the active's writes as the process it was when the
# record was written. A node that crashes loses what it held only in memory (durability MAJORITY
# and MAJORITY_AND_PERSIST_TO_ACTIVE acknowledge on a replica's memory, as Couchbase does), and
# a node that restarts always registers again (``nodes/<name>`` put anew): so a member whose
# registration is newer than the record may be a later process that does not hold what the
# record vouches for. etcd orders both writes by revision; no clock is involved. The
# registration's revision is the node key's *mod* revision: a node that restarts while its old
# lease still runs puts over the existing key, which keeps its create revision.


def promotable_members(
    members: Collection[str], record_revision: int, registrations: Mapping[str, int]
) -> frozenset[str]:
    """The members of an in-sync record (etcd mod revision `record_revision`) the orchestrator
    may promote on its strength: those whose current registration (`registrations`: node name
    to its node key's mod revision) was written before the record. A member registered since
    may have restarted and lost what it acknowledged from memory; one not registered at all is
    not live, and its registration when it returns will be newer anyway."""
    return frozenset(m for m in members if 0 < registrations.get(m, 0) < record_revision)


def registered_since(
    members: Collection[str], record_revision: int, registrations: Mapping[str, int]
) -> frozenset[str]:
    """The members registered after their record (etcd mod revision `record_revision`) was
    written: live, but not promotable from it until the active writes a newer record that
    names them (`InSyncKeeper.target`'s `reregistered`)."""
    return frozenset(m for m in members if registrations.get(m, 0) > record_revision)


# -- activations decided before this process registered ----------------------------------------

# The race the rule above leaves open: a member promoted while its lease still runs (its crash
# not confirmed yet, or `--no-crash-failover`) may already be dead, and restart after the map
# landed. The orchestrator vouched for the process it judged (the registration it read, which
# the map write compares), not for the one that comes back, which holds only what its disk
# kept. So every map carries, per vbucket, the registration of the active as the orchestrator
# judged it when it made that copy active (`ClusterMetadata.write_map`'s ``activations``); a
# node whose current process registered later does not become active from it unless its own
# disk vouches for the copy (`copy_holds_its_branch`), and asks for that vbucket's failover
# instead (``vbfailover/<vb>``): the orchestrator promotes another promotable member, or waits.
# Both sides compare etcd revisions and what a store says about itself; no clock is involved.


def copy_holds_its_branch(state: VBucketState, clean: bool, branch_start_lost: bool) -> bool:
    """Whether a copy recovered from disk (`state`; `clean`: the previous process persisted
    everything it queued; `branch_start_lost`: the recovery's new failover entry dropped
    entries above the persisted end, `FailoverLog.dropped_above`) holds everything its
    previous process acknowledged, so that it may stay active on an activation decided
    before this process registered.

    Only a copy a process took as active can: stored ACTIVE, or PENDING (an active fenced or
    in takeover, a promotion taken while fenced, or a vouched recovery: a copy that was
    refused or not vouched for is stored REPLICA, `recovered_state`, and a refused one is
    never made PENDING by a takeover, `NodeAgent._apply_states`). After a clean stop its
    disk holds all it held. After a crash, an ACTIVE copy acknowledged a durable write only
    once it persisted it (`sync_writes.durability_met`), so what it may lose is what it held
    when its branch began (what it acknowledged as a replica before its promotion): its
    recovery starts a new branch at the persisted end, dropping the entries above it, and if
    it dropped any the branch began past what the disk kept (the recovered log no longer
    shows it; only the recovery can tell). A crashed PENDING copy is refused: it may be a
    replica promoted while fenced (no branch entry), which acknowledged from memory. A copy
    that was a replica (or DEAD) may have too; it is refused even after a clean stop,
    because a refused copy waits as a replica, and a clean stop of that process proves
    nothing about the one before it. Refusing is safe: the vbucket goes to another member
    (`plan_failover`).
    """
    if state is VBucketState.ACTIVE:
        return clean or not branch_start_lost
    return state is VBucketState.PENDING and clean


def refuses_activation(
    activated_registration: int | None,
    map_revision: int,
    registration: int,
    *,
    holds_branch: bool,
) -> bool:
    """Whether a node whose current process first registered at etcd revision `registration`
    refuses to become active for a vbucket the map (etcd mod revision `map_revision`) makes
    active on it. `activated_registration`: the registration the orchestrator judged when it
    made this copy active (None: the map does not say, then the map's own revision stands for
    it); `holds_branch`: `copy_holds_its_branch` for this copy when the process started.

    An activation decided on this process's registration (or a later one of it: a lease lost
    and taken again keeps the memory) stands. One decided on an earlier process's does not,
    unless the disk vouches for the copy."""
    decided = activated_registration if activated_registration is not None else map_revision
    return decided < registration and not holds_branch


class InSyncKeeper:
    """One active vbucket's confirmed in-sync record and the replicas its commits require.

    The orchestrator promotes only a replica of the record the failed active confirmed in
    etcd (`failover.plan_failover`). For that to never lose an acknowledged durable write,
    every member of any record this active has written, or may have written, must hold every
    prepare it committed (Kafka: acks=all waits for the whole ISR, and the leader shrinks the
    ISR in the controller before it commits without a member). So:

    - `required` — the replicas every commit must hear from, besides the majority of the
      chain (`sync_writes.durability_met(..., required_acks=...)`) — is always a superset
      of the record in etcd;
    - a replica joins the record only once it acked the vbucket's high seqno (it holds every
      prepare so far), and joins `required` *before* the record is written (`begin`);
    - a replica leaves `required` only *after* a record without it was written (`written`);
      a write that failed or may have failed leaves `required` as it was (`failed`).

    A record is written fenced by the map revision the active applied, so a deposed active's
    write fails. Sans-IO: the agent does the writing.

    A member that registered again after the record (`registered_since`: it restarted, or
    only lost its lease) is not promotable from it (`promotable_members`); the keeper writes
    the record again, naming it, once it is caught up on a stream it opened since — so the
    new record's revision is newer than its registration and it may be promoted again — and
    leaves it out of any record written before that.

    Args:
        placed: the vbucket's replicas in the map when it became active here. Until this
            active's first record is written they are all required: a record written before
            (by this node before a restart, or by an earlier active) may name any of them.
    """

    def __init__(self, placed: frozenset[str]) -> None:
        self.required: frozenset[str] = placed
        self.confirmed: frozenset[str] | None = None  # None: this active wrote none yet
        self.revision = 0  # the confirmed record's etcd mod revision (0: unknown)
        self.writing: frozenset[str] | None = None

    def target(
        self,
        in_sync: frozenset[str],
        caught_up: frozenset[str],
        reregistered: frozenset[str] = frozenset(),
    ) -> frozenset[str] | None:
        """The record to write next, or None when the confirmed one is right (or a write is on
        its way). `in_sync`: replicas the in-sync rule keeps; `caught_up`: those that acked
        the high seqno now (a subset of `in_sync`); `reregistered`: members of the confirmed
        record registered since it was written, whose `caught_up` must come from a stream
        opened since (the caller's duty). A record is written again, unchanged, when one of
        them is caught up (its new revision makes it promotable); one that is not is left out
        of any record written meanwhile (a record naming it would vouch for it)."""
        assert caught_up <= in_sync, (caught_up, in_sync)
        if self.writing is not None:
            return None
        confirmed = self.confirmed if self.confirmed is not None else frozenset()
        wanted = (confirmed & in_sync) | caught_up
        if wanted == self.confirmed and not reregistered & caught_up:
            return None  # nothing changed, and nobody to make promotable again
        return wanted - (reregistered - caught_up)

    def registered_since(self, registrations: Mapping[str, int]) -> frozenset[str]:
        """The members of the confirmed record registered after it was written (none before
        this active wrote one): `target`'s `reregistered`."""
        if self.confirmed is None:
            return frozenset()
        return registered_since(self.confirmed, self.revision, registrations)

    def begin(self, members: frozenset[str]) -> None:
        """A write of `members` is about to start: newcomers are required from now on."""
        assert self.writing is None, self.writing
        self.writing = members
        self.required = self.required | members

    def written(self, members: frozenset[str], revision: int = 0) -> None:
        """etcd took the record (at mod revision `revision`): leavers are no longer required."""
        assert self.writing == members, (self.writing, members)
        self.writing = None
        self.confirmed = members
        self.revision = revision
        self.required = members
        assert self.confirmed <= self.required

    def failed(self) -> None:
        """The write failed or its outcome is unknown: keep requiring every member."""
        self.writing = None


# -- confirmed crashes: failover without waiting out a lease -------------------------------------

# How often the simulator's orchestrator probes (tests/sim); the orchestrator's NOOP probes
# (below) go every NOOP_PROBE_INTERVAL_S plus the slowest probe's time, confirming crashes too.
CRASH_PROBE_INTERVAL_S = 0.2
CRASH_CONFIRM_S = 0.15  # a second refusal at least this long after the first confirms


class CrashConfirmer:
    """Decides from connection probes that a node's process is gone.

    Only *connection refused* counts: the node's host answered and nothing listens on its
    port — the process is dead (or closed its listener to stop), so it serves nothing and its
    lease may be revoked at once (then the usual failover runs). A pause, an overloaded node
    or a partition gives timeouts or unreachable errors, never refusals: those still wait out
    the lease, so the fence (`membership_valid_until`) stays the only guard there. Two
    refusals `CRASH_CONFIRM_S` apart with no success between are required, so a listener
    that is being re-created is not mistaken for a crash. Sans-IO: the caller probes.
    """

    def __init__(self) -> None:
        self._first_refused: dict[str, float] = {}

    def observe(self, node: str, *, refused: bool, now: float) -> bool:
        """Record one probe of `node`; True once its crash is confirmed."""
        if not refused:
            self._first_refused.pop(node, None)
            return False
        first = self._first_refused.setdefault(node, now)
        return now - first >= CRASH_CONFIRM_S

    def forget(self, node: str) -> None:
        self._first_refused.pop(node, None)


# -- silent nodes: failover without waiting out a lease ------------------------------------------

# A node that answers no NOOP for this long is failed over while its lease still runs (the
# orchestrator's probes, NOOP_PROBE_TIMEOUT_S each, a round every NOOP_PROBE_INTERVAL_S plus the
# slowest probe). A healthy node answers a NOOP in milliseconds (14 ms at worst of 50 at load
# 11 here); 0.6 s is two probes in a row unanswered. Under 1 s so that a client whose 1 s
# attempt timed out finds the new map on its next try (bench/bench_partition.py).
SILENCE_FAILOVER_S = 0.6
NOOP_PROBE_TIMEOUT_S = 0.3
NOOP_PROBE_INTERVAL_S = 0.1
# A node live for less than this in an orchestrator's term is not judged silent yet: a node
# starting (or a whole cluster restarting) opens its store and vbuckets and may be slow to
# answer at first; the crash probes and the lease decide there.
SILENCE_GRACE_S = 3.0
# Two probes, the second sent after the first settled, fit in the silence: it is what decides.
assert NOOP_PROBE_INTERVAL_S + NOOP_PROBE_TIMEOUT_S < SILENCE_FAILOVER_S


class SilenceDetector:
    """Decides from NOOP probes that a registered node stopped answering (paused, cut off, or
    its event loop stuck), so the orchestrator fails it over without waiting for its lease.

    Why that keeps every acknowledged durable write although the silent active is not fenced
    yet (it fences itself only when its lease runs out, `membership_valid_until`): the copy
    promoted is a member of the vbucket's confirmed in-sync record (`failover.plan_failover`),
    and while the record names it, every commit of the old active needs its acknowledgement
    (`InSyncKeeper.required` is a superset of the record). So the promoted copy holds every
    durable write the old active committed, before and after the promotion: once it applies
    the new map it acknowledges the old active no more, which can then commit nothing. The
    record the promotion relied on must still be the record when the map is written: the
    map's transaction compares the record's etcd revision (`ClusterMetadata.write_map`), so
    an active that shrank its record meanwhile (and then committed without the member) makes
    the promotion be planned again. What the old active may still acknowledge until its fence
    are plain (non-durable) writes, rolled back when it rejoins as a replica — as before,
    where it acknowledged them until the same fence.

    Sans-IO: the orchestrator probes; `observe` is told whether each probe was answered.
    """

    def __init__(self, silence_s: float = SILENCE_FAILOVER_S) -> None:
        assert silence_s > 0, silence_s
        self.silence_s = silence_s
        self._silent_since: dict[str, float] = {}

    def observe(self, node: str, *, answered: bool, sent: float, now: float) -> bool:
        """Record one probe of `node` sent at `sent` and settled at `now`; True while the node
        has answered nothing sent in the last `silence_s` (two probes at least)."""
        assert sent <= now, (sent, now)
        if answered:
            self._silent_since.pop(node, None)
            return False
        since = self._silent_since.setdefault(node, sent)
        return now - since >= self.silence_s and sent > since

    def forget(self, node: str) -> None:
        self._silent_since.pop(node, None)

    def silent_since(self, node: str) -> float | None:
        """When the probes `node` has not answered began (None: it answered the last one)."""
        return self._silent_since.get(node)

    def assume_silent(self, node: str, since: float) -> None:
        """Take over what another detector saw: `node` answered nothing sent since `since`
        (a standby that ended a silent orchestrator's term, then won the election)."""
        self._silent_since[node] = min(since, self._silent_since.get(node, since))
