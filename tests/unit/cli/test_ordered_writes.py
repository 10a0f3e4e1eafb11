"""`OrderedWrites` against its model: writes one at a time, in the order made. A client that
answers each call after a random delay (so concurrent calls finish in any order) records what
it applied; every key's writes must be applied in the order they were made, the final state
must be the model's, and nothing may be left unsent after `drain`."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cli.ordered_writes import OrderedWrites
from changefeed.protocol.errors import KeyNotFoundError
from changefeed.protocol.kv import MutationResult

Op = tuple[str, bytes, bytes, int]  # ("set" | "delete", key, value, expiry)


class ShufflingClient:
    """What OrderedWrites calls of a KvClient; each call is applied after a random delay."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.state: dict[bytes, tuple[bytes, int]] = {}
        self.applied: list[Op] = []
        self.persist_waits = 0

    async def _later(self) -> None:
        await asyncio.sleep(self.rng.choice([0, 0, 0.0001, 0.0005]))

    async def upsert_many(
        self, items: list[tuple[bytes, bytes]], *, durability: str = "none"
    ) -> list[MutationResult]:
        for key, value in items:  # a window is applied in order (one connection per node)
            await self._later()
            self.state[key] = (value, 0)
            self.applied.append(("set", key, value, 0))
        return [MutationResult(vbucket=0, seqno=1, cas=1, vb_uuid=1) for _ in items]

    async def upsert(self, key: bytes, value: bytes, *, expiry: int = 0) -> MutationResult:
        await self._later()
        self.state[key] = (value, expiry)
        self.applied.append(("set", key, value, expiry))
        return MutationResult(vbucket=0, seqno=1, cas=1, vb_uuid=1)

    async def remove(self, key: bytes) -> MutationResult:
        await self._later()
        self.applied.append(("delete", key, b"", 0))
        if self.state.pop(key, None) is None:
            raise KeyNotFoundError(f"{key!r}")
        return MutationResult(vbucket=0, seqno=1, cas=1, vb_uuid=1)

    async def wait_all_persisted(self, done: list[MutationResult]) -> None:
        self.persist_waits += 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "set", "set", "delete"]),
        st.sampled_from([b"a", b"b", b"c", b"d"]),
        st.binary(min_size=1, max_size=3),
        st.sampled_from([0, 0, 0, 60]),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(made=ops, segment_max=st.integers(1, 8), seed=st.integers(0, 1000))
def test_each_key_is_written_in_the_order_made(made: list[Op], segment_max: int, seed: int) -> None:
    client = ShufflingClient(seed)
    model: dict[bytes, tuple[bytes, int]] = {}
    missing = 0

    async def scenario() -> OrderedWrites:
        writes = OrderedWrites(client, missing_ok=True, segment_max=segment_max)  # type: ignore[arg-type]
        for kind, key, value, expiry in made:
            if kind == "delete":
                await writes.delete(key)
            else:
                await writes.set(key, value, expiry=expiry)
        await writes.drain()
        return writes

    for kind, key, value, expiry in made:
        if kind == "delete":
            missing += model.pop(key, None) is None
        else:
            model[key] = (value, expiry)
    writes = asyncio.run(scenario())
    made_as_applied = [(k, key, v if k == "set" else b"", e if k == "set" else 0)
                       for k, key, v, e in made]  # fmt: skip
    for key in {key for _, key, _, _ in made}:
        assert [op for op in client.applied if op[1] == key] == [
            op for op in made_as_applied if op[1] == key
        ]
    assert client.state == model
    assert writes.pending == 0
    assert (writes.sets, writes.deletes, writes.missing) == (
        sum(kind == "set" for kind, *_ in made),
        sum(kind == "delete" for kind, *_ in made) - missing,
        missing,
    )


def test_a_missing_key_is_raised_unless_missing_ok() -> None:
    async def scenario() -> None:
        writes = OrderedWrites(ShufflingClient(1))  # type: ignore[arg-type]
        await writes.delete(b"never")
        with pytest.raises(KeyNotFoundError):
            await writes.drain()

    asyncio.run(scenario())


def test_persist_waits_once_per_segment_of_deletes_and_expiring_sets() -> None:
    client = ShufflingClient(2)

    async def scenario() -> None:
        writes = OrderedWrites(client, durability="persist", segment_max=4)  # type: ignore[arg-type]
        for key in (b"a", b"b", b"c"):
            await writes.set(key, b"v", expiry=60)
        await writes.delete(b"a")  # a key of the segment: the segment goes first
        await writes.drain()

    asyncio.run(scenario())
    assert client.persist_waits == 2


def test_aclose_stops_a_segment_being_sent() -> None:
    async def scenario() -> list[Any]:
        client = ShufflingClient(3)
        gate = asyncio.Event()

        async def stuck(*args: Any, **kwargs: Any) -> list[MutationResult]:
            await gate.wait()
            return []

        client.upsert_many = stuck  # type: ignore[method-assign]
        writes = OrderedWrites(client)  # type: ignore[arg-type]
        await writes.set(b"a", b"v")
        await writes.flush()
        await writes.aclose()
        return [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    assert asyncio.run(scenario()) == []
