"""kill -9 in real processes: readers holding batches or mid-subscribe, the provider mid-publish.

Readers are child processes (tests/ipc/child.py) that check every batch follows the one before
(seq and row seqno) and report gaps. The provider runs in this process (a publishing thread) or
as a child when it is the one killed. A crash at an exact step uses the child's ``--crash-at``
(it SIGKILLs itself at that crash point); other kills are plain SIGKILLs at any moment.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from changefeed.ipc import Geometry
from changefeed.ipc.layout import INVALID_OWNER, REFCOUNT_MASK
from changefeed.ipc.provider import RECLAIM_INTERVAL_S, Provider
from changefeed.ipc.segments import Segment, ServicePaths
from ipc.child import positions_for, rows_batch
from ipc.helpers import Child

GROUP = (0, 1)
GEOMETRY = Geometry(slot_count=16, slot_bytes=64 * 1024, max_subscribers=6, group=GROUP)
Spawn = Callable[..., Child]


class Publisher:
    """The provider in this process: a thread publishing 20-row batches every 2 ms.

    ``reclaim``: the provider reclaims dead readers itself (off here by default: these tests
    check the seed's path, a restarted reader rolling back its predecessor's log;
    test_reclaim.py checks the provider's).
    """

    def __init__(
        self,
        service: str,
        directory: Path,
        *,
        reclaim: bool = False,
        geometry: Geometry | None = None,
    ) -> None:
        self.geometry = geometry or GEOMETRY
        self.provider = Provider.offer(
            service,
            self.geometry,
            directory=directory,
            bucket="default",
            reclaim_interval_s=RECLAIM_INTERVAL_S if reclaim else None,
        )
        self.pause_s = 0.002
        self._stop = threading.Event()
        self._pause = threading.Event()
        self.seqno = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.provider.handle_control()
            if not self._pause.is_set():
                first = self.seqno + 1
                self.provider.publish(
                    rows_batch(first, 20, 50), positions_for(GROUP, first, first + 19)
                )
                self.seqno += 20
            else:
                self.provider.maintain()  # an idle publisher still reclaims dead readers
            time.sleep(self.pause_s)

    def refcounts(self) -> list[int]:
        a, layout = self.provider._a, self.provider.layout
        return [
            a.load_u64(layout.slot_state(i)) & REFCOUNT_MASK
            for i in range(self.geometry.slot_count)
        ]

    def owners(self) -> list[int]:
        return [self.provider.logs.owner(i) for i in range(self.geometry.max_subscribers)]

    def stop(self) -> bool:
        self._stop.set()
        self.thread.join(5)
        return self.provider.stop_offer()


@pytest.fixture
def publisher(service: str, ipc_dir: Path) -> Iterator[Publisher]:
    pub = Publisher(service, ipc_dir)
    yield pub
    if not pub._stop.is_set():
        pub.stop()


def reader(spawn: Spawn, ipc_dir: Path, service: str, app: int, *extra: str) -> Child:
    return spawn("reader", "--dir", str(ipc_dir), "--service", service, "--app", str(app), *extra)


def progress_after(child: Child, batches: int) -> int:
    """Wait until `child` reports more than `batches` batches read; returns its count."""
    while True:
        event = child.wait_for("progress")
        if event["batches"] > batches:
            return int(event["batches"])


def finish(child: Child) -> dict[str, object]:
    child.terminate()
    done = child.wait_for("done")
    assert done["gaps"] == 0, done
    return done


def test_kill_a_proxy_holding_references(
    publisher: Publisher, children: Spawn, ipc_dir: Path, service: str
) -> None:
    other = reader(children, ipc_dir, service, 2)
    other.wait_for("subscribed")
    holder = reader(children, ipc_dir, service, 1, "--hold", "2")
    first_log = holder.wait_for("subscribed")["log"]
    held = holder.wait_for("holding")["slots"]
    assert all(publisher.refcounts()[slot] >= 1 for slot in held)
    holder.kill()
    # Dead, its references and budget stay; the provider goes around them and the other reader
    # never stalls.
    seen = progress_after(other, 0)
    assert publisher.provider.subscription() == (2, 4)
    assert all(publisher.refcounts()[slot] >= 1 for slot in held)
    seen = progress_after(other, seen + 25)
    restarted = reader(children, ipc_dir, service, 1)
    created = restarted.wait_for("subscribed")
    assert created["rolled_back"] == first_log and created["released"] == 2, created
    assert created["outdated"] == holder.pid and created["quarantined"] == []
    assert publisher.provider.subscription() == (2, 4)
    progress_after(restarted, 0)
    progress_after(other, seen)
    deadline = time.monotonic() + 30  # generous: CPU load
    while publisher.provider.stats["outdated_pids"] != 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the notice went over the control socket
    assert publisher.provider.stats["outdated_pids"] == 1
    finish(restarted)
    finish(other)
    assert publisher.provider.subscription() == (0, 0)
    assert publisher.refcounts() == [0] * GEOMETRY.slot_count
    assert publisher.owners() == [INVALID_OWNER] * GEOMETRY.max_subscribers


# A crash inside the subscribe transaction (or inside a rollback's decrement) leaves BEGIN != END:
# that log is quarantined (fail closed), the rest recovers, the restarted proxy is created.
MID_SUBSCRIBE = {
    "register.acquired": False,
    "subscribe.begun": True,
    "subscribe.taken": True,
    "subscribe.committed": False,
    "rollback.slot_released": True,
    "rollback.unsubscribe_released": True,
}


@pytest.mark.parametrize("point", sorted(MID_SUBSCRIBE))
def test_kill_a_proxy_mid_subscribe(
    publisher: Publisher, children: Spawn, ipc_dir: Path, service: str, point: str
) -> None:
    other = reader(children, ipc_dir, service, 2)
    other.wait_for("subscribed")
    if point.startswith("rollback"):  # a holder dies; its restart dies while rolling it back
        holder = reader(children, ipc_dir, service, 1, "--hold", "2")
        holder.wait_for("holding")
        holder.kill()
    crashed = reader(children, ipc_dir, service, 1, "--crash-at", point)
    assert crashed.wait_for("crashing")["point"] == point
    crashed.exited()
    seen = progress_after(other, 0)
    restarted = reader(children, ipc_dir, service, 1)
    created = restarted.wait_for("subscribed")
    quarantined = created["quarantined"]
    assert bool(quarantined) == MID_SUBSCRIBE[point], created
    progress_after(restarted, 0)
    progress_after(other, seen)
    finish(restarted)
    finish(other)
    subscribers, slots = publisher.provider.subscription()
    owned = [i for i, owner in enumerate(publisher.owners()) if owner != INVALID_OWNER]
    if not quarantined:  # fully recovered: slots and budget
        assert (subscribers, slots) == (0, 0) and owned == []
        assert publisher.refcounts() == [0] * GEOMETRY.slot_count
    else:  # what a quarantined log may keep: its log, its subscription, one reference
        assert owned == quarantined
        assert subscribers <= 1 and slots <= 2 and sum(publisher.refcounts()) <= 1


def test_kill_proxies_at_random_moments(
    publisher: Publisher, children: Spawn, ipc_dir: Path, service: str
) -> None:
    """Plain kill -9 of a busy reader, five times: every restart is created and the other
    reader never stalls; whatever was not caught mid-transaction is given back."""
    other = reader(children, ipc_dir, service, 2)
    other.wait_for("subscribed")
    seen = 0
    quarantined: set[int] = set()
    for _ in range(5):
        victim = reader(children, ipc_dir, service, 1)
        quarantined |= set(victim.wait_for("subscribed")["quarantined"])
        progress_after(victim, 0)
        victim.kill()
        seen = progress_after(other, seen)
    last = reader(children, ipc_dir, service, 1)
    quarantined |= set(last.wait_for("subscribed")["quarantined"])
    finish(last)
    finish(other)
    owned = {i for i, owner in enumerate(publisher.owners()) if owner != INVALID_OWNER}
    assert owned <= quarantined | {i for i in owned if publisher.provider.logs.needs_rollback(i)}
    subscribers, _ = publisher.provider.subscription()
    assert subscribers <= len(owned) and sum(publisher.refcounts()) <= len(owned)


# The provider publishes on its own pace, never waiting for readers: a reader descheduled for
# longer than the ring lasts (16 slots x 2 ms by default) loses data, which a loaded machine
# did (lost 1 in a run beside two busy loops). The tests that check nothing is lost across a
# provider restart give the ring 128 slots and 5 ms a batch (0.64 s of reader stall).
PACED = ("--slots", "128", "--interval", "0.005")


def test_kill_the_provider_mid_publish_while_proxies_read(
    children: Spawn, ipc_dir: Path, service: str
) -> None:
    args = ("--dir", str(ipc_dir), "--service", service, *PACED)
    provider = children("provider", *args, "--crash-at", "publish.claimed", "--crash-after", "1000")
    assert provider.wait_for("offered")["reused"] is False
    readers = [reader(children, ipc_dir, service, app) for app in (1, 2)]
    for child in readers:
        child.wait_for("subscribed")
        progress_after(child, 0)
    provider.wait_for("crashing")
    provider.exited()
    before = [progress_after(child, 0) for child in readers]
    time.sleep(0.3)  # readers wait on a dead provider: nothing new, nothing broken
    restarted = children("provider", *args)
    offered = restarted.wait_for("offered")
    assert offered["reused"] is True and offered["cleaned"] == 1, offered
    assert offered["head"] == 999
    for child, count in zip(readers, before, strict=True):
        progress_after(child, count + 50)  # going on, across the restart
    for child in readers:
        done = finish(child)
        assert done["lost"] == 0, done
    restarted.terminate()
    assert restarted.wait_for("stopped")["removed"] is True
    paths = ServicePaths(service, ipc_dir)
    assert not Segment.exists(paths.control_segment) and not list(ipc_dir.iterdir())


def test_kill_the_provider_at_a_random_moment(children: Spawn, ipc_dir: Path, service: str) -> None:
    args = ("--dir", str(ipc_dir), "--service", service, *PACED)
    provider = children("provider", *args)
    provider.wait_for("offered")
    child = reader(children, ipc_dir, service, 1)
    child.wait_for("subscribed")
    seen = progress_after(child, 10)
    provider.kill()
    restarted = children("provider", *args)
    assert restarted.wait_for("offered")["reused"] is True
    progress_after(child, seen + 50)
    assert finish(child)["lost"] == 0
    restarted.terminate()
    assert restarted.wait_for("stopped")["removed"] is True


def test_two_providers_for_one_service(children: Spawn, ipc_dir: Path, service: str) -> None:
    args = ("--dir", str(ipc_dir), "--service", service)
    first = children("provider", *args)
    pid = first.wait_for("offered")["pid"]
    second = children("provider", *args)
    refused = second.wait_for("refused")
    assert refused["error"] == "ProviderExistsError" and f"pid {pid}" in refused["message"]
    first.kill()
    third = children("provider", *args)  # the lock went with the dead provider
    assert third.wait_for("offered")["reused"] is False  # no proxy: created afresh
    third.terminate()
    assert third.wait_for("stopped")["removed"] is True


def test_many_processes_register_at_once(
    publisher: Publisher, children: Spawn, ipc_dir: Path, service: str
) -> None:
    at = str(time.time() + 2.0)  # every child subscribes at this moment
    racers = [
        children(
            "register", "--dir", str(ipc_dir), "--service", service, "--app", str(app), "--at", at
        )
        for app in range(GEOMETRY.max_subscribers + 2)
    ]
    outcomes = [child.wait_for("registered", "refused") for child in racers]
    logs = [o["log"] for o in outcomes if o["event"] == "registered"]
    refused = [o for o in outcomes if o["event"] == "refused"]
    assert sorted(logs) == list(range(GEOMETRY.max_subscribers)), outcomes
    assert len(refused) == 2 and all(o["error"] == "MaxSubscribersError" for o in refused)
    owners = publisher.owners()
    assert len(set(owners)) == GEOMETRY.max_subscribers  # each log owned by a distinct app
    assert publisher.provider.subscription() == (GEOMETRY.max_subscribers, GEOMETRY.max_subscribers)
    for child in racers:
        child.terminate()
    assert publisher.provider.subscription() == (0, 0)
    assert publisher.owners() == [INVALID_OWNER] * GEOMETRY.max_subscribers
