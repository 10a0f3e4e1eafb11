"""The transaction-log state machine against a model, with a crash at every possible point.

One control segment in anonymous memory; simulated processes (fake pids, each an application
id) create proxies with the real creation steps (`creation_steps`, `register_and_subscribe`),
reference and release batches with the real ring protocol (`ring.reference` / `dereference`)
and close; the provider publishes with `ring.claim_slot` / `commit_slot` and restarts with
`clean_for_reuse`. Any step may crash: the crash hook raises at a chosen crash point, and the
process is dead from then on (its logs stay as they are in shared memory, as after kill -9).

Ground truth is kept by the crash hook itself, which sees every step as it happens: which log
took or gave back which slot reference and subscription. After every step:

* every slot's refcount equals the references that truly exist (no leak, no double release);
* the subscription state equals the subscriptions that truly exist;
* a free log is clean, live proxies own distinct logs, IN_WRITING slots are unreferenced;
* the provider can always claim a slot.

The provider may reclaim dead processes' logs at any step (and die doing it), as the node's
provider does every 0.2 s: the same checks hold, and no dead reader's log outlives a reclaim
unless it was caught mid-transaction.

At the end every application restarts and recovers: each log left by a dead process is rolled
back, unless it was caught mid-transaction — then it is quarantined, and then exactly those.
"""

from __future__ import annotations

import itertools
import mmap
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from changefeed.ipc import CouldNotRestartProxyError, MaxSubscribersError
from changefeed.ipc import txlog as txlog_module
from changefeed.ipc.atomic import atomics_for, backends
from changefeed.ipc.layout import (
    INVALID_OWNER,
    REFCOUNT_BITS,
    REFCOUNT_MASK,
    SEQ_IN_WRITING,
    ControlLayout,
    Geometry,
    encode_header,
)
from changefeed.ipc.proxy import creation_steps, register_and_subscribe
from changefeed.ipc.ring import claim_slot, clean_for_reuse, commit_slot, dereference, reference
from changefeed.ipc.txlog import (
    CRASH_POINTS,
    ProcessIdentity,
    TransactionLog,
    TransactionLogSet,
    pid_namespace,
)

GEOMETRY = Geometry(
    slot_count=7, slot_bytes=64 * 1024, max_subscribers=4, group=(0,), pid_map_entries=8
)
APPS = (1, 2, 3)
# Points inside a transaction: a crash there leaves BEGIN != END, and the log is quarantined.
IN_TRANSACTION = {
    "subscribe.begun",
    "subscribe.taken",
    "reference.begun",
    "reference.taken",
    "dereference.begun",
    "dereference.released",
    "unsubscribe.begun",
    "unsubscribe.released",
    "rollback.slot_begun",
    "rollback.slot_released",
    "rollback.unsubscribe_begun",
    "rollback.unsubscribe_released",
}
assert set(CRASH_POINTS) >= IN_TRANSACTION
# The crash points each operation passes through (a rule crashes at one of them, or not at all).
CREATE_POINTS = [p for p in CRASH_POINTS if p.startswith(("register", "subscribe", "rollback"))]
TAKE_POINTS = [p for p in CRASH_POINTS if p.startswith("reference")]
RELEASE_POINTS = [p for p in CRASH_POINTS if p.startswith("dereference")]
CLOSE_POINTS = [*RELEASE_POINTS, *(p for p in CRASH_POINTS if p.startswith(("unsub", "unreg")))]
RECLAIM_POINTS = [p for p in CRASH_POINTS if p.startswith("rollback")]
assert set(CREATE_POINTS + TAKE_POINTS + CLOSE_POINTS) == set(CRASH_POINTS)


def points(names: list[str]) -> st.SearchStrategy[str | None]:
    return st.none() | st.sampled_from(names)


class Crash(Exception):
    """The process dies here."""


@dataclass
class Proc:
    identity: ProcessIdentity
    app: int
    alive: bool = True
    first_done: bool = False
    proxies: list[Proxy] = field(default_factory=list)


@dataclass
class Proxy:
    proc: Proc
    log: TransactionLog
    max_samples: int
    held: dict[int, int] = field(default_factory=dict)  # slot -> seq


class Shared:
    """The control segment, the truth, and the crash switch."""

    def __init__(self, backend: str) -> None:
        layout = ControlLayout.of(GEOMETRY)
        self.memory = mmap.mmap(-1, layout.control_bytes)
        self.buf = memoryview(self.memory)
        self.layout = encode_header(self.buf, GEOMETRY, segment_id=1, node_port=0, bucket="m")
        self.a = atomics_for(self.buf, backend)
        for index in range(GEOMETRY.max_subscribers):
            self.a.store_u32(self.layout.node(index) + 0, INVALID_OWNER)
        self.logs = TransactionLogSet(self.a, self.layout)
        self.refs: dict[int, set[int]] = {i: set() for i in range(GEOMETRY.max_subscribers)}
        self.subs: dict[int, int] = {}  # log -> max_samples truly subscribed
        self.ambiguous: set[int] = set()  # logs a crash left mid-transaction
        self.crash_at: tuple[str, int] | None = None  # (point, occurrence)
        self.crashed_at: str | None = None
        self._hits = 0
        self.states = [self.layout.slot_state(i) for i in range(GEOMETRY.slot_count)]

    def arm(self, point: str | None, occurrence: int = 1) -> None:
        """Crash at the `occurrence`-th `point` from now on; None disarms (keeps crashed_at)."""
        self.crash_at = (point, occurrence) if point else None
        if point:
            self.crashed_at = None
            self._hits = 0

    def hook(self, name: str, log: int, slot: int) -> None:
        # Truth first: the step named has happened.
        if name in ("reference.taken",):
            self.refs[log].add(slot)
        elif name in ("dereference.released", "rollback.slot_released"):
            self.refs[log].remove(slot)
        elif name == "subscribe.taken":
            self.subs[log] = self.logs.logs[log].max_samples
        elif name in ("unsubscribe.released", "rollback.unsubscribe_released"):
            del self.subs[log]
        if self.crash_at is not None and name == self.crash_at[0]:
            self._hits += 1
            if self._hits == self.crash_at[1]:
                self.crashed_at = name
                if name in IN_TRANSACTION:
                    self.ambiguous.add(log)
                raise Crash(name)

    def refcount(self, slot: int) -> int:
        return self.a.load_u64(self.states[slot]) & REFCOUNT_MASK

    def seq_of(self, slot: int) -> int:
        return self.a.load_u64(self.states[slot]) >> REFCOUNT_BITS


class TxLogModel(RuleBasedStateMachine):
    procs = Bundle("procs")

    def __init__(self) -> None:
        super().__init__()
        self.pids = itertools.count(1000)
        self.shared: Shared | None = None
        self.all_procs: dict[int, Proc] = {}
        self.head = 0
        self.provider_up = True

    @initialize(backend=st.sampled_from(backends()))
    def setup(self, backend: str) -> None:
        self.shared = Shared(backend)
        txlog_module.crash_point = self.shared.hook

    def teardown(self) -> None:
        if self.shared is not None:
            try:
                self.recover_everything()
            finally:
                txlog_module.crash_point = None
                self.shared.a.close()

    # -- helpers ------------------------------------------------------------------------------

    @property
    def s(self) -> Shared:
        assert self.shared is not None
        return self.shared

    def alive(self, identity: ProcessIdentity) -> bool:
        proc = self.all_procs.get(identity.pid)
        return proc is not None and proc.alive and proc.identity == identity

    def die(self, proc: Proc) -> None:
        proc.alive = False
        proc.proxies.clear()

    def new_proc(self, app: int) -> Proc:
        pid = next(self.pids)
        proc = Proc(ProcessIdentity(pid, pid * 7), app)
        self.all_procs[pid] = proc
        return proc

    def create(
        self, proc: Proc, max_samples: int, point: str | None, occurrence: int
    ) -> Proxy | None:
        s = self.s
        s.arm(point, occurrence)
        try:
            first = not proc.first_done
            proc.first_done = True
            report = creation_steps(s.logs, proc.app, proc.identity, self.alive, first=first)
            txlog = register_and_subscribe(
                s.logs, proc.app, proc.identity, max_samples, report.rollback
            )
        except Crash:
            self.die(proc)
            return None
        except (MaxSubscribersError, CouldNotRestartProxyError):
            return None
        finally:
            s.arm(None)
        proxy = Proxy(proc, txlog, max_samples)
        proc.proxies.append(proxy)
        return proxy

    def live_proxies(self) -> list[Proxy]:
        return [p for proc in self.all_procs.values() if proc.alive for p in proc.proxies]

    # -- rules --------------------------------------------------------------------------------

    @precondition(lambda self: sum(p.alive for p in self.all_procs.values()) < 5)
    @rule(target=procs, app=st.sampled_from(APPS))
    def start_process(self, app: int) -> Proc:
        return self.new_proc(app)

    @rule(
        proc=procs,
        max_samples=st.integers(1, 2),
        point=points(CREATE_POINTS)
        | st.sampled_from([p for p in CREATE_POINTS if "rollback" in p]),
        occurrence=st.integers(1, 2),
    )
    def create_proxy(
        self, proc: Proc, max_samples: int, point: str | None, occurrence: int
    ) -> None:
        if proc.alive:
            self.create(proc, max_samples, point, occurrence)

    @precondition(lambda self: self.provider_up)
    @rule(crash=st.sampled_from([None, "publish.claimed", "publish.written"]))
    def publish(self, crash: str | None) -> None:
        s = self.s
        slot = claim_slot(s.a, s.states, rounds=3)  # never more: a free slot must exist
        if crash is not None:
            self.provider_up = False  # killed with the slot IN_WRITING
            return
        self.head += 1
        commit_slot(s.a, s.layout, slot, self.head)

    @precondition(lambda self: not self.provider_up)
    @rule()
    def restart_provider(self) -> None:
        cleaned, head = clean_for_reuse(self.s.a, self.s.layout)
        assert cleaned == 1 and head == self.head
        self.provider_up = True

    @rule(data=st.data(), point=points(TAKE_POINTS))
    def take(self, data: st.DataObject, point: str | None) -> None:
        s = self.s
        proxies = [p for p in self.live_proxies() if len(p.held) < p.max_samples]
        ready = {s.seq_of(slot): slot for slot in range(GEOMETRY.slot_count)}
        ready.pop(0, None)
        ready.pop(SEQ_IN_WRITING, None)
        if not proxies or not ready:
            return
        proxy = data.draw(st.sampled_from(proxies))
        choices = sorted(seq for seq, slot in ready.items() if slot not in proxy.held)
        if not choices:
            return
        seq = data.draw(st.sampled_from(choices))
        s.arm(point)
        try:
            slot = reference(s.a, s.layout, proxy.log, seq)
        except Crash:
            self.die(proxy.proc)
            return
        finally:
            s.arm(None)
        if slot is not None:
            proxy.held[slot] = seq

    @rule(data=st.data(), point=points(RELEASE_POINTS))
    def release(self, data: st.DataObject, point: str | None) -> None:
        proxies = [p for p in self.live_proxies() if p.held]
        if not proxies:
            return
        proxy = data.draw(st.sampled_from(proxies))
        slot = data.draw(st.sampled_from(sorted(proxy.held)))
        s = self.s
        s.arm(point)
        try:
            dereference(s.a, s.layout, proxy.log, slot)
        except Crash:
            self.die(proxy.proc)
            return
        finally:
            s.arm(None)
        del proxy.held[slot]

    @rule(data=st.data(), point=points(CLOSE_POINTS))
    def close(self, data: st.DataObject, point: str | None) -> None:
        proxies = self.live_proxies()
        if not proxies:
            return
        proxy = data.draw(st.sampled_from(proxies))
        s = self.s
        s.arm(point)
        try:
            self.close_proxy(proxy)
        except Crash:
            self.die(proxy.proc)
        finally:
            s.arm(None)

    def close_proxy(self, proxy: Proxy) -> None:
        """What Subscription.close does to the shared state."""
        s = self.s
        for slot in sorted(proxy.held):
            dereference(s.a, s.layout, proxy.log, slot)
            del proxy.held[slot]
        log = proxy.log
        max_samples = log.max_samples
        log.unsubscribe_begin()
        txlog_module._crash("unsubscribe.begun", log.index)
        s.logs.subscription.unsubscribe(max_samples)
        txlog_module._crash("unsubscribe.released", log.index)
        log.unsubscribe_commit()
        txlog_module._crash("unsubscribe.committed", log.index)
        s.logs.unregister(log)
        proxy.proc.proxies.remove(proxy)

    @rule(proc=consumes(procs))
    def kill(self, proc: Proc) -> None:
        self.die(proc)

    @rule(point=points(RECLAIM_POINTS))
    def provider_reclaims(self, point: str | None) -> None:
        """The provider rolls back the logs of dead processes (issue 27): the same rollback
        as a restart's, run by the survivor; it may die inside it too (then that log is
        quarantined when it is found again)."""
        s = self.s
        s.arm(point)
        try:
            result = s.logs.reclaim_dead(self.alive, pid_namespace())
        except Crash:
            return
        finally:
            s.arm(None)
        assert set(result.quarantined) <= s.ambiguous, (result.quarantined, s.ambiguous)
        for index in result.reclaimed:
            assert s.logs.owner(index) == INVALID_OWNER, index
        for index in range(GEOMETRY.max_subscribers):  # no dead reader's log is left behind
            owner, process, _ = s.logs.owner_record(index)
            if owner != INVALID_OWNER and process.pid and index not in s.ambiguous:
                assert self.alive(process), (index, process)

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def refcounts_match_the_truth(self) -> None:
        if self.shared is None:
            return
        s = self.s
        for slot in range(GEOMETRY.slot_count):
            truth = sum(slot in refs for refs in s.refs.values())
            assert s.refcount(slot) == truth, (slot, s.refcount(slot), s.refs)
            if s.seq_of(slot) == SEQ_IN_WRITING:
                assert truth == 0, slot

    @invariant()
    def subscription_matches_the_truth(self) -> None:
        if self.shared is None:
            return
        s = self.s
        assert s.logs.subscription.state() == (len(s.subs), sum(s.subs.values())), s.subs

    @invariant()
    def logs_are_consistent(self) -> None:
        if self.shared is None:
            return
        s = self.s
        owners = [p.log.index for p in self.live_proxies()]
        assert len(owners) == len(set(owners)), owners
        for proxy in self.live_proxies():
            assert s.logs.owner(proxy.log.index) == proxy.proc.app
            assert proxy.log.subscription_state() == (1, 1)
            assert proxy.log.open_slots(GEOMETRY.slot_count) == dict.fromkeys(proxy.held, (1, 1))
            assert set(proxy.held) == s.refs[proxy.log.index]
        for index in range(GEOMETRY.max_subscribers):
            if s.logs.owner(index) == INVALID_OWNER:
                log = s.logs.logs[index]
                assert not log.contains_transactions(GEOMETRY.slot_count), index
                assert not s.refs[index] and index not in s.subs, index

    @invariant()
    def the_provider_can_always_claim_a_slot(self) -> None:
        if self.shared is None:
            return
        free = [slot for slot in range(GEOMETRY.slot_count) if self.s.refcount(slot) == 0]
        assert free, "every slot is referenced"

    # -- recovery -------------------------------------------------------------------------------

    def recover_everything(self) -> None:
        """Close every live proxy; restart every application until its dead logs are rolled
        back; then only the ambiguous logs may be left, and they are quarantined."""
        s = self.s
        for proxy in self.live_proxies():
            self.close_proxy(proxy)
        for proc in list(self.all_procs.values()):
            self.die(proc)
        for app in APPS:
            for attempt in range(GEOMETRY.max_subscribers + 1):  # a restart per left-over log
                owned = [i for i in range(GEOMETRY.max_subscribers) if s.logs.owner(i) == app]
                if not owned or (attempt and set(owned) <= s.ambiguous):
                    break
                proc = self.new_proc(app)
                proxy = self.create(proc, 1, None, 1)
                if proxy is not None:
                    self.close_proxy(proxy)
                self.die(proc)
        for index in range(GEOMETRY.max_subscribers):
            owner = s.logs.owner(index)
            if index in s.ambiguous:
                assert owner != INVALID_OWNER and s.logs.needs_rollback(index), index
            else:
                assert owner == INVALID_OWNER, (index, owner, s.ambiguous)
        for slot in range(GEOMETRY.slot_count):
            truth = sum(slot in refs for i, refs in s.refs.items() if i in s.ambiguous)
            assert s.refcount(slot) == truth
        self.refcounts_match_the_truth()
        self.subscription_matches_the_truth()


TxLogModel.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_transaction_log_model = TxLogModel.TestCase


# -- every crash point, deterministically ---------------------------------------------------------


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_every_crash_point_recovers_or_quarantines(point: str) -> None:
    """A proxy holding two batches crashes at `point` (during creation, a reference, a release,
    its close, or a later proxy's rollback of it); its application restarts. Unless the crash
    was mid-transaction, everything it held comes back; if it was, the log is quarantined and
    the restarted proxy is still created with another log."""
    model = TxLogModel()
    model.setup(backends()[0])
    s = model.s
    try:
        for _ in range(3):
            model.publish(None)
        holder = model.create(model.new_proc(1), 2, None, 1)
        assert holder is not None
        other = model.create(model.new_proc(2), 1, None, 1)  # never stalls, never disturbed
        assert other is not None
        crashed = drive_to(model, holder, point)
        assert crashed, f"{point} was not reached"
        restarted = model.create(model.new_proc(1), 2, None, 1)
        assert restarted is not None, "the restarted proxy must be created"
        model.take_seq(other, 1)
        model.refcounts_match_the_truth()
        model.subscription_matches_the_truth()
        quarantined = {
            i
            for i in range(GEOMETRY.max_subscribers)
            if s.logs.owner(i) == 1 and s.logs.needs_rollback(i)
        }
        if point in IN_TRANSACTION:
            assert quarantined == s.ambiguous and quarantined, point
        else:
            assert not quarantined and not s.ambiguous, point
            # Fully recovered: only the new proxy (nothing held) and the other one remain.
            assert s.logs.subscription.state() == (2, 3)
            assert sum(s.refcount(slot) for slot in range(GEOMETRY.slot_count)) == 1
    finally:
        model.teardown()


def drive_to(model: TxLogModel, holder: Proxy, point: str) -> bool:
    """Run the operations of `holder`'s life until the crash at `point`; True once crashed."""
    s = model.s
    s.arm(point)
    try:
        if point.startswith(("register", "subscribe")):
            model.die(holder.proc)  # the crash happens in a new run's creation
            proc = model.new_proc(1)
            s.arm(point)
            model.create(proc, 2, point, 1)
            return s.crashed_at == point
        if point.startswith("rollback"):
            model.take_seq(holder, 1)
            model.take_seq(holder, 2)
            model.die(holder.proc)
            model.create(model.new_proc(1), 2, point, 1)  # the first restart dies rolling back
            return s.crashed_at == point
        try:
            if point.startswith("reference"):
                model.take_seq(holder, 1)
                s.arm(point)
                reference(s.a, s.layout, holder.log, 2)
            elif point.startswith("dereference"):
                model.take_seq(holder, 1)
                s.arm(point)
                dereference(s.a, s.layout, holder.log, next(iter(holder.held)))
            else:  # unsubscribe and unregister: a clean close dies
                model.take_seq(holder, 1)
                s.arm(point)
                model.close_proxy(holder)
        except Crash:
            model.die(holder.proc)
            return True
        return False
    finally:
        s.arm(None)


def _take_seq(self: TxLogModel, proxy: Proxy, seq: int) -> None:
    s = self.s
    slot = reference(s.a, s.layout, proxy.log, seq)
    assert slot is not None
    proxy.held[slot] = seq


TxLogModel.take_seq = _take_seq  # type: ignore[attr-defined]


@given(st.lists(st.sampled_from(APPS), min_size=1, max_size=12))
def test_registration_hands_out_each_log_once(apps: list[int]) -> None:
    shared = Shared(backends()[0])
    try:
        taken = []
        for n, app in enumerate(apps):
            try:
                taken.append(shared.logs.register(app, ProcessIdentity(5000 + n, 1)).index)
            except MaxSubscribersError:
                assert len(taken) == GEOMETRY.max_subscribers
        assert len(taken) == len(set(taken)) == min(len(apps), GEOMETRY.max_subscribers)
    finally:
        shared.a.close()
