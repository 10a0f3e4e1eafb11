"""Load a node with sets, updates and deletes; a full stream must reproduce every key's state."""

from __future__ import annotations

import asyncio
import random

import pytest

from changefeed.cli.node_process import NodeProcess
from support.clients import high_seqnos, kv_connect
from support.consumer import server_state, stream_to_latest
from support.nodes import NodeFactory

from .harness import assert_matches_model, assert_same_state

pytestmark = pytest.mark.timeout(180)


async def load(
    node: NodeProcess, rng: random.Random, keys: int, updates: int, deletes: int
) -> dict[bytes, bytes | None]:
    """Write a random workload; return the model key -> last value (None = deleted)."""
    model: dict[bytes, bytes | None] = {}
    async with await kv_connect(node) as kv:
        batch = [(b"key-%06d" % i, rng.randbytes(rng.randrange(1, 200))) for i in range(keys)]
        await kv.upsert_many(batch)
        model.update(batch)
        names = list(model)
        for _ in range(updates):
            key = rng.choice(names)
            value = b"u%d-" % rng.randrange(10**9) + rng.randbytes(rng.randrange(0, 50))
            await kv.upsert(key, value)
            model[key] = value
        for key in rng.sample(names, deletes):
            await kv.remove(key)
            model[key] = None
        # Re-create a few deleted keys: the newest change wins over the tombstone.
        for key in [k for k, v in model.items() if v is None][: deletes // 4]:
            model[key] = b"reborn"
            await kv.insert(key, b"reborn")
        for key in list(model)[:20]:
            got = await kv.get(key) if model[key] is not None else None
            assert got is None or got.value == model[key], key
    return model


def test_load_then_stream_everything_from_the_beginning(
    nodes: NodeFactory, rng: random.Random
) -> None:
    node = nodes(vbuckets=16)

    async def scenario() -> None:
        model = await load(node, rng, keys=4000, updates=1500, deletes=600)
        streamed, session = await stream_to_latest(node)
        assert streamed.opened == set(range(16)), streamed.opened
        assert set(streamed.ended.values()) == {0}, streamed.ended  # STREAM_END OK for every vb
        assert not streamed.rollbacks, streamed.rollbacks
        assert_matches_model(streamed, model)
        # The stream from the beginning lands exactly on the high seqno of every vbucket.
        highs = await high_seqnos(node)
        assert {vb: session.get(vb).seqno for vb in highs} == highs
        # A second consumer agrees, and a clean restart (disk backfill only) changes nothing.
        node.restart(clean=True)
        after_restart = await server_state(node)
        assert_same_state(after_restart, streamed, what="stream after a clean restart")
        assert all(flags & 0x02 for _, _, _, flags in after_restart.markers if flags)

    asyncio.run(scenario())
    assert node.errors_in_log() == []
