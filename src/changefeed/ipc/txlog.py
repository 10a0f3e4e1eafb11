"""Transaction logs: how a restarted proxy undoes what its crashed predecessor held.

Spec: shared/seeds/partial-restart-transaction-logs.md (LoLa's partial restart); layout in
layout.py. Every change a proxy makes to the provider's shared state — taking a subscription
(subscriber count and slot budget) and referencing a slot (its refcount) — is bracketed by a
transaction in the proxy's log, which lives in the same shared memory and so survives the proxy.

Two flag bytes per entry (BEGIN, END), one entry per slot plus one for the subscription::

    reference slot i     (0,0) -begin-> (1,0) -[refcount+1]-> commit -> (1,1)
                         (1,0) -abort-> (0,0)            (the slot was reused meanwhile)
                         (1,1) -begin-> (0,1) -[refcount-1]-> commit -> (0,0)
    subscription         (0,0) -begin(max_samples)-> (1,0) -[subscribe]-> commit -> (1,1)
                         (1,0) -abort-> (0,0)            (refused: no room)
                         (1,1) -begin-> (0,1) -[unsubscribe]-> commit -> (0,0)

(1,1) is a completed increment or subscribe, which a rollback undoes. (1,0) is a crash during
an increment, (0,1) during a decrement: the log cannot tell whether the shared operation
happened, so rollback refuses to guess (fail closed) and the log stays quarantined — owned by
its id, never reused. Decrements clear BEGIN first on purpose, to tell the two apart.

Registration takes a free log by compare-and-swap of its owner id from INVALID (no mutex: a
process dying inside a mutex is what LoLa moved away from). A free log is always clean: `reset`
clears the flags before it frees the owner.

Rollback at proxy creation (`TransactionLogSet.rollback`): the logs owned by the application id
and marked needs-rollback are tried in order, and the first that rolls back wins. A log caught
mid-transaction releases every slot it can, keeps its subscription (so the slot budget still
covers the reference it may hold) and stays quarantined. Beyond LoLa: a log whose recorded owner
process is still alive (same pid and start time) is never marked or rolled back, so two live
applications that share an id cannot undo each other; and the caller still creates the proxy
when all old logs are quarantined as long as a free log can be registered.

Reclaim by the survivor (beyond LoLa, docs/ipc.md): the provider rolls back the log of a reader
process that died and never returns (`TransactionLogSet.reclaim_dead`), exactly as that
reader's restart would. A reader is judged dead by its recorded pid *and* start time (a reused
pid is another process; a zombie is dead), and only when it shares the provider's pid namespace
(recorded in its log): a pid from another namespace says nothing here, so such a log is left to
its own restart. Every rollback — a restarting reader's or the provider's — runs under the
service's rollback lock (an flock, which the OS drops when its holder dies), so one log is never
rolled back twice; a dead reader's log changes under nobody else's hand.

Crash points: `crash_point`, if set, is called with a name (and the log and slot concerned) at
every step; tests kill the process or raise there. Names are listed in CRASH_POINTS.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final

from changefeed.ipc.atomic import Atomics
from changefeed.ipc.errors import MaxSubscribersError
from changefeed.ipc.layout import (
    INVALID_OWNER,
    NODE_MAX_SAMPLES,
    NODE_NEEDS_ROLLBACK,
    NODE_OWNER,
    NODE_OWNER_PID,
    NODE_OWNER_PIDNS,
    NODE_OWNER_START,
    NODE_SUB_BEGIN,
    NODE_SUB_END,
    NODE_WAITING,
    PID_INVALID,
    PID_UNUSED,
    PID_UPDATING,
    PID_USED,
    SUBSCRIPTION_AT,
    ControlLayout,
)

# Called (name, log index, slot) at every step; -1 where it does not apply.
crash_point: Callable[[str, int, int], None] | None = None

CRASH_POINTS: Final = (
    "register.acquired",  # owner CAS done, owner pid not yet written
    "subscribe.begun",  # (1,0) with max_samples stored, subscription not yet taken
    "subscribe.taken",  # subscription taken, not yet committed
    "subscribe.committed",
    "reference.begun",  # (1,0), refcount not yet incremented
    "reference.taken",  # refcount incremented, not yet committed
    "reference.committed",
    "dereference.begun",  # (0,1), refcount not yet decremented
    "dereference.released",  # refcount decremented, not yet committed
    "dereference.committed",
    "unsubscribe.begun",
    "unsubscribe.released",
    "unsubscribe.committed",
    "rollback.slot_begun",  # a rollback is itself logged: (0,1) while it decrements
    "rollback.slot_released",
    "rollback.unsubscribe_begun",
    "rollback.unsubscribe_released",
    "rollback.reset",
    "unregister.reset",
)


def _crash(name: str, log: int = -1, slot: int = -1) -> None:
    hook = crash_point
    if hook is not None:
        hook(name, log, slot)


# -- process identity -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process, told apart from a later one that reuses its pid by its start time."""

    pid: int
    start_time: int

    @classmethod
    def current(cls) -> ProcessIdentity:
        pid = os.getpid()
        return cls(pid, process_start_time(pid))


def process_start_time(pid: int) -> int:
    """Start time of `pid` in clock ticks since boot (/proc/<pid>/stat field 22); 0 if gone or
    unknown (no /proc); -1 for a zombie (dead, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return 0
    # The command name (field 2) is in parentheses and may contain anything: split after it.
    fields = raw[raw.rfind(b")") + 2 :].split()
    try:
        if fields[0] in (b"Z", b"X"):
            return -1
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def is_alive(identity: ProcessIdentity) -> bool:
    """True if the process is running (a zombie or a reused pid is not)."""
    if identity.pid <= 0:
        return False
    try:
        os.kill(identity.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    now = process_start_time(identity.pid)
    if now == -1:
        return False
    if identity.start_time and now:
        return now == identity.start_time
    return True


Liveness = Callable[[ProcessIdentity], bool]

_PID_NAMESPACE: list[int] = []  # this process's, read once (a process never changes it)


def pid_namespace() -> int:
    """The inode of this process's pid namespace (``/proc/self/ns/pid``); 0 if unknown."""
    if not _PID_NAMESPACE:
        try:
            _PID_NAMESPACE.append(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:
            _PID_NAMESPACE.append(0)
    return _PID_NAMESPACE[0]


if hasattr(os, "register_at_fork"):  # a forked child may be in a new namespace (CLONE_NEWPID)
    os.register_at_fork(after_in_child=_PID_NAMESPACE.clear)


# -- one log ----------------------------------------------------------------------------------


class TransactionLog:
    """The local view of log `index`: its flag bytes and the steps of its state machines.

    Each step asserts its precondition (a proxy uses its log single-threaded).
    """

    __slots__ = ("_a", "_slot_flags", "index", "node")

    def __init__(self, atomics: Atomics, layout: ControlLayout, index: int) -> None:
        self._a = atomics
        self.index = index
        self.node = layout.node(index)
        self._slot_flags = layout.node_slot(index, 0)

    # subscription
    def subscription_state(self) -> tuple[int, int]:
        a, node = self._a, self.node
        return a.load_u8(node + NODE_SUB_BEGIN), a.load_u8(node + NODE_SUB_END)

    @property
    def max_samples(self) -> int:
        return self._a.load_u16(self.node + NODE_MAX_SAMPLES)

    def subscribe_begin(self, max_samples: int) -> None:
        assert self.subscription_state() == (0, 0), self.subscription_state()
        assert 0 < max_samples <= 0xFFFF, max_samples
        a, node = self._a, self.node
        # u16 stored through the u32 that holds it and the 2 reserved bytes after it.
        a.store_u32(node + NODE_MAX_SAMPLES, max_samples)
        a.store_u8(node + NODE_SUB_BEGIN, 1)

    def subscribe_commit(self) -> None:
        assert self.subscription_state() == (1, 0), self.subscription_state()
        self._a.store_u8(self.node + NODE_SUB_END, 1)

    def subscribe_abort(self) -> None:
        assert self.subscription_state() == (1, 0), self.subscription_state()
        self._a.store_u8(self.node + NODE_SUB_BEGIN, 0)
        self._a.store_u32(self.node + NODE_MAX_SAMPLES, 0)

    def unsubscribe_begin(self) -> None:
        assert self.subscription_state() == (1, 1), self.subscription_state()
        self._a.store_u8(self.node + NODE_SUB_BEGIN, 0)

    def unsubscribe_commit(self) -> None:
        assert self.subscription_state() == (0, 1), self.subscription_state()
        self._a.store_u8(self.node + NODE_SUB_END, 0)
        self._a.store_u32(self.node + NODE_MAX_SAMPLES, 0)

    # slot references
    def slot_state(self, slot: int) -> tuple[int, int]:
        at = self._slot_flags + 2 * slot
        return self._a.load_u8(at), self._a.load_u8(at + 1)

    def reference_begin(self, slot: int) -> None:
        at = self._slot_flags + 2 * slot
        assert self.slot_state(slot) == (0, 0), (slot, self.slot_state(slot))
        self._a.store_u8(at, 1)

    def reference_commit(self, slot: int) -> None:
        at = self._slot_flags + 2 * slot
        self._a.store_u8(at + 1, 1)

    def reference_abort(self, slot: int) -> None:
        self._a.store_u8(self._slot_flags + 2 * slot, 0)

    def dereference_begin(self, slot: int) -> None:
        assert self.slot_state(slot) == (1, 1), (slot, self.slot_state(slot))
        self._a.store_u8(self._slot_flags + 2 * slot, 0)

    def dereference_commit(self, slot: int) -> None:
        self._a.store_u8(self._slot_flags + 2 * slot + 1, 0)

    def open_slots(self, slot_count: int) -> dict[int, tuple[int, int]]:
        """Slots whose entry is not (0,0), with their (BEGIN, END)."""
        found = {}
        for slot in range(slot_count):
            state = self.slot_state(slot)
            if state != (0, 0):
                found[slot] = state
        return found

    def contains_transactions(self, slot_count: int) -> bool:
        return self.subscription_state() != (0, 0) or bool(self.open_slots(slot_count))

    def reset(self, slot_count: int) -> None:
        """Clear every flag, then free the log (owner INVALID last: a free log is clean)."""
        a, node = self._a, self.node
        for slot in range(slot_count):
            at = self._slot_flags + 2 * slot
            a.store_u8(at, 0)
            a.store_u8(at + 1, 0)
        a.store_u8(node + NODE_SUB_BEGIN, 0)
        a.store_u8(node + NODE_SUB_END, 0)
        a.store_u32(node + NODE_MAX_SAMPLES, 0)
        a.store_u8(node + NODE_WAITING, 0)
        a.store_u8(node + NODE_NEEDS_ROLLBACK, 0)
        a.store_u32(node + NODE_OWNER_PID, 0)
        a.store_u64(node + NODE_OWNER_START, 0)
        a.store_u64(node + NODE_OWNER_PIDNS, 0)
        a.store_u32(node + NODE_OWNER, INVALID_OWNER)


# -- subscription control --------------------------------------------------------------------


class SubscriptionControl:
    """LoLa's EventSubscriptionControl: one u32, subscribers << 16 | subscribed slots, CAS."""

    def __init__(self, atomics: Atomics, *, max_subscribers: int, subscribable_slots: int) -> None:
        self._a = atomics
        self.max_subscribers = max_subscribers
        self.subscribable_slots = subscribable_slots

    def state(self) -> tuple[int, int]:
        word = self._a.load_u32(SUBSCRIPTION_AT)
        return word >> 16, word & 0xFFFF

    def subscribe(self, max_samples: int) -> None:
        """Take one subscriber and `max_samples` slots of the budget.

        Raises:
            MaxSubscribersError: no room (the message says which bound).
        """
        for _ in range(2 * self.max_subscribers + 16):  # bounded retries (LoLa: 2 x max)
            word = self._a.load_u32(SUBSCRIPTION_AT)
            subscribers, slots = word >> 16, word & 0xFFFF
            if subscribers >= self.max_subscribers:
                raise MaxSubscribersError(
                    f"{subscribers} readers are subscribed, the most this service allows "
                    f"(max_subscribers {self.max_subscribers})"
                )
            if slots + max_samples > self.subscribable_slots:
                raise MaxSubscribersError(
                    f"readers hold a budget of {slots} of {self.subscribable_slots} slots; "
                    f"max_samples {max_samples} does not fit"
                )
            new = (subscribers + 1) << 16 | (slots + max_samples)
            if self._a.cas_u32(SUBSCRIPTION_AT, word, new) == word:
                return
        raise MaxSubscribersError("the subscription state changed on every retry")

    def unsubscribe(self, max_samples: int) -> None:
        while True:  # a CAS loop: every failure means another reader's update went through
            word = self._a.load_u32(SUBSCRIPTION_AT)
            subscribers, slots = word >> 16, word & 0xFFFF
            assert subscribers >= 1 and slots >= max_samples, (subscribers, slots, max_samples)
            new = (subscribers - 1) << 16 | (slots - max_samples)
            if self._a.cas_u32(SUBSCRIPTION_AT, word, new) == word:
                return


# -- the set ---------------------------------------------------------------------------------


@dataclass(slots=True)
class RollbackResult:
    """What `TransactionLogSet.rollback` did.

    Attributes:
        candidates: logs owned by the id and marked needs-rollback, in the order tried.
        rolled_back: the log that rolled back and was freed (None: none did, or none needed).
        quarantined: logs that could not roll back (caught mid-transaction), with why.
        released_slots: slot references given back on the way (also from quarantined logs).
    """

    candidates: list[int] = field(default_factory=list)
    rolled_back: int | None = None
    quarantined: dict[int, str] = field(default_factory=dict)
    released_slots: int = 0

    @property
    def failed(self) -> bool:
        """Logs needed rolling back and none could."""
        return bool(self.candidates) and self.rolled_back is None


@dataclass(slots=True)
class ReclaimResult:
    """What `TransactionLogSet.reclaim_dead` did.

    Attributes:
        reclaimed: log -> (owner id, dead process): rolled back and freed.
        quarantined: log -> (owner id, dead process, why): caught mid-transaction, kept.
        released_slots: slot references given back (also from quarantined logs).
    """

    reclaimed: dict[int, tuple[int, ProcessIdentity]] = field(default_factory=dict)
    quarantined: dict[int, tuple[int, ProcessIdentity, str]] = field(default_factory=dict)
    released_slots: int = 0


class TransactionLogSet:
    """All logs of a service: registration by CAS, marking, rollback, the UID/PID map."""

    def __init__(self, atomics: Atomics, layout: ControlLayout) -> None:
        self._a = atomics
        self.layout = layout
        geometry = layout.geometry
        self.size = geometry.max_subscribers
        self.slot_count = geometry.slot_count
        self.logs = [TransactionLog(atomics, layout, i) for i in range(self.size)]
        self.subscription = SubscriptionControl(
            atomics,
            max_subscribers=geometry.max_subscribers,
            subscribable_slots=geometry.subscribable_slots,
        )

    def owner(self, index: int) -> int:
        return self._a.load_u32(self.logs[index].node + NODE_OWNER)

    def owner_process(self, index: int) -> ProcessIdentity:
        node = self.logs[index].node
        return ProcessIdentity(
            self._a.load_u32(node + NODE_OWNER_PID), self._a.load_u64(node + NODE_OWNER_START)
        )

    def owner_namespace(self, index: int) -> int:
        return self._a.load_u64(self.logs[index].node + NODE_OWNER_PIDNS)

    def owner_record(self, index: int) -> tuple[int, ProcessIdentity, int]:
        """(owner id, owner process, its pid namespace) of log `index`, read in that order."""
        return self.owner(index), self.owner_process(index), self.owner_namespace(index)

    def dead_owned(self, alive: Liveness, namespace: int) -> list[int]:
        """Logs whose owner process is known dead: owned, with a pid and start time recorded
        in `namespace` (the caller's pid namespace), and not `alive`. Lock-free: a hint; the
        caller checks again under the rollback lock (`reclaim_dead`)."""
        found = []
        for index in range(self.size):
            owner, process, owner_namespace = self.owner_record(index)
            if owner == INVALID_OWNER or not process.pid or not process.start_time:
                continue  # free, or between taking the log and recording its process
            if not namespace or owner_namespace != namespace:
                continue  # another pid namespace (or an unknown one): its pid says nothing
            if not alive(process):
                found.append(index)
        return found

    def reclaim_dead(
        self,
        alive: Liveness,
        namespace: int,
        skip: Collection[tuple[int, ProcessIdentity]] = (),
    ) -> ReclaimResult:
        """Roll back every log whose owner process died, as its restart would (the survivor's
        rollback, run by the provider). The caller holds the rollback lock.

        A log is taken only if its record (owner id, pid, start time, namespace) reads the same
        after the process was found dead as before: then it still belongs to that dead process,
        and nobody else changes it (its owner is gone; every other rollback waits for the
        lock). A log caught mid-transaction is quarantined as at a restart (marked
        needs-rollback: the owner's restart tries it again). `skip`: (log, process) pairs
        already found quarantined (trying again would change nothing).
        """
        result = ReclaimResult()
        for index in self.dead_owned(alive, namespace):
            record = self.owner_record(index)
            owner, process, _ = record
            if (index, process) in skip:
                continue
            if alive(process) or self.owner_record(index) != record:
                continue  # freed and taken again meanwhile: not the dead one's any more
            log = self.logs[index]
            rollback = RollbackResult(candidates=[index])
            problem = self._rollback_one(log, rollback)
            result.released_slots += rollback.released_slots
            if problem:
                self._a.store_u8(log.node + NODE_NEEDS_ROLLBACK, 1)
                result.quarantined[index] = (owner, process, problem)
            else:
                assert self.owner(index) == INVALID_OWNER, index
                result.reclaimed[index] = (owner, process)
        return result

    def needs_rollback(self, index: int) -> bool:
        return bool(self._a.load_u8(self.logs[index].node + NODE_NEEDS_ROLLBACK))

    def register(self, app_id: int, identity: ProcessIdentity) -> TransactionLog:
        """Acquire a free log for `app_id` by CAS on its owner id.

        Raises:
            MaxSubscribersError: every log is owned (by readers, or quarantined).
        """
        assert 0 <= app_id < INVALID_OWNER, app_id
        a = self._a
        for _ in range(self.size):  # bounded: the set's size bounds concurrent competitors
            for log in self.logs:
                if a.load_u32(log.node + NODE_OWNER) != INVALID_OWNER:
                    continue
                if a.cas_u32(log.node + NODE_OWNER, INVALID_OWNER, app_id) != INVALID_OWNER:
                    continue  # another process won this one
                _crash("register.acquired", log.index)
                a.store_u8(log.node + NODE_NEEDS_ROLLBACK, 0)
                a.store_u32(log.node + NODE_OWNER_PID, identity.pid)
                a.store_u64(log.node + NODE_OWNER_START, identity.start_time)
                # Last: a provider judges the owner by its pid only once all three are there.
                a.store_u64(log.node + NODE_OWNER_PIDNS, pid_namespace())
                assert not log.contains_transactions(self.slot_count), log.index
                return log
        owned = sum(1 for i in range(self.size) if self.owner(i) != INVALID_OWNER)
        raise MaxSubscribersError(
            f"all {self.size} transaction logs are owned ({owned} in use or quarantined): "
            f"max_subscribers {self.size} reached"
        )

    def unregister(self, log: TransactionLog) -> None:
        """Free a log whose transactions are all complete (a clean close)."""
        assert not log.contains_transactions(self.slot_count), log.index
        _crash("unregister.reset", log.index)
        log.reset(self.slot_count)

    def _foreign_live(self, index: int, me: ProcessIdentity, alive: Liveness) -> bool:
        """True if log `index` belongs to another process that is running."""
        owner = self.owner_process(index)
        if owner.pid == me.pid and owner.start_time == me.start_time:
            return False
        return alive(owner)

    def mark_needs_rollback(self, app_id: int, me: ProcessIdentity, alive: Liveness) -> list[int]:
        """Mark every log of `app_id` left by a process that is gone (the first proxy of a
        process does this, before any log of this process exists). Returns the logs marked."""
        marked = []
        for log in self.logs:
            if self.owner(log.index) != app_id or self._foreign_live(log.index, me, alive):
                continue
            self._a.store_u8(log.node + NODE_NEEDS_ROLLBACK, 1)
            marked.append(log.index)
        return marked

    def rollback(self, app_id: int, me: ProcessIdentity, alive: Liveness) -> RollbackResult:
        """Roll back the first log of `app_id` marked needs-rollback that can be; see module doc."""
        result = RollbackResult()
        for log in self.logs:
            index = log.index
            if self.owner(index) != app_id or not self.needs_rollback(index):
                continue
            if self._foreign_live(index, me, alive):
                continue
            result.candidates.append(index)
            problem = self._rollback_one(log, result)
            if problem:
                result.quarantined[index] = problem
                continue
            result.rolled_back = index
            return result
        return result

    def _rollback_one(self, log: TransactionLog, result: RollbackResult) -> str:
        """Undo one log; "" on success (the log is freed), else why it stays quarantined."""
        slots = log.open_slots(self.slot_count)
        subscription = log.subscription_state()
        if subscription != (1, 1) and slots:
            return f"slot entries {sorted(slots)} without a committed subscription"
        ambiguous = sorted(slot for slot, state in slots.items() if state != (1, 1))
        for slot, state in sorted(slots.items()):
            if state != (1, 1):
                continue
            log.dereference_begin(slot)
            _crash("rollback.slot_begun", log.index, slot)
            self._a.fetch_sub_u64(self.layout.slot_state(slot), 1)  # without logging
            _crash("rollback.slot_released", log.index, slot)
            log.dereference_commit(slot)
            result.released_slots += 1
        if ambiguous:
            # The subscription stays: its slot budget covers the reference that may be held.
            return f"caught mid-transaction on slot(s) {ambiguous}"
        if subscription == (1, 1):
            max_samples = log.max_samples
            log.unsubscribe_begin()
            _crash("rollback.unsubscribe_begun", log.index)
            self.subscription.unsubscribe(max_samples)
            _crash("rollback.unsubscribe_released", log.index)
            log.unsubscribe_commit()
        elif subscription != (0, 0):
            return f"caught mid-(un)subscribe, state {subscription}"
        _crash("rollback.reset", log.index)
        log.reset(self.slot_count)
        return ""

    # -- UID/PID map (LoLa's ApplicationIdPidMapping) -------------------------------------------

    def register_pid(self, app_id: int, me: ProcessIdentity) -> ProcessIdentity | None:
        """Record `me` for `app_id`; returns the process registered before (``me`` when the id
        is new), or None when the map is full."""
        a, layout = self._a, self.layout
        entries = layout.geometry.pid_map_entries
        for index in range(entries):
            at = layout.pid_entry(index)
            key = a.load_u64(at)
            status, owner = key >> 32, key & 0xFFFF_FFFF
            if owner != app_id or status not in (PID_USED, PID_UPDATING):
                continue
            old = ProcessIdentity(a.load_u32(at + 8), a.load_u64(at + 16))
            a.store_u32(at + 8, me.pid)
            a.store_u64(at + 16, me.start_time)
            if status == PID_UPDATING:  # a predecessor died while inserting: finish for it
                a.store_u64(at, PID_USED << 32 | app_id)
                return me
            return old
        for _ in range(entries):
            for index in range(entries):
                at = layout.pid_entry(index)
                key = a.load_u64(at)
                if key >> 32 != PID_UNUSED:
                    continue
                if a.cas_u64(at, key, PID_UPDATING << 32 | app_id) != key:
                    continue
                a.store_u32(at + 8, me.pid)
                a.store_u64(at + 16, me.start_time)
                a.store_u64(at, PID_USED << 32 | app_id)
                return me
        return None

    def pid_entries(self) -> list[tuple[int, int, ProcessIdentity]]:
        """(status, app_id, process) of every entry in use."""
        a, layout = self._a, self.layout
        found = []
        for index in range(layout.geometry.pid_map_entries):
            at = layout.pid_entry(index)
            key = a.load_u64(at)
            if key >> 32 in (PID_USED, PID_UPDATING, PID_INVALID):
                found.append(
                    (
                        key >> 32,
                        key & 0xFFFF_FFFF,
                        ProcessIdentity(a.load_u32(at + 8), a.load_u64(at + 16)),
                    )
                )
        return found
