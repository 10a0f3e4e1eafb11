"""Helpers of the Spark tests: a seeded workload with its model, the truth as a key -> value
map, and checks of the Delta mirror and changelog.

Nodes come from the shared ``nodes`` fixture (``tests/support``: ``NodeProcess`` on 127.0.0.1,
stopped by pid when the test ends), writes go through ``support.clients.upsert_retrying`` and
the truth through ``support.consumer.server_state``, as in the integration tests. ``write``
applies a workload through ``KvClient`` and keeps a model (key -> value, None once deleted).
``store_state`` is the truth as the mirror table holds it (live keys, decoded);
``assert_mirror_matches`` compares a mirror table with both, key by key.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import KvClient
from changefeed.protocol.errors import KeyNotFoundError
from changefeed.spark import read_mirror
from support.clients import HOST, upsert_retrying
from support.consumer import server_state

WRITE_CHUNK = 2000
TRUTH_TIMEOUT_S = 120.0

Model = dict[str, bytes | None]
Op = tuple[str, bytes | None]  # (key, value); None deletes


# -- workload ----------------------------------------------------------------------------------


def workload(
    rng: random.Random,
    count: int,
    *,
    keys: int,
    prefix: str = "k",
    tag: str = "v",
    delete_ratio: float = 0.05,
) -> list[Op]:
    """``count`` random upserts and deletes over ``keys`` keys; values name the op's index."""
    assert count >= 0, count
    assert keys > 0, keys
    ops: list[Op] = []
    for i in range(count):
        key = f"{prefix}-{rng.randrange(keys):07d}"
        if rng.random() < delete_ratio:
            ops.append((key, None))
        else:
            ops.append((key, f"{tag}-{i}-{rng.randrange(10**6)}".encode()))
    return ops


async def write_async(port: int, ops: list[Op], model: Model | None = None) -> None:
    """Apply ``ops`` in order (runs of upserts pipelined) and update ``model``."""
    async with await KvClient.connect(HOST, port) as kv:
        run: list[tuple[bytes, bytes]] = []
        for key, value in ops:
            if value is not None:
                run.append((key.encode(), value))
                if len(run) >= WRITE_CHUNK:
                    await upsert_retrying(kv, run, chunk=WRITE_CHUNK)
                    run = []
                continue
            await upsert_retrying(kv, run, chunk=WRITE_CHUNK)
            run = []
            with contextlib.suppress(KeyNotFoundError):  # deleting an absent key is fine
                await kv.remove(key.encode())
        await upsert_retrying(kv, run, chunk=WRITE_CHUNK)
    if model is not None:
        model.update(ops)


def write(port: int, ops: list[Op], model: Model | None = None) -> None:
    asyncio.run(write_async(port, ops, model))


def live(model: Model) -> dict[str, bytes]:
    return {k: v for k, v in model.items() if v is not None}


# -- truth ---------------------------------------------------------------------------------------


async def store_state_async(
    node: NodeProcess, *, timeout_s: float = TRUTH_TIMEOUT_S
) -> dict[str, bytes]:
    """Every live key and its value: ``server_state`` (a fresh DCP stream of every vbucket from
    the beginning to its high seqno), keys decoded as the mirror table holds them."""
    state = await server_state(node, timeout_s=timeout_s)
    return {key.decode(): value for key, value in state.values().items()}


def store_state(node: NodeProcess) -> dict[str, bytes]:
    return asyncio.run(store_state_async(node))


def table_state(table: pa.Table) -> dict[str, bytes]:
    keys = table.column("key").to_pylist()
    values = table.column("value").to_pylist()
    assert len(set(keys)) == len(keys), "the mirror holds a key twice"
    return dict(zip(keys, values, strict=True))


def diff(got: dict[str, bytes], want: dict[str, bytes]) -> str:
    """Empty when equal; else counts and examples of missing, extra and differing keys."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    if not (missing or extra or differ):
        return ""
    return (
        f"{len(missing)} missing (e.g. {missing[:5]}), {len(extra)} extra (e.g. {extra[:5]}), "
        f"{len(differ)} differ (e.g. {[(k, got[k], want[k]) for k in differ[:3]]})"
    )


def assert_mirror_matches(
    path: Path, node: NodeProcess, model: Model | None = None
) -> dict[str, bytes]:
    """The mirror table equals the store (and the writer's model), key by key; returns it."""
    mirror = table_state(read_mirror(path))
    truth = store_state(node)
    problem = diff(mirror, truth)
    assert not problem, f"mirror differs from the store: {problem}"
    if model is not None:
        problem = diff(truth, live(model))
        assert not problem, f"store differs from the writer's model: {problem}"
    return mirror


def changelog(path: Path) -> pa.Table:
    return DeltaTable(str(path / "changelog")).to_pyarrow_table()


def assert_changelog_once(path: Path) -> pa.Table:
    """Each (vbucket, seqno) of a change row appears at most once in the changelog."""
    table = changelog(path)
    changes = table.filter(pc.not_equal(table.column("op"), "rollback"))
    counts = changes.group_by(["vbucket", "seqno"]).aggregate([("seqno", "count")])
    twice = counts.filter(pc.greater(counts.column("seqno_count"), 1))
    assert twice.num_rows == 0, f"changelog rows written twice: {twice.slice(0, 5).to_pylist()}"
    return table


def processes_in_group(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out
