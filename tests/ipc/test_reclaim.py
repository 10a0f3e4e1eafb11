"""Dead readers reclaimed without their restart (issue 27, item 2).

Readers killed with -9 that never come back: the provider notices (recorded pid and start
time), rolls their transaction logs back itself and their slots, subscriber seats and slot
budget come back within RECLAIM_BOUND_S, while the other readers read and a new reader
subscribes. A reader that is alive but stalled (SIGSTOP) is not touched. A dead reader whose
restart races the provider's reclaim is rolled back once (the rollback lock).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from changefeed.consumer import ClientConfig
from changefeed.ipc import Geometry, MaxSubscribersError, subscribe
from changefeed.ipc.layout import (
    INVALID_OWNER,
    NODE_OWNER_PID,
    NODE_OWNER_PIDNS,
    NODE_OWNER_START,
)
from changefeed.ipc.local_stream import LocalStream, high_seqnos
from changefeed.ipc.provider import RECLAIM_BOUND_S
from changefeed.ipc.txlog import ProcessIdentity, TransactionLogSet, pid_namespace
from ipc.test_crash import Publisher, Spawn, finish, progress_after, reader
from ipc.test_node_wiring import dcp_rows, load, shm_node
from support.nodes import NodeFactory

# 6 readers at most, a budget of 15 slots: 3 live readers (2 each) and 3 dead holders (2 each)
# fill every seat; before the reclaim a new reader got MaxSubscribersError until a restart.
GEOMETRY = Geometry(slot_count=16, slot_bytes=64 * 1024, max_subscribers=6, group=(0, 1))


@pytest.fixture
def reclaiming(service: str, ipc_dir: Path) -> Iterator[Publisher]:
    pub = Publisher(service, ipc_dir, reclaim=True, geometry=GEOMETRY)
    yield pub
    if not pub._stop.is_set():
        pub.stop()


def wait_until(condition: object, bound_s: float) -> float:
    """Seconds until `condition()` held; fails past `bound_s`."""
    assert callable(condition)
    start = time.monotonic()
    while not condition():
        elapsed = time.monotonic() - start
        assert elapsed <= bound_s, f"not within {bound_s} s"
        time.sleep(0.005)
    return time.monotonic() - start


def test_readers_killed_for_good_are_reclaimed_while_others_read(
    reclaiming: Publisher, children: Spawn, ipc_dir: Path, service: str
) -> None:
    live = [reader(children, ipc_dir, service, app) for app in (1, 2, 3)]
    for child in live:
        child.wait_for("subscribed")
    holders = [reader(children, ipc_dir, service, app, "--hold", "2") for app in (4, 5, 6)]
    held = [slot for child in holders for slot in child.wait_for("holding")["slots"]]
    assert reclaiming.provider.subscription() == (6, 12)
    with pytest.raises(MaxSubscribersError):
        subscribe(service, directory=ipc_dir, app_id=7).close()
    seen = [progress_after(child, 0) for child in live]
    # kill -9, not reaped for the first two (zombies: dead, whatever their parent does)
    killed_at = time.monotonic()
    for child in holders[:2]:
        os.kill(child.pid, signal.SIGKILL)
    holders[2].kill()
    reclaimed_s = wait_until(lambda: reclaiming.provider.subscription() == (3, 6), RECLAIM_BOUND_S)
    assert sum(reclaiming.refcounts()) <= 3 * 2  # only what the live readers may hold
    assert reclaiming.provider.stats["reclaimed"] == 3
    assert reclaiming.provider.stats["reclaimed_slots"] == len(held) == 6
    owners = reclaiming.owners()
    assert sorted(o for o in owners if o != INVALID_OWNER) == [1, 2, 3]
    # a new reader subscribes at once, and everyone goes on reading with no gap
    newcomer = reader(children, ipc_dir, service, 8)
    created = newcomer.wait_for("subscribed")
    assert created["rolled_back"] is None and created["candidates"] == []
    subscribed_s = time.monotonic() - killed_at
    progress_after(newcomer, 0)
    for child, count in zip(live, seen, strict=True):
        progress_after(child, count + 25)
    for child in [*live, newcomer]:
        finish(child)
    assert reclaiming.provider.subscription() == (0, 0)
    assert reclaiming.refcounts() == [0] * GEOMETRY.slot_count
    print(
        f"3 dead readers reclaimed in {reclaimed_s * 1000:.0f} ms; new reader in "
        f"{subscribed_s * 1000:.0f} ms after the kill"
    )


def test_an_idle_provider_reclaims_too(
    reclaiming: Publisher, children: Spawn, ipc_dir: Path, service: str
) -> None:
    holder = reader(children, ipc_dir, service, 4, "--hold", "2")
    holder.wait_for("holding")
    reclaiming._pause.set()  # nothing published: only the loop's maintain() runs
    holder.kill()
    wait_until(lambda: reclaiming.provider.subscription() == (0, 0), RECLAIM_BOUND_S)
    assert reclaiming.refcounts() == [0] * GEOMETRY.slot_count


def test_a_stalled_reader_is_not_reclaimed(
    reclaiming: Publisher, children: Spawn, ipc_dir: Path, service: str
) -> None:
    """SIGSTOP: alive, so today's policy: it keeps its log, budget and the slots it holds (at
    most max_samples), the provider writes around them, the others read on; resumed, it goes
    on (behind the ring: it lost batches and says so)."""
    other = reader(children, ipc_dir, service, 1)
    other.wait_for("subscribed")
    stalled = reader(children, ipc_dir, service, 2)
    stalled.wait_for("subscribed")
    progress_after(stalled, 0)
    os.kill(stalled.pid, signal.SIGSTOP)
    try:
        seen = progress_after(other, 0)
        time.sleep(3 * RECLAIM_BOUND_S)
        assert reclaiming.provider.subscription() == (2, 4)
        assert reclaiming.provider.stats["reclaimed"] == 0
        assert sum(reclaiming.refcounts()) <= 2 + 2
        progress_after(other, seen + 25)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
    stalled.wait_for("lost")
    progress_after(stalled, 0)
    finish(stalled)
    finish(other)
    assert reclaiming.provider.subscription() == (0, 0)


def test_a_dead_readers_restart_racing_the_reclaim_rolls_back_once(
    reclaiming: Publisher, children: Spawn, ipc_dir: Path, service: str
) -> None:
    """The restart and the provider both see the dead log; the rollback lock lets one of them
    roll it back: the subscription state never goes below the live readers' (a second
    rollback would release the references and the budget twice)."""
    other = reader(children, ipc_dir, service, 1)
    other.wait_for("subscribed")
    for _ in range(6):
        holder = reader(children, ipc_dir, service, 2, "--hold", "2")
        holder.wait_for("holding")
        holder.kill()
        restarted = reader(children, ipc_dir, service, 2)  # at once: inside the reclaim interval
        created = restarted.wait_for("subscribed")
        assert created["quarantined"] == [], created
        progress_after(restarted, 0)
        assert reclaiming.provider.subscription() == (2, 4)
        finish(restarted)
        assert reclaiming.provider.subscription() == (1, 2)
    finish(other)
    assert reclaiming.provider.subscription() == (0, 0)
    assert reclaiming.refcounts() == [0] * GEOMETRY.slot_count
    assert reclaiming.owners() == [INVALID_OWNER] * GEOMETRY.max_subscribers


def test_a_log_from_another_pid_namespace_is_left_to_its_restart(
    reclaiming: Publisher, ipc_dir: Path, service: str
) -> None:
    """A pid recorded in another pid namespace says nothing here: such a log is never judged
    dead by the provider (here: a log whose namespace is not ours, and whose pid is free)."""
    sub = subscribe(service, directory=ipc_dir, app_id=9, max_samples=1)
    logs: TransactionLogSet = reclaiming.provider.logs
    node = logs.logs[sub.log_index].node
    a = reclaiming.provider._a
    assert a.load_u64(node + NODE_OWNER_PIDNS) == pid_namespace() != 0
    dead = ProcessIdentity(2**22 - 7, 12345)  # no such process
    a.store_u32(node + NODE_OWNER_PID, dead.pid)
    a.store_u64(node + NODE_OWNER_START, dead.start_time)
    a.store_u64(node + NODE_OWNER_PIDNS, pid_namespace() + 1)
    time.sleep(3 * RECLAIM_BOUND_S / 2)
    assert logs.owner(sub.log_index) == 9 and reclaiming.provider.stats["reclaimed"] == 0
    a.store_u64(node + NODE_OWNER_PIDNS, pid_namespace())  # same namespace: dead, reclaimed
    wait_until(lambda: logs.owner(sub.log_index) == INVALID_OWNER, RECLAIM_BOUND_S)
    assert reclaiming.provider.subscription() == (0, 0)
    sub._closed = True  # its log is gone: closing would unsubscribe a second time
    sub._a.close()
    sub._control.close()
    sub._data.close()
    sub._usage.close()


async def write_until(port: int, done: asyncio.Future[object]) -> None:
    """Small writes (a batch each, about) until `done`, then 500 more."""
    round_ = 0
    while not done.done():
        await load(port, 20, prefix=f"a{round_}-", size=20)
        round_ += 1
    await load(port, 500, prefix="b", size=20)


def rows_of(batch: pa.RecordBatch) -> list[tuple[int, int]]:
    columns = [batch.column(name).to_pylist() for name in ("vbucket", "seqno")]
    return list(zip(*columns, strict=True))


def test_the_node_reclaims_readers_killed_for_good(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path, children: Spawn
) -> None:
    """A real node: one local reader reads every change while two readers holding batches are
    killed -9 for good; every seat was taken, and a new reader subscribes within the bound."""
    node = shm_node(
        nodes, ipc_dir, tmp_path, shm_slots=8, shm_max_subscribers=3, shm_persisted_only="false"
    )
    service = f"default-{node.port}-g0"

    async def main() -> float:
        config = ClientConfig(port=node.port)
        local = LocalStream(service, directory=ipc_dir, app_id=1, dcp=config, start="beginning")
        got: list[tuple[int, int]] = []
        ends: asyncio.Future[dict[int, int]] = asyncio.get_running_loop().create_future()

        async def read() -> None:  # the live reader, all along
            while not ends.done() or any(
                local.session is None or local.session.get(vb).seqno < ends.result()[vb]
                for vb in local.group
            ):
                batch = await local.next_batch(0.01)
                if batch is not None:
                    got.extend(rows_of(batch))

        reading = asyncio.create_task(read())
        try:
            holders = [reader(children, ipc_dir, service, app, "--hold", "2") for app in (2, 3)]
            holding = asyncio.gather(
                *(asyncio.to_thread(child.wait_for, "holding") for child in holders)
            )
            writing = asyncio.create_task(write_until(node.port, holding))
            await holding
            with pytest.raises(MaxSubscribersError):
                subscribe(service, directory=ipc_dir, app_id=4).close()
            for child in holders:
                child.kill()
            killed_at = time.monotonic()
            while True:  # the node reclaims them; the local reader reads on meanwhile
                try:
                    newcomer = subscribe(service, directory=ipc_dir, app_id=4)
                    break
                except MaxSubscribersError:
                    assert time.monotonic() - killed_at <= RECLAIM_BOUND_S
                await asyncio.sleep(0.005)
            reclaimed_s = time.monotonic() - killed_at
            assert newcomer.report.rollback.rolled_back is None
            newcomer.close()
            await writing
            ends.set_result(await high_seqnos(config))
            await asyncio.wait_for(reading, 60)
        finally:
            reading.cancel()
            local.close()
        reference = sorted((vb, seqno) for vb, seqno, *_ in await dcp_rows(node.port))
        assert sorted(got) == [row for row in reference if row[0] in local.group]
        return reclaimed_s

    reclaimed_s = asyncio.run(main())
    print(f"node reclaimed 2 dead readers; a new one subscribed {reclaimed_s * 1000:.0f} ms later")
    assert "died; its log" in node.log_tail(60)
