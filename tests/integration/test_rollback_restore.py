"""Diverged history: the node's data directory goes back to an older copy, then takes new writes.

1. write W0; stop cleanly and copy the data directory (OLD) -- or (``frozen``) copy it from the
   running node frozen with SIGSTOP, as a volume snapshot would: that copy is marked unclean;
2. (start;) write W1; the consumer consumes everything and saves its session;
3. stop; restore OLD; start; write W2 (different keys and values: a diverged history);
4. the consumer resumes from its saved session. It has W1 items the node no longer has, so it
   must be told to roll back, and must end with exactly the node's state (compared with a fresh
   client streaming from the beginning).

``shape`` is how the consumer got to step 2: ``one-stream`` streams everything from the beginning
once after W1 (a deduplicated disk snapshot from 0); ``incremental`` followed along (it consumed
W0 before the copy and resumed for W1, so it holds a snapshot ending exactly at the restore
point). ``w2`` is how W2 compares with W1 per vbucket: ``shorter`` leaves the node's high seqno
below the consumer's, ``longer`` takes it above.

Two bugs these cases found are fixed: a copy taken after a clean stop now reads as unclean once
restored (the store checks that its data file is the one it closed, so the node starts a new
branch), and the consumer library rolls back to its newest whole snapshot at or below the node's
rollback seqno (inside a deduplicated snapshot an arbitrary seqno is not a consistent point).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from changefeed.consumer import SessionState
from support.clients import high_seqnos, kv_connect, upsert_retrying
from support.consumer import StreamedState, server_state, stream_to_latest
from support.nodes import NodeFactory

from .harness import assert_resumed_after, assert_same_state, mark

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    ("copy", "shape", "w2"),
    [
        ("stopped", "one-stream", "shorter"),  # the literal scenario
        ("stopped", "incremental", "shorter"),
        ("stopped", "incremental", "longer"),
        ("frozen", "one-stream", "shorter"),  # the rollback point lies inside a dedup snapshot
        ("frozen", "incremental", "shorter"),
    ],
    ids=lambda value: str(value),
)
def test_rollback_after_restoring_an_old_copy(
    nodes: NodeFactory, rng: random.Random, copy: str, shape: str, w2: str
) -> None:
    node = nodes(vbuckets=8)
    old_copy = node.root / "old-copy"

    async def scenario() -> None:
        streamed = StreamedState()
        session = None
        async with await kv_connect(node) as kv:
            w0 = [(b"k-%05d" % i, b"W0-%d" % i) for i in range(2000)]
            await upsert_retrying(kv, w0, durability="persist")
        if shape == "incremental":
            streamed, session = await stream_to_latest(node, state=streamed)

        if copy == "stopped":
            node.stop()
            node.copy_data(old_copy)
            node.start()
        else:
            node.snapshot_data(old_copy)
        high_old = await high_seqnos(node)

        async with await kv_connect(node) as kv:
            w1 = [(b"k-%05d" % rng.randrange(4000), b"W1-%d" % i) for i in range(2400)]
            await upsert_retrying(kv, w1, durability="persist")
            for _ in range(300):
                key = b"k-%05d" % rng.randrange(2000)
                if (await kv.upsert(key, b"W1-x")).seqno and rng.random() < 0.3:
                    await kv.remove(key)
        streamed, session = await stream_to_latest(
            node, start=session or "beginning", state=streamed
        )
        high_w1 = await high_seqnos(node)
        saved = session.to_json()

        node.stop()
        node.restore_data(old_copy)
        node.start()
        assert await high_seqnos(node) == high_old
        count = 600 if w2 == "shorter" else 6000
        async with await kv_connect(node) as kv:
            w2_items = [(b"k-%05d" % rng.randrange(8000), b"W2-%d" % i) for i in range(count)]
            await upsert_retrying(kv, w2_items, durability="persist")
        high_w2 = await high_seqnos(node)
        ahead = [vb for vb in high_w1 if high_w1[vb] > high_w2[vb]]
        print(f"{copy}/{shape}/{w2}: high old {high_old}\n W1 {high_w1}\n W2 {high_w2}")
        print(f" ahead {ahead}")

        marked = mark(streamed)
        streamed, _ = await stream_to_latest(
            node, start=SessionState.from_json(saved), state=streamed
        )
        assert_resumed_after(streamed, marked, SessionState.from_json(saved))
        rolled = sorted({vb for vb, _ in streamed.rollbacks})
        print(f"rollbacks {streamed.rollbacks}")
        truth = await server_state(node)
        assert rolled, "the consumer holds W1 items the node lost, but got no Rollback"
        assert_same_state(
            streamed, truth, what=f"consumer after diverged history ({copy}, {shape}, {w2})"
        )

    asyncio.run(scenario())
    assert node.errors_in_log() == []
