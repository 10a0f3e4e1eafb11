"""Durable SETs taken as runs (server/durable_run.py) against the per-frame path, on twin nodes.

Two real buckets and real connections (in process, a recording transport, one fixed clock)
get the same requests. Twin A gets each durable SET as a client sends it (framing extras: one
durability frame info), so consecutive ones with the same level and timeout are taken as runs.
Twin B gets each with a barrier frame info appended to its framing extras: the node ignores a
barrier (it serves requests in order anyway), and `take_set_run` takes no SET whose framing is
anything but one durability frame info, so every durable SET of twin B goes through the
per-frame path (`_store` → `kv_commands.durable_write`). Mixed in: plain SETs, GET_LOCKED
locks, durable SETs with a CAS, keys written twice, keys with a pending prepare, expired keys,
vbuckets that are replicas or do not exist, vbuckets whose chain cannot be met
(DURABILITY_IMPOSSIBLE). After the requests both twins flush and commit, some writes time out;
then both must have sent the same replies in the same order (status, opaque, CAS, mutation
token), hold the same pending prepares, and have the same records on disk.
"""

from __future__ import annotations

import asyncio
import random
import struct
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.frame_info import DurabilityRequirement, encode_durability
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.replication import ReplicationTracker
from changefeed.server.sync_writes import SyncWriteMonitor
from changefeed.server.users import Users
from changefeed.vbmap import ClusterMap, NodeAddress
from changefeed.vbucket_state import VBucketState
from support.transports import RecordingTransport

VBUCKETS = 5
REPLICA_VB = 3  # made a replica: writes to it are NOT_MY_VBUCKET
IMPOSSIBLE_VB = 2  # a chain of two with no replica reachable: DURABILITY_IMPOSSIBLE
SLOW_VB = 4  # a chain of two whose replica is reachable and never acknowledges: writes wait
NOW_S = 1_700_000_000.0
BARRIER = b"\x00"  # frame info id 0, no payload
STORE_EXTRAS = struct.Struct(">II")
KEYS = [b"k%d" % i for i in range(6)]


def replies(data: bytes) -> list[tuple[int, int, int, int, bytes, bytes]]:
    reader = FrameReader(1 << 24)
    reader.feed(data)
    out = []
    while (frame := reader.next_frame()) is not NEED_DATA:
        assert isinstance(frame, Frame)
        value = frame.value if frame.status != Status.NOT_MY_VBUCKET else b"<map>"
        out.append((frame.opcode, frame.status, frame.opaque, frame.cas, frame.extras, value))
    return out


# A request: (kind, vb, key index, level, timeout_ms, expiry)
requests = st.tuples(
    st.sampled_from(["durable"] * 12 + ["plain", "lock", "cas", "expired"]),
    st.sampled_from([0, 0, 1, 1, IMPOSSIBLE_VB, REPLICA_VB, SLOW_VB, SLOW_VB, 9]),
    st.integers(0, len(KEYS) - 1),
    st.sampled_from([1] * 6 + [2, 3]),  # mostly one level and timeout: long runs
    st.sampled_from([None] * 6 + [5000, 1]),
    st.sampled_from([0, 0, 0, 100]),
)


def encode(request: tuple[Any, ...], opaque: int, barrier: bool) -> bytes:
    kind, vb, key_index, level, timeout_ms, expiry = request
    key = KEYS[key_index]
    if kind == "lock":
        return encode_request(Opcode.GET_LOCKED, vbucket=vb, opaque=opaque, key=key,
                              extras=struct.pack(">I", 5))  # fmt: skip
    extras = STORE_EXTRAS.pack(0, expiry)
    if kind == "plain":
        return encode_frame(Magic.REQUEST, Opcode.SET, vbucket=vb, opaque=opaque, key=key,
                            value=b"p%d" % opaque, extras=extras)  # fmt: skip
    if kind == "expired":  # a plain write that expires before the next request is served
        extras = STORE_EXTRAS.pack(0, int(NOW_S) - 10)
        return encode_frame(Magic.REQUEST, Opcode.SET, vbucket=vb, opaque=opaque, key=key,
                            value=b"e%d" % opaque, extras=extras)  # fmt: skip
    framing = encode_durability(DurabilityRequirement(level, timeout_ms))
    if barrier:
        framing += BARRIER
    return encode_frame(
        Magic.ALT_REQUEST, Opcode.SET, vbucket=vb, opaque=opaque, key=key,
        value=b"d%d" % opaque, extras=extras, framing_extras=framing,
        cas=12345 if kind == "cas" else 0,
    )  # fmt: skip


@dataclass
class Node:
    """A real bucket, its monitor and one authenticated connection on a recording transport."""

    bucket: Bucket
    monitor: SyncWriteMonitor
    conn: ClientConnection
    transport: RecordingTransport

    def flush(self) -> None:
        """Flush every vbucket and tell the monitor (as the flusher's listener does)."""
        for vbucket in self.bucket.vbuckets.values():
            vbucket.flush()
        self.monitor.on_persisted(sorted(self.bucket.vbuckets))

    async def close(self) -> None:
        self.conn.close()
        await self.bucket.close()


async def open_node(root: Path, *, cluster_map: bool = False) -> Node:
    """The twins' node. With `cluster_map`, the chains come from a one-node cluster map of
    VBUCKETS vbuckets, as node.py builds the monitor (no replicated vbuckets then)."""
    root.mkdir(parents=True)
    config = NodeConfig(data_dir=root, vbuckets=VBUCKETS, durable=False)
    users = Users()
    users.add("u", "p")
    bucket = Bucket.open(config, clock=lambda: NOW_S, rng=random.Random(7))
    bucket.vbuckets[REPLICA_VB].set_state(VBucketState.REPLICA)
    context = ServerContext(config, users, bucket)
    tracker = ReplicationTracker(lambda vb: bucket.vbuckets[vb].high_seqno, lag_max_s=1e9,
                                 clock=lambda: 0.0)  # fmt: skip
    tracker.stream_opened(SLOW_VB, "slow", 0)  # reachable; it never acknowledges anything
    chains = {IMPOSSIBLE_VB: ["gone"], SLOW_VB: ["slow"]}

    def replicas_of(vb: int) -> list[str]:
        if context.cluster_map is not None:
            return [n.name for n in context.cluster_map.replica_nodes(vb)]
        return chains.get(vb, [])

    if cluster_map:
        node = NodeAddress("n1", "127.0.0.1", 11210)
        context.cluster_map = ClusterMap.single_node(node, VBUCKETS)
    monitor = SyncWriteMonitor(bucket, replicas_of=replicas_of, replication=tracker)
    context.sync_writes = monitor
    conn = ClientConnection(context)
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn.data_received(
        encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=encode_plain("u", "p"))
    )
    async with asyncio.timeout(30):
        while not transport.data:  # the password is checked off the loop
            await asyncio.sleep(0.005)
    hello = struct.pack(">H", Feature.MUTATION_SEQNO)
    conn.data_received(encode_request(Opcode.HELLO, opaque=2, key=b"t", value=hello))
    conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=3, key=b"default"))
    return Node(bucket, monitor, conn, transport)


async def run_twin(
    root: Path, batches: list[list[bytes]]
) -> tuple[bytes, list[Any], list[Any], int]:
    node = await open_node(root)
    bucket, monitor, conn, transport = node.bucket, node.monitor, node.conn, node.transport
    # Each batch arrives in one read; between batches, a flush and its commits. No loop step
    # runs meanwhile (no timer fires at a moment the twins would not share): the answers
    # settled go out after the last batch, in the order they settled.
    for batch in batches:
        conn.data_received(b"".join(batch))
        node.flush()
    await asyncio.sleep(0.02)  # the 1 ms timeouts pass: the slow vbucket's writes abort
    for _ in range(3):
        await asyncio.sleep(0)
    node.flush()
    for _ in range(3):
        await asyncio.sleep(0)
    pending = [
        [(p.seqno, p.key, p.cas, p.level) for p in vbucket.pending_prepares]
        for vbucket in bucket.vbuckets.values()
    ]
    stored = [
        [(r.seqno, r.key, r.op, r.cas, r.rev_seqno, r.value, r.expiry)
         for r in bucket.store.scan(vb, 1, vbucket.high_seqno)]
        for vb, vbucket in sorted(bucket.vbuckets.items())
    ]  # fmt: skip
    stats = monitor.stats
    await node.close()
    pending.append([(stats.prepared, stats.committed, stats.aborted, stats.impossible)])
    return bytes(transport.data), pending, stored, conn.durable_run_writes


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.lists(requests, min_size=1, max_size=24), min_size=1, max_size=3))
def test_runs_answer_and_store_as_the_per_frame_path(
    tmp_path_factory: Any, batches: list[list[tuple[Any, ...]]]
) -> None:
    root = tmp_path_factory.mktemp("twins")
    encoded: dict[bool, list[list[bytes]]] = {}
    for barrier in (False, True):
        opaque = 100
        encoded[barrier] = []
        for batch in batches:
            frames = []
            for request in batch:
                frames.append(encode(request, opaque, barrier))
                opaque += 1
            encoded[barrier].append(frames)
    runs = asyncio.run(run_twin(root / "runs", encoded[False]))
    frames = asyncio.run(run_twin(root / "frames", encoded[True]))
    assert replies(runs[0]) == replies(frames[0])
    assert runs[1] == frames[1]  # pending prepares per vbucket; the monitor's counts
    assert runs[2] == frames[2]  # records on disk
    # Twin A took every durable SET without a CAS as (part of) a run; twin B none.
    durable = sum(request[0] == "durable" for batch in batches for request in batch)
    assert (runs[3], frames[3]) == (durable, 0)


def test_a_window_of_durable_sets_is_one_run(tmp_path: Path) -> None:
    """The case the runs are for: every durable SET of a window on distinct keys, answered
    once persisted, in one packed write per flush (here: all in one)."""
    batch = [
        encode_frame(
            Magic.ALT_REQUEST, Opcode.SET, vbucket=i % 2, opaque=100 + i, key=b"key-%d" % i,
            value=b"v", extras=bytes(8), framing_extras=encode_durability(
                DurabilityRequirement(1, None)),
        )
        for i in range(64)
    ]  # fmt: skip
    data, pending, stored, run_writes = asyncio.run(run_twin(tmp_path / "node", [batch]))
    assert run_writes == 64
    answers = replies(data)[3:]  # after SASL, HELLO, SELECT_BUCKET
    assert [a[2] for a in answers] == sorted(range(100, 164), key=lambda o: ((o - 100) % 2, o))
    assert {a[1] for a in answers} == {Status.SUCCESS}
    assert pending[:-1] == [[]] * VBUCKETS
    assert pending[-1] == [(64, 64, 0, 0)]
    assert sum(len(records) for records in stored) == 64


def durable_set(vb: int, opaque: int, key: bytes, value: bytes, barrier: bool) -> bytes:
    """A durable SET (level majority, the default timeout); with `barrier`, never in a run."""
    framing = encode_durability(DurabilityRequirement(1, None)) + (BARRIER if barrier else b"")
    return encode_frame(Magic.ALT_REQUEST, Opcode.SET, vbucket=vb, opaque=opaque, key=key,
                        value=value, extras=bytes(8), framing_extras=framing)  # fmt: skip


@pytest.mark.parametrize("barrier", [False, True], ids=["run", "per-frame"])
def test_an_answered_durable_write_holds_nothing_of_its_request(
    tmp_path: Path, barrier: bool
) -> None:
    """A write that waits for its timeout (first, on a vbucket whose replica never
    acknowledges) must not keep the values of the writes answered after it alive: they are
    the store's once flushed (review finding F1: 16 MiB held until the 10 s timeout)."""
    values_bytes = 16 << 20

    async def scenario() -> int:
        node = await open_node(tmp_path / "node")
        data = durable_set(SLOW_VB, 100, b"slow", b"s", barrier) + b"".join(
            durable_set(0, 101 + i, b"big-%d" % i, bytes([i]) * (values_bytes // 16), barrier)
            for i in range(16)
        )
        tracemalloc.start()
        try:
            node.conn.data_received(data)
            del data
            node.flush()  # the 16 commit at once; the slow one waits for its 10 s
            for _ in range(3):
                await asyncio.sleep(0)
            # The next read lets the reader drop the bytes it consumed.
            node.conn.data_received(encode_request(Opcode.GET, vbucket=0, opaque=99, key=b"x"))
            node.flush()  # the commits too: the checkpoints free the values
            held, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        answers = replies(bytes(node.transport.data))[3:]
        want = [(Status.SUCCESS, 101 + i) for i in range(16)] + [(Status.KEY_ENOENT, 99)]
        assert [(a[1], a[2]) for a in answers] == want
        assert node.monitor.pending_count == 1
        await node.close()
        return held

    held = asyncio.run(scenario())
    # The checkpoints may keep a few commits within their budget (4 MiB here); the values
    # pinned by answered waiters were all 16 MiB, on top.
    assert held < values_bytes // 2, f"{held} bytes still held after the answers"


@pytest.mark.parametrize("barrier", [False, True], ids=["run", "per-frame"])
def test_a_settled_answer_is_owed_until_it_is_sent(tmp_path: Path, barrier: bool) -> None:
    """A durable write that settled is sent at the end of the loop step; until then the
    connection owes it and admission may not evict it (review finding F2: `idle_evictable`
    said True in between and the answer was lost)."""

    async def scenario() -> None:
        node = await open_node(tmp_path / "node")
        conn = node.conn
        await asyncio.sleep(0)
        sent = len(node.transport.data)
        conn.data_received(durable_set(0, 100, b"k", b"v", barrier))
        assert not conn.idle_evictable()
        node.flush()  # the write commits: its outcome settles, to be sent this loop step
        assert len(node.transport.data) == sent
        assert not conn.idle_evictable(), "the settled answer is not sent yet"
        for _ in range(2):
            await asyncio.sleep(0)
        answers = replies(bytes(node.transport.data))[3:]
        assert [(a[1], a[2]) for a in answers] == [(Status.SUCCESS, 100)]
        assert conn.idle_evictable()
        await node.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("barrier", [False, True], ids=["run", "per-frame"])
def test_a_durable_set_to_a_vbucket_outside_the_map_is_not_my_vbucket(
    tmp_path: Path, barrier: bool
) -> None:
    """The chain of a vbucket id the cluster map has no row for was looked up first
    (IndexError: the connection died and the GET before it went unanswered; review finding
    F3): NOT_MY_VBUCKET, and the requests around it are served."""

    async def scenario() -> list[tuple[int, int]]:
        node = await open_node(tmp_path / "node", cluster_map=True)
        get = encode_request(Opcode.GET, vbucket=0, opaque=50, key=b"x")
        node.conn.data_received(
            get + durable_set(VBUCKETS + 4, 100, b"k", b"v", barrier)
            + durable_set(0, 101, b"k", b"v", barrier)
        )  # fmt: skip
        node.flush()
        for _ in range(2):
            await asyncio.sleep(0)
        answers = replies(bytes(node.transport.data))[3:]
        assert not node.transport.closed
        await node.close()
        return [(a[1], a[2]) for a in answers]

    assert asyncio.run(scenario()) == [
        (Status.KEY_ENOENT, 50),
        (Status.NOT_MY_VBUCKET, 100),
        (Status.SUCCESS, 101),
    ]
