"""A consumer that stops part-way and resumes from its saved JSON: no gaps, no repeats.

The session is saved after an arbitrary ``Changes`` event (usually in the middle of a snapshot),
the client is dropped, more is written, and a new client resumes from the JSON. The node is not
restarted, so no rollback is allowed, every seqno after the saved one arrives exactly once, and
nothing at or below it is sent again (the resume point is inside the last snapshot, which the
request presents as ``snap_start <= start <= snap_end``).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import DcpClient, Event, SessionState, Snapshot
from support.clients import dcp_config, kv_connect, upsert_retrying
from support.consumer import StreamedState, drain, server_state, stream_to_latest
from support.nodes import NodeFactory

from .harness import assert_matches_model, assert_resumed_after, assert_same_state

pytestmark = pytest.mark.timeout(180)


async def trickle(node: NodeProcess, model: dict[bytes, bytes | None]) -> None:
    async with await kv_connect(node) as kv:
        for round_number in range(40):
            items = [(b"t-%02d-%03d" % (round_number, i), b"t") for i in range(50)]
            await kv.upsert_many(items)
            model.update(items)
            await asyncio.sleep(0.01)


def after_marker(last: list[Event], streamed: StreamedState) -> bool:
    event = last[-1] if last else None
    if streamed.items < 6500 or not isinstance(event, Snapshot):
        return False
    return event.vbucket in streamed.received


@pytest.mark.parametrize("stop", ["mid-snapshot", "after-marker", "mid-disk-snapshot"])
def test_consumer_restart_from_saved_json(
    nodes: NodeFactory, rng: random.Random, stop: str
) -> None:
    node = nodes(vbuckets=8)
    vbs = list(range(8))

    async def scenario() -> None:
        model: dict[bytes, bytes | None] = {}
        async with await kv_connect(node) as kv:
            items = [(b"k-%05d" % i, rng.randbytes(40)) for i in range(6000)]
            await upsert_retrying(kv, items)
            model.update(items)
        if stop == "mid-disk-snapshot":
            node.restart(clean=True)  # memory is empty: the first life reads a disk backfill

        # First life: stop part-way (after about half of the items, or right after a marker).
        first = StreamedState()
        config = dcp_config(node, buffer_bytes=64 * 1024, to_latest=stop != "after-marker")
        async with DcpClient(config) as client:
            await client.stream(vbs)
            if stop == "after-marker":
                # Live, while a writer adds snapshots: quit right after the marker of a new
                # snapshot in a vbucket that already has items (no item of it taken yet).
                last: list[Event] = []
                writer = asyncio.get_running_loop().create_task(trickle(node, model))
                await drain(
                    client, first, lambda c, m: after_marker(last, m), per_event=last.append
                )
                await writer
            else:
                half = rng.randrange(2000, 4000)
                await drain(client, first, lambda c, m: False, stop_after_items=half)
            saved = client.session.to_json()
        if stop == "mid-disk-snapshot":
            assert all(flags & 0x02 for _, _, _, flags in first.markers), first.markers
        state = SessionState.from_json(saved)
        assert sum(s.seqno for s in state.vbuckets.values()) > 0
        print(f"stopped after {first.items} items; session {saved[:200]}...")

        # Meanwhile: updates (some to keys already consumed), deletes and new keys.
        async with await kv_connect(node) as kv:
            for i in range(1500):
                key = b"k-%05d" % rng.randrange(6000)
                if rng.random() < 0.25 and model.get(key) is not None:
                    await kv.remove(key)
                    model[key] = None
                else:
                    model[key] = b"upd-%d" % i
                    await kv.upsert(key, model[key])  # type: ignore[arg-type]
            extra = [(b"n-%05d" % i, b"new") for i in range(1000)]
            await upsert_retrying(kv, extra)
            model.update(extra)

        # Second life: a new client from the JSON alone.
        second = StreamedState()
        second, _ = await stream_to_latest(node, start=SessionState.from_json(saved), state=second)
        assert not second.rollbacks, second.rollbacks
        assert_resumed_after(second, {}, state)
        for vb in vbs:
            resumed_at = state.get(vb).seqno
            again = [s for s in second.received.get(vb, []) if s <= resumed_at]
            assert not again, f"vb {vb}: seqnos {again[:5]} repeated after resuming at {resumed_at}"
            # Every seqno arrived exactly once over both lives.
            both = first.received.get(vb, []) + second.received.get(vb, [])
            assert len(both) == len(set(both)), f"vb {vb}: a seqno arrived twice"

        combined = StreamedState()
        for streamed in (first, second):
            for vb, changes in streamed.history.items():
                combined.history.setdefault(vb, []).extend(changes)
        assert_matches_model(combined, model)
        assert_same_state(combined, await server_state(node), what="resumed consumer")

    asyncio.run(scenario())
    assert node.errors_in_log() == []
