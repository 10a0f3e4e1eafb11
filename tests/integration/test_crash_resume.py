"""Consumers resume across a ``kill -9`` of the node (invariant 2).

Consumer A saved its session, went away, and resumes after the crash and restart from the JSON.
Consumer B was streaming live when the node died: it sees ``Disconnected``, reconnects on its own
and resumes from its in-memory session. An unclean restart adds a failover entry at the persisted
high seqno, so whoever saw unpersisted items must be rolled back; everyone must end with exactly
the server's state, having seen seqnos rise except right after a rollback.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from types import SimpleNamespace

import numpy as np
import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import DcpClient, SessionState
from changefeed.consumer.connection import ConnectionClosedError
from changefeed.consumer.session import VbSession
from changefeed.failover import FailoverLog
from support.clients import dcp_config, high_seqnos, kv_connect
from support.consumer import StreamedState, Until, drain, reached, stream_to_latest
from support.nodes import NodeFactory

from .harness import assert_resumed_after, assert_same_state, mark

pytestmark = pytest.mark.timeout(180)


def caught_up(truth: SessionState, targets: dict[int, int]) -> Until:
    """Every vbucket of the live consumer's application session is on the node's current
    branch (the newest failover uuid a fresh stream got, ``truth``) and at or past its high
    seqno (``targets``).

    The seqno alone (``reached``) is not enough after a crash: until it reconnects, a live
    consumer's session still holds what it received before the kill, which is often past the
    restarted node's high seqno (the writes the node lost). Its reconnect waits out a backoff
    that grew while the node was down, so the check passed before the consumer had been told
    to roll back and the changes it was about to drop were compared with the truth. The uuid
    moves only when the session takes a stream opened on the restarted node, which comes after
    the rollback the node answered first."""
    return lambda client, state: all(
        client.session.get(vb).vb_uuid == truth.get(vb).vb_uuid
        and client.session.get(vb).seqno >= high
        for vb, high in targets.items()
    )


async def truth_of(node: NodeProcess) -> tuple[StreamedState, SessionState]:
    """What a fresh consumer streaming everything receives, and the session it ends with."""
    state, session = await stream_to_latest(node)
    assert not state.rollbacks, state.rollbacks
    return state, session


def test_caught_up_waits_for_the_restarted_node() -> None:
    """A session past the node's high seqno but still on the branch the crash ended is not
    caught up; once it took the rollback and the new branch's stream, it is."""
    old, new = (11, 0), (22, 90)  # the restart added (22, 90): items after 90 were lost
    live = SessionState({0: VbSession(0, seqno=120, snap_start=100, snap_end=120)})
    live.get(0).failover_log = FailoverLog([old])
    truth = SessionState({0: VbSession(0, seqno=95, snap_start=95, snap_end=95)})
    truth.get(0).failover_log = FailoverLog([new, old])
    client = SimpleNamespace(session=live)
    targets = {0: 95}
    assert reached(targets)(client, StreamedState())  # type: ignore[arg-type]  # fooled
    assert not caught_up(truth, targets)(client, StreamedState())  # type: ignore[arg-type]
    live.get(0).rollback_to(90)
    live.get(0).failover_log = FailoverLog([new, old])  # the new branch's stream opened
    assert not caught_up(truth, targets)(client, StreamedState())  # type: ignore[arg-type]
    live.get(0).on_items(np.array([93, 95], dtype=np.uint64))
    assert caught_up(truth, targets)(client, StreamedState())  # type: ignore[arg-type]


def test_resume_after_kill_9(nodes: NodeFactory, rng: random.Random) -> None:
    node = nodes(vbuckets=8)
    vbs = list(range(8))

    async def scenario() -> None:
        certain: dict[bytes, bytes | None] = {}  # persisted writes: must survive the crash
        async with await kv_connect(node) as kv:
            items = [(b"a-%05d" % i, b"A" * rng.randrange(1, 120)) for i in range(3000)]
            await kv.upsert_many(items, durability="persist")
            certain.update(items)

        streamed_a, session_a = await stream_to_latest(node)
        saved_a = session_a.to_json()

        # Consumer B follows live (no end seqno) through everything that comes next.
        client_b = DcpClient(dcp_config(node, to_latest=False, buffer_bytes=256 * 1024))
        await client_b.connect()
        await client_b.stream(vbs)
        streamed_b = StreamedState()
        task_b = asyncio.get_running_loop().create_task(
            drain(client_b, streamed_b, lambda c, m: False, timeout_s=120)
        )

        async with await kv_connect(node) as kv:
            for i in range(2000):  # updates and deletes, persisted
                key = b"a-%05d" % rng.randrange(3000)
                if rng.random() < 0.2 and certain.get(key) is not None:
                    await kv.remove(key)
                    certain[key] = None
                else:
                    value = b"B%d" % i
                    await kv.upsert(key, value)
                    certain[key] = value
            await kv.upsert_many([(k, v) for k, v in certain.items() if v], durability="persist")

        # A burst of writes that may be acknowledged but not persisted when the node dies.
        uncertain: dict[bytes, set[bytes]] = {}

        async def burst() -> None:
            with contextlib.suppress(ConnectionClosedError, ConnectionError, OSError):
                async with await kv_connect(node) as kv:
                    for n in range(10**6):
                        key = b"c-%05d" % rng.randrange(20000)
                        uncertain.setdefault(key, set()).add(b"C%d" % n)
                        await kv.upsert_many([(key, b"C%d" % n)])

        writer = asyncio.get_running_loop().create_task(burst())
        await asyncio.sleep(0.5 + rng.random())
        node.kill()
        await asyncio.wait_for(writer, 30)
        node.start()  # same data directory, same port: B reconnects by itself

        async with await kv_connect(node) as kv:  # after the restart: a new branch
            items = [(b"d-%05d" % i, b"D%d" % i) for i in range(1500)]
            await kv.upsert_many(items, durability="persist")
            certain.update(items)

        truth, truth_session = await truth_of(node)
        live = truth.values()
        for key, value in certain.items():  # every persisted write survived the crash
            assert live.get(key) == value, (key, value, live.get(key))
        for key in set(live) - set(certain):
            assert key in uncertain and live[key] in uncertain[key], key

        # A resumes from its saved JSON: every change after its state, or a rollback first.
        marked = mark(streamed_a)
        streamed_a, _ = await stream_to_latest(
            node, start=SessionState.from_json(saved_a), state=streamed_a
        )
        assert_resumed_after(streamed_a, marked, SessionState.from_json(saved_a))
        assert_same_state(streamed_a, truth, what="consumer A (saved session)")

        # B catches up to the new high seqnos after its automatic reconnect.
        targets = await high_seqnos(node)
        async with asyncio.timeout(60):
            while not caught_up(truth_session, targets)(client_b, streamed_b):
                assert not task_b.done(), task_b
                await asyncio.sleep(0.05)
        task_b.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task_b
        await client_b.close()
        assert streamed_b.disconnects >= 1
        assert_same_state(streamed_b, truth, what="consumer B (live through the crash)")
        print(f"A rollbacks {streamed_a.rollbacks}; B rollbacks {streamed_b.rollbacks}")

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def run_crash_cycles(
    nodes: NodeFactory,
    rng: random.Random,
    cycles: int,
    reconnect_backoff_s: tuple[float, ...] = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
) -> None:
    """Repeated write / kill -9 / restart cycles under one live consumer that reconnects by
    itself, and one consumer that saves its session each cycle and comes back from the JSON."""
    node = nodes(vbuckets=8)
    vbs = list(range(8))

    async def scenario() -> None:
        live = DcpClient(
            dcp_config(
                node,
                to_latest=False,
                buffer_bytes=128 * 1024,
                reconnect_backoff_s=reconnect_backoff_s,
            )
        )
        await live.connect()
        await live.stream(vbs)
        live_streamed = StreamedState()
        live_task = asyncio.get_running_loop().create_task(
            drain(live, live_streamed, lambda c, m: False, timeout_s=600)
        )
        saved = None
        saver = StreamedState()
        for cycle in range(cycles):

            async def writes(cycle: int = cycle) -> None:
                with contextlib.suppress(ConnectionClosedError, ConnectionError, OSError):
                    async with await kv_connect(node) as kv:
                        for n in range(10**6):
                            batch = [
                                (b"key-%04d" % rng.randrange(5000), b"c%d-%d" % (cycle, n))
                                for _ in range(rng.choice([1, 10, 100]))
                            ]
                            if rng.random() < 0.1:
                                with contextlib.suppress(Exception):
                                    await kv.remove(batch[0][0])
                            await kv.upsert_many(batch)

            writer = asyncio.get_running_loop().create_task(writes())
            await asyncio.sleep(rng.uniform(0.1, 0.6))
            if cycle % 2:  # the saver comes and goes from its JSON while the node is busy
                start = SessionState.from_json(saved) if saved else "beginning"
                marked = mark(saver)
                saver, session = await stream_to_latest(node, start=start, state=saver)
                if saved:
                    assert_resumed_after(saver, marked, SessionState.from_json(saved))
                saved = session.to_json()
            node.kill()
            await asyncio.wait_for(writer, 30)
            assert not live_task.done(), live_task
            node.start()
        truth, truth_session = await truth_of(node)
        targets = await high_seqnos(node)
        async with asyncio.timeout(120):
            while not caught_up(truth_session, targets)(live, live_streamed):
                assert not live_task.done(), live_task
                await asyncio.sleep(0.05)
        live_task.cancel()
        await asyncio.gather(live_task, return_exceptions=True)
        await live.close()
        assert_same_state(live_streamed, truth, what="live consumer through the crashes")
        start = SessionState.from_json(saved) if saved else "beginning"
        saver, _ = await stream_to_latest(node, start=start, state=saver)
        assert_same_state(saver, truth, what="consumer resuming from JSON each cycle")
        print(
            f"{cycles} crashes: live saw {live_streamed.disconnects} disconnects, "
            f"{len(live_streamed.rollbacks)} rollbacks; saver {len(saver.rollbacks)} rollbacks"
        )

    asyncio.run(scenario())
    assert node.errors_in_log() == []


def test_crash_cycles(nodes: NodeFactory, rng: random.Random) -> None:
    run_crash_cycles(nodes, rng, 3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_crash_cycles_long(nodes: NodeFactory, rng: random.Random) -> None:
    run_crash_cycles(nodes, rng, 30)


def test_crash_cycles_slow_reconnect(nodes: NodeFactory, rng: random.Random) -> None:
    """The live consumer reconnects 1-3 s after each loss, long after the node is back: the
    check must wait for it (``caught_up``). Judged by seqnos alone (``reached``) this failed
    2 runs in 3, whenever the consumer had received writes the node had not persisted; with
    the usual backoff it was CI's occasional failure of ``test_crash_cycles``."""
    run_crash_cycles(nodes, rng, 1, reconnect_backoff_s=(2.0,))
