"""The active side of SyncWrites: when a durable write's prepare is held by enough copies.

A write that carries a durability level is queued as a prepare (`VBucket.set(level=...)`), which
no read and no application stream sees. This monitor decides its outcome:

- **Commit** once the level is met, counted over the vbucket's chain in the current map (the
  active and its replicas, dead ones included; alone, the chain is this node):
  `majority` and `majorityAndPersistActive` — a majority of the chain has received the prepare
  and the active has persisted it; `persistToMajority` — a majority has persisted it, the
  active among them. A replica holds the prepare once it acknowledged a seqno at or past it
  (DCP_SEQNO_ACKNOWLEDGED, server/replication.py): replica streams deliver in seqno order and
  every pending prepare is read from memory (`CheckpointManager.retain_from`), so a replica
  past the seqno has the prepare. `majority` also waits for the active's own persistence —
  stronger than Couchbase's: an active that restarts within the failover timeout keeps its
  vbuckets and comes back with only what it persisted, and its replicas roll back to it; an
  acknowledged write it held only in memory would be lost.
- **DURABILITY_IMPOSSIBLE** up front, nothing written, when fewer chain copies than a majority
  are reachable (the active plus replicas whose stream is open).
- **Abort** at the write's timeout (the client's, else `default_timeout_s`), answered
  SYNC_WRITE_AMBIGUOUS — never a false success: the prepare may still be on a replica that
  gets promoted and commits it. A vbucket that stops being active here answers its waiters
  AMBIGUOUS too; its prepares stay with it (a promoted copy commits the ones it holds).

The decisions are sans-IO (`DurableWrites`: which writes wait, when one commits, what a
timeout or a state change answers), so the node (`SyncWriteMonitor`: loop timers) and the
cluster simulator (tests/sim/durability.py: simulated timers) run the same code. The monitor
owns each pending write's life (commit, timer, abort); the connection only gets the outcome
(its `SettledAnswers`), so a client that disconnects changes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from typing import Final, Protocol

from changefeed.checkpoint import CheckpointMemoryFullError
from changefeed.protocol.errors import (
    DurabilityImpossibleError,
    StatusError,
    SyncWriteAmbiguousError,
)
from changefeed.protocol.frame_info import DurabilityLevel, DurabilityRequirement
from changefeed.protocol.kv import MutationResult
from changefeed.server.bucket import Bucket
from changefeed.server.replication import ReplicationTracker
from changefeed.vbucket_state import VBucketState

log = logging.getLogger("changefeed.sync_writes")

DEFAULT_TIMEOUT_S: Final = 10.0  # the SDKs' durable-write timeout, when the frame has none
TIMEOUT_MIN_S: Final = 0.001
RETRY_ABORT_S: Final = 0.05  # an abort that found checkpoint memory full, tried again


class DurableVBucket(Protocol):
    """What the durable-write decisions need of a vbucket (`vbucket.VBucket` has it)."""

    @property
    def state(self) -> VBucketState: ...

    @property
    def persisted_seqno(self) -> int: ...

    def commit(self, key: bytes) -> MutationResult: ...

    def commit_many(self, keys: Sequence[bytes]) -> list[MutationResult | StatusError]: ...

    def abort(self, key: bytes) -> int: ...


Answer = Callable[[MutationResult | StatusError], None]


@dataclasses.dataclass(slots=True)
class Waiter:
    """One durable write waiting for its outcome: the prepare of `key` at `seqno`.

    `answer` gets the commit's result or SyncWriteAmbiguousError, once, and is then replaced
    by `_answered`: an answered waiter may stay in its shell's deadline queue until its
    timeout, and must not keep what the answer held (the connection's reply state) alive.
    The shell that created the waiter owns its timer and calls `DurableWrites.expire` when
    it fires.
    """

    vb: int
    key: bytes
    seqno: int
    level: DurabilityLevel
    answer: Answer


@dataclasses.dataclass(slots=True)
class SyncWriteStats:
    """Outcomes over the node's life (STAT `sync-writes`, /metrics)."""

    prepared: int = 0
    committed: int = 0
    aborted: int = 0  # timed out: answered SYNC_WRITE_AMBIGUOUS
    impossible: int = 0
    ambiguous_state: int = 0  # the vbucket stopped being active here


class DurableWrites:
    """The decisions on this node's waiting durable writes, sans-IO: no loop, no futures, no
    timers (the node's `SyncWriteMonitor` and the cluster simulator are its two shells).

    Args:
        vbucket_of: the node's vbucket of an id.
        replicas_of: the replica node names of a vbucket in the current map.
        replication: replica acks (None: a node alone, no replicas).
        required_of: the replicas of a vbucket every commit must hear from (its confirmed
            in-sync record, kept by the cluster agent; none for a node alone).
    """

    def __init__(
        self,
        vbucket_of: Callable[[int], DurableVBucket],
        *,
        replicas_of: Callable[[int], Sequence[str]],
        replication: ReplicationTracker | None,
        required_of: Callable[[int], Iterable[str]] = lambda vb: (),
    ) -> None:
        self._vbucket_of = vbucket_of
        self.replicas_of = replicas_of
        self.required_of = required_of
        self._replication = replication
        self._waiting: dict[int, dict[bytes, Waiter]] = {}
        self.stats = SyncWriteStats()

    @property
    def pending_count(self) -> int:
        return sum(len(waiting) for waiting in self._waiting.values())

    def waiting_on(self, vb: int) -> int:
        """How many durable writes wait on `vb`."""
        return len(self._waiting.get(vb, ()))

    def check_possible(self, vb: int, writes: int = 1) -> None:
        """Raise DurabilityImpossibleError unless a majority of vb's chain is reachable
        (`writes`: how many writes the answer is for, as the stats count them)."""
        replicas = self.replicas_of(vb)
        if not replicas:
            return  # a copy alone is its own majority (asked per write: no generator then)
        reachable = 1
        for replica in replicas:
            if self._reachable(vb, replica):
                reachable += 1
        majority = (1 + len(replicas)) // 2 + 1
        if reachable < majority:
            self.stats.impossible += writes
            raise DurabilityImpossibleError(
                f"vb {vb}: {reachable} of {1 + len(replicas)} copies reachable, "
                f"a majority is {majority}; the write was not applied"
            )

    def add(self, waiter: Waiter) -> None:
        """Follow the prepare just queued (it may commit at once). Only this waiter is looked
        at: nothing the others wait for changed since the last check."""
        waiting = self._waiting.get(waiter.vb)
        if waiting is None:
            waiting = self._waiting[waiter.vb] = {}
        assert waiting.get(waiter.key) is None, waiter
        assert not waiting or next(reversed(waiting.values())).seqno < waiter.seqno, waiter
        waiting[waiter.key] = waiter  # in seqno order: `check` relies on it
        self.stats.prepared += 1
        vbucket = self._vbucket_of(waiter.vb)
        if not vbucket.state.is_active:
            self._answer_all_ambiguous(waiter.vb, waiting)
            return
        persisted_here = vbucket.persisted_seqno
        if persisted_here < waiter.seqno:
            return  # just queued, not yet persisted here: no level is met (`durability_met`)
        if _Acks(self, waiter.vb).met(waiter, persisted_here):
            self._commit(waiter.vb, vbucket, [waiter])

    def add_many(self, vb: int, waiters: Sequence[Waiter]) -> None:
        """`add` of each of `waiters` (the prepares of `vb` just queued as one run, seqnos
        rising) with one look at the vbucket: a prepare just queued is not persisted here yet,
        so none is met unless the flusher ran meanwhile (then `check` decides)."""
        if not waiters:
            return
        waiting = self._waiting.get(vb)
        if waiting is None:
            waiting = self._waiting[vb] = {}
        assert not waiting or next(reversed(waiting.values())).seqno < waiters[0].seqno, vb
        before = len(waiting)
        for waiter in waiters:  # bounded by the run; in seqno order, as `check` relies on
            waiting[waiter.key] = waiter
        assert len(waiting) == before + len(waiters), "a key waits once per vbucket"
        assert all(waiter.vb == vb for waiter in waiters), vb
        self.stats.prepared += len(waiters)
        vbucket = self._vbucket_of(vb)
        if not vbucket.state.is_active:
            self._answer_all_ambiguous(vb, waiting)
            return
        if vbucket.persisted_seqno >= waiters[0].seqno:
            self.check(vb)

    def is_waiting(self, waiter: Waiter) -> bool:
        """Whether `waiter` still waits for its outcome."""
        waiting = self._waiting.get(waiter.vb)
        return waiting is not None and waiting.get(waiter.key) is waiter

    @staticmethod
    def was_answered(waiter: Waiter) -> bool:
        """Whether `waiter` got its outcome: `not is_waiting(waiter)` for a waiter that was
        added, without a lookup (a waiter leaves `_waiting` exactly when it is answered, and
        its answer is swapped for `_answered` then). The shells' deadline queues ask it of
        every waiter they drop."""
        return waiter.answer is _answered

    def on_progress(self, vb: int) -> None:
        """A replica of `vb` acknowledged more (or its stream closed)."""
        if vb in self._waiting:
            self.check(vb)

    def on_persisted(self, vbs: Sequence[int]) -> None:
        """The flusher persisted more of `vbs` on this node."""
        for vb in vbs:
            if vb in self._waiting:
                self.check(vb)

    def on_state_changed(self, vb: int) -> int:
        """`vb` stopped being active here (`Effect.WAITERS_AMBIGUOUS`): answer every write
        waiting on it SYNC_WRITE_AMBIGUOUS now, not at the next ack or its timeout. Its
        prepares stay with the vbucket (a promoted copy commits the ones it holds).

        Returns:
            How many waiters were answered.
        """
        waiting = self._waiting.get(vb)
        if not waiting:
            return 0
        state = self._vbucket_of(vb).state
        assert not state.is_active, (vb, state)
        answered = self._answer_all_ambiguous(vb, waiting)
        assert vb not in self._waiting, vb
        return answered

    def check(self, vb: int) -> None:
        """Commit every waiting write of `vb` whose level is met, as one run.

        The commit rule is monotone in the seqno (a copy that holds a seqno holds every one
        before it: streams deliver in order, the flusher persists in order), so of each ack
        kind (received, persisted) the writes met are a prefix of those waiting, in seqno
        order: the walk stops looking at a kind at its first write not met. The outcome is
        the one of looking at every write (tests/unit/server/test_durable_window.py)."""
        waiting = self._waiting.get(vb)
        if not waiting:
            return
        vbucket = self._vbucket_of(vb)
        if not vbucket.state.is_active:
            self._answer_all_ambiguous(vb, waiting)
            return
        persisted_here = vbucket.persisted_seqno
        acks = _Acks(self, vb)
        met: list[Waiter] = []
        blocked: set[bool] = set()  # ack kinds (persisted?) whose first unmet write was seen
        for waiter in waiting.values():  # bounded by the waiting writes
            persisted = waiter.level is _PERSIST_TO_MAJORITY
            if persisted in blocked:
                continue
            if acks.met(waiter, persisted_here):
                met.append(waiter)
                continue
            blocked.add(persisted)
            if len(blocked) == 2:
                break
        if met:
            self._commit(vb, vbucket, met)

    def _commit(self, vb: int, vbucket: DurableVBucket, met: list[Waiter]) -> None:
        """Commit `met` (waiting on `vb`, in seqno order) as one run and answer each."""
        try:
            results = vbucket.commit_many([waiter.key for waiter in met])
        except CheckpointMemoryFullError:
            return  # the flusher frees memory; its next round checks again
        waiting = self._waiting[vb]
        committed = 0
        pop = waiting.pop
        for waiter, result in zip(met, results, strict=False):  # bounded by `met`
            left = pop(waiter.key, None)  # `_finish`, inline: one dict, one lookup
            if left is not waiter:  # a broken state: strand no other waiter, then fail
                if left is not None:
                    waiting[waiter.key] = left
                raise AssertionError(f"vb {vb}: {waiter!r} committed, {left!r} waiting")
            answer, waiter.answer = waiter.answer, _answered
            if isinstance(result, StatusError):  # the prepare is gone (a rollback): unknown
                answer(SyncWriteAmbiguousError(str(result)))
                continue
            committed += 1
            answer(result)
        self.stats.committed += committed
        if not waiting and self._waiting.get(vb) is waiting:  # an answer may have added more
            del self._waiting[vb]

    def expire(self, waiter: Waiter) -> bool:
        """The waiter's timeout passed: abort its prepare (an active copy) and answer it
        SYNC_WRITE_AMBIGUOUS. Nothing happens to a waiter already answered.

        Returns:
            False if the abort found checkpoint memory full: call again a little later.
        """
        if not self.is_waiting(waiter):
            return True
        vbucket = self._vbucket_of(waiter.vb)
        if vbucket.state.is_active:
            try:
                vbucket.abort(waiter.key)
                self.stats.aborted += 1
            except CheckpointMemoryFullError:
                log.warning("vb %d: abort of a timed-out durable write deferred", waiter.vb)
                return False
        self._finish(
            waiter,
            SyncWriteAmbiguousError(
                f"vb {waiter.vb}: durability {waiter.level.name.lower()} not met in time"
            ),
        )
        return True

    def _answer_all_ambiguous(self, vb: int, waiting: dict[bytes, Waiter]) -> int:
        answered = 0
        for waiter in list(waiting.values()):
            self.stats.ambiguous_state += 1
            self._finish(waiter, SyncWriteAmbiguousError(f"vb {vb} is no longer active here"))
            answered += 1
        return answered

    def _finish(self, waiter: Waiter, outcome: MutationResult | StatusError) -> None:
        waiting = self._waiting.get(waiter.vb)
        if waiting is not None and waiting.get(waiter.key) is waiter:
            del waiting[waiter.key]
            if not waiting:
                del self._waiting[waiter.vb]
        answer, waiter.answer = waiter.answer, _answered
        answer(outcome)

    def _reachable(self, vb: int, replica: str) -> bool:
        return self._replication is not None and self._replication.reachable(vb, replica)

    def received_ack(self, vb: int, replica: str) -> int:
        """What `replica` of `vb` acknowledged as received (0: no replication)."""
        if self._replication is None:
            return 0
        return self._replication.progress(vb, replica).received_seqno

    def persisted_ack(self, vb: int, replica: str) -> int:
        """What `replica` of `vb` acknowledged as persisted (0: no replication)."""
        if self._replication is None:
            return 0
        return self._replication.progress(vb, replica).persisted_seqno


class SyncWriteMonitor:
    """The node's shell of `DurableWrites`: the waiters' timeouts on the event loop (one
    timer for all); fed by the flusher's persisted listener and the replication tracker's.

    Args:
        bucket: the node's bucket.
        replicas_of, replication, required_of: see `DurableWrites`.
        default_timeout_s: a write's timeout when its durability frame has none.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        replicas_of: Callable[[int], Sequence[str]],
        replication: ReplicationTracker | None,
        required_of: Callable[[int], Iterable[str]] = lambda vb: (),
        default_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._bucket = bucket
        self.decisions = DurableWrites(
            bucket.vbucket,
            replicas_of=replicas_of,
            replication=replication,
            required_of=required_of,
        )
        self._default_timeout_s = default_timeout_s
        # The waiters' timeouts: for each timeout length a queue of (deadline, waiter) in
        # deadline order (the loop's clock only rises), and one loop timer for the earliest
        # head, not a timer per write; an answered waiter leaves its queue lazily, holding no
        # more than its key by then (its answer was dropped when called: `Waiter`).
        self._deadlines: dict[float, collections.deque[tuple[float, Waiter]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        bucket.persisted_listeners.append(self.decisions.on_persisted)
        if replication is not None:
            replication.listeners.append(self.decisions.on_progress)

    @property
    def stats(self) -> SyncWriteStats:
        return self.decisions.stats

    @property
    def required_of(self) -> Callable[[int], Iterable[str]]:
        return self.decisions.required_of

    @required_of.setter
    def required_of(self, required_of: Callable[[int], Iterable[str]]) -> None:
        self.decisions.required_of = required_of

    @property
    def pending_count(self) -> int:
        return self.decisions.pending_count

    @property
    def deadlines_queued(self) -> int:
        """How many waiters the deadline queues hold: those still waiting and answered ones not
        yet dropped (a queue drops its answered heads whenever it takes a new deadline)."""
        return sum(map(len, self._deadlines.values()))

    def waiting_on(self, vb: int) -> int:
        """How many durable writes wait on `vb`."""
        return self.decisions.waiting_on(vb)

    def check_possible(self, vb: int, writes: int = 1) -> None:
        """Raise DurabilityImpossibleError unless a majority of vb's chain is reachable."""
        self.decisions.check_possible(vb, writes)

    def track_run(
        self,
        requirement: DurabilityRequirement,
        vbs: Sequence[int],
        keys: Sequence[bytes],
        seqnos: Sequence[int],
        answers: Sequence[Answer],
    ) -> None:
        """Follow each prepare just queued (write i: `keys[i]` on `vbs[i]` at `seqnos[i]`, in
        request order; each vbucket's seqnos rising); write i's outcome goes to `answers[i]`,
        once. The timeouts are armed in request order, with one deadline (a single durable
        write is a run of one)."""
        assert len(vbs) == len(keys) == len(seqnos) == len(answers), (len(vbs), len(keys))
        level = requirement.level
        waiters = list(map(Waiter, vbs, keys, seqnos, repeat(level), answers))
        loop = asyncio.get_running_loop()
        self._arm_many(loop, self._timeout_s(requirement), waiters)
        self._bucket.hurry_flush()  # every level waits for this node's persistence
        by_vb: dict[int, list[Waiter]] = {}
        for waiter in waiters:  # bounded by the run
            group = by_vb.get(waiter.vb)
            if group is None:
                by_vb[waiter.vb] = [waiter]
            else:
                group.append(waiter)
        for vb, group in by_vb.items():  # bounded by the run's vbuckets
            self.decisions.add_many(vb, group)

    def _timeout_s(self, requirement: DurabilityRequirement) -> float:
        if requirement.timeout_ms:
            return max(TIMEOUT_MIN_S, requirement.timeout_ms / 1000)
        return self._default_timeout_s

    def _arm_many(
        self, loop: asyncio.AbstractEventLoop, timeout_s: float, waiters: list[Waiter]
    ) -> None:
        """`_arm` of each of `waiters`, with one deadline (they were queued together)."""
        if not waiters:
            return
        self._arm(loop, timeout_s, waiters[0])
        queue = self._deadlines[timeout_s]
        deadline = queue[-1][0]
        queue.extend(zip(repeat(deadline), waiters[1:]))

    def _arm(self, loop: asyncio.AbstractEventLoop, timeout_s: float, waiter: Waiter) -> None:
        deadline = loop.time() + timeout_s
        queue = self._deadlines.get(timeout_s)
        if queue is None:
            queue = self._deadlines[timeout_s] = collections.deque()
        else:  # answered heads leave here, so the queue holds about the writes still waiting
            answered = self.decisions.was_answered
            while queue and answered(queue[0][1]):
                queue.popleft()
        queue.append((deadline, waiter))
        if self._timer is None or deadline < self._timer_at:
            self._schedule(loop, deadline)

    def _schedule(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(deadline, self._on_timer)
        self._timer_at = deadline

    def _on_timer(self) -> None:
        """Expire every waiter whose deadline passed; then wait for the next deadline."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        decisions = self.decisions
        answered = decisions.was_answered
        retry: list[Waiter] = []
        for timeout_s, queue in list(self._deadlines.items()):
            while queue and (queue[0][0] <= now or answered(queue[0][1])):
                _, waiter = queue.popleft()
                if not answered(waiter) and not decisions.expire(waiter):
                    retry.append(waiter)  # memory full: the abort is tried again shortly
            if not queue:
                del self._deadlines[timeout_s]
        for waiter in retry:
            self._arm(loop, RETRY_ABORT_S, waiter)
        if self._timer is None and self._deadlines:
            self._schedule(loop, min(queue[0][0] for queue in self._deadlines.values()))

    def on_progress(self, vb: int) -> None:
        """A replica of `vb` acknowledged more (or its stream closed)."""
        self.decisions.on_progress(vb)

    def on_state_changed(self, vb: int) -> int:
        """See `DurableWrites.on_state_changed`."""
        return self.decisions.on_state_changed(vb)

    def on_persisted(self, vbs: Sequence[int]) -> None:
        """The flusher persisted more of `vbs` on this node."""
        self.decisions.on_persisted(vbs)

    def check(self, vb: int) -> None:
        """Commit every pending write of `vb` whose level is met."""
        self.decisions.check(vb)


def _answered(outcome: MutationResult | StatusError) -> None:
    """The answer of a waiter already answered (`Waiter`): nothing to do, nothing held."""


_PERSIST_TO_MAJORITY: Final = DurabilityLevel.PERSIST_TO_MAJORITY


class _Acks:
    """The replica acks of one vbucket for one check, of each kind read once (not per write)."""

    __slots__ = ("_decisions", "_kinds", "_vb")

    def __init__(self, decisions: DurableWrites, vb: int) -> None:
        self._decisions = decisions
        self._vb = vb
        self._kinds: dict[bool, tuple[list[int], list[int]]] = {}

    def met(self, waiter: Waiter, persisted_here: int) -> bool:
        persisted = waiter.level is _PERSIST_TO_MAJORITY
        acks = self._kinds.get(persisted)
        if acks is None:
            decisions, vb = self._decisions, self._vb
            ack = decisions.persisted_ack if persisted else decisions.received_ack
            acks = self._kinds[persisted] = (
                [ack(vb, r) for r in decisions.replicas_of(vb)],
                [ack(vb, r) for r in decisions.required_of(vb)],
            )
        # Looked up in this module at each call: the simulator's mutants replace the rule.
        return durability_met(waiter.seqno, persisted_here, acks[0], acks[1])


def durability_met(
    seqno: int,
    active_persisted: int,
    replica_acks: Sequence[int],
    required_acks: Sequence[int] = (),
) -> bool:
    """The commit rule: may the prepare at `seqno` commit?

    `replica_acks` holds one seqno per replica slot of the vbucket's chain (dead ones included:
    the majority is of the chain, not of who is up) — what each acknowledged as received
    (levels `majority`, `majorityAndPersistActive`) or persisted (`persistToMajority`).
    `required_acks` are the acks of the replicas in the vbucket's confirmed in-sync record
    (`cluster.rules.InSyncKeeper.required`): each must hold the prepare too, so that any
    replica the orchestrator may promote holds every committed write. Every level also waits
    for the active's own persistence (module docstring). Pure, so the real monitor and the
    cluster simulator decide with the same code.
    """
    if active_persisted < seqno:
        return False
    for acked in required_acks:  # loops, not generators: asked per write at every ack
        if acked < seqno:
            return False
    chain = 1 + len(replica_acks)
    majority = chain // 2 + 1
    held = 1
    for acked in replica_acks:
        if acked >= seqno:
            held += 1
    assert held <= chain and majority * 2 > chain, (held, majority, chain)  # majorities meet
    return held >= majority
