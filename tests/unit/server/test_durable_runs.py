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
from pathlib import Path
from typing import Any

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
from changefeed.vbucket_state import VBucketState

VBUCKETS = 5
REPLICA_VB = 3  # made a replica: writes to it are NOT_MY_VBUCKET
IMPOSSIBLE_VB = 2  # a chain of two with no replica reachable: DURABILITY_IMPOSSIBLE
SLOW_VB = 4  # a chain of two whose replica is reachable and never acknowledges: writes wait
NOW_S = 1_700_000_000.0
BARRIER = b"\x00"  # frame info id 0, no payload
STORE_EXTRAS = struct.Struct(">II")
KEYS = [b"k%d" % i for i in range(6)]


class RecordingTransport:
    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def writelines(self, data: list[bytes]) -> None:
        self.data += b"".join(data)

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


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


async def run_twin(root: Path, batches: list[list[bytes]]) -> tuple[bytes, list[Any], list[Any]]:
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
    monitor = SyncWriteMonitor(bucket, replicas_of=lambda vb: chains.get(vb, []),
                               replication=tracker)  # fmt: skip
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
    # Each batch arrives in one read; between batches, a flush and its commits. No loop step
    # runs meanwhile (no timer fires at a moment the twins would not share): the answers
    # settled go out after the last batch, in the order they settled.
    for batch in batches:
        conn.data_received(b"".join(batch))
        for vbucket in bucket.vbuckets.values():
            vbucket.flush()
        monitor.on_persisted(sorted(bucket.vbuckets))
    await asyncio.sleep(0.02)  # the 1 ms timeouts pass: the slow vbucket's writes abort
    for _ in range(3):
        await asyncio.sleep(0)
    for vbucket in bucket.vbuckets.values():
        vbucket.flush()
    monitor.on_persisted(sorted(bucket.vbuckets))
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
    conn.close()
    await bucket.close()
    pending.append([(stats.prepared, stats.committed, stats.aborted, stats.impossible)])
    return bytes(transport.data), pending, stored


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


def test_a_window_of_durable_sets_is_one_run(tmp_path: Path) -> None:
    """The case the runs are for: every durable SET of a window on distinct keys, answered
    once persisted, in one packed write per flush (here: all in one)."""
    batch = [encode(("durable", vb % 2, 0, 1, None, 0), 100 + vb, False) for vb in range(2)]
    batch = [
        encode_frame(
            Magic.ALT_REQUEST, Opcode.SET, vbucket=i % 2, opaque=100 + i, key=b"key-%d" % i,
            value=b"v", extras=bytes(8), framing_extras=encode_durability(
                DurabilityRequirement(1, None)),
        )
        for i in range(64)
    ]  # fmt: skip
    data, pending, stored = asyncio.run(run_twin(tmp_path / "node", [batch]))
    answers = replies(data)[3:]  # after SASL, HELLO, SELECT_BUCKET
    assert [a[2] for a in answers] == sorted(range(100, 164), key=lambda o: ((o - 100) % 2, o))
    assert {a[1] for a in answers} == {Status.SUCCESS}
    assert pending[:-1] == [[]] * VBUCKETS
    assert pending[-1] == [(64, 64, 0, 0)]
    assert sum(len(records) for records in stored) == 64
