"""A window's GETs and DELETEs read the keys memory has none of from the store in one
transaction (`Bucket.stored_read_ahead`): the answers and the state must be those of the same
requests served one frame at a time. Twin buckets with the same clock and rng: one behind a
connection that gathers windows, one behind a connection that serves every request alone
(`FrameByFrame`). Every key starts in the store only (written, flushed, bucket reopened), keys
repeat inside windows, checkpoints are small and flushed between received batches so keys
leave memory again, SETs of size 10 carry an expiry already past, a big value fills the 1 MiB
checkpoint quota (TMPFAIL), some keys are locked, expired or deleted, DELETEs carry a right or
wrong CAS, and one vbucket does not exist here (NOT_MY_VBUCKET)."""

from __future__ import annotations

import asyncio
import random
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed.protocol.kv import StoreCommand, encode_request, encode_store
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import encode_plain
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from changefeed.storage import Record
from support.transports import RecordingTransport

VBUCKETS = 4
KEYS = [b"k%d" % n for n in range(10)]
START_S = 1_800_000_000.0
BIG = 300_000  # four of these fill the 1 MiB quota: TMPFAIL


class FrameByFrame(ClientConnection):
    """The reference: takes no SET runs, so no window forms and every request goes through
    the per-frame handlers, each reading the store for itself."""

    def _takes_set_runs(self) -> bool:
        return False


@dataclass(frozen=True)
class Request:
    kind: str  # set, get, delete, lock, flush (between received batches)
    key: int
    vb_shift: int  # 0: the key's vbucket; else a vbucket that does not exist here
    size: int
    cas_pick: int  # delete: 0 none, 1 the key's preloaded CAS, 2 a wrong one


requests = st.lists(
    st.builds(
        Request,
        st.sampled_from(["set", "set", "get", "delete", "delete", "lock", "flush"]),
        st.integers(0, len(KEYS) - 1),
        st.sampled_from([0, 0, 0, 0, 0, 0, 0, 1]),
        st.sampled_from([0, 10, 100, BIG]),
        st.integers(0, 2),
    ),
    min_size=1,
    max_size=80,
)


def vb_of(key: bytes) -> int:
    return KEYS.index(key) % VBUCKETS


def encode(request: Request, opaque: int, cases: dict[bytes, int]) -> bytes:
    key = KEYS[request.key]
    vb = vb_of(key) if not request.vb_shift else VBUCKETS + 1
    if request.kind == "set":
        value = b"v%d-" % opaque + b"x" * request.size
        expiry = int(START_S) + 30 if request.size == 10 else 0  # past once the plan runs
        command = StoreCommand(Opcode.SET, vb, opaque, key, value, flags=opaque, expiry=expiry)
        return encode_store(command)
    if request.kind == "get":
        return encode_request(Opcode.GET, opaque=opaque, vbucket=vb, key=key)
    if request.kind == "lock":
        extras = struct.pack(">I", 15)
        return encode_request(Opcode.GET_LOCKED, opaque=opaque, vbucket=vb, key=key, extras=extras)
    cas = (0, cases.get(key, 0), 77)[request.cas_pick]
    return encode_request(Opcode.DELETE, opaque=opaque, vbucket=vb, key=key, cas=cas)


def batches(plan: list[Request], cases: dict[bytes, int]) -> list[bytes | None]:
    """The received batches (None: flush every vbucket there)."""
    out: list[bytes | None] = []
    current: list[bytes] = []
    for opaque, request in enumerate(plan, start=100):
        if request.kind == "flush":
            out += [b"".join(current), None]
            current = []
            continue
        current.append(encode(request, opaque, cases))
    out.append(b"".join(current))
    return out


def config_for(path: Path) -> NodeConfig:
    path.mkdir(parents=True)
    return NodeConfig(
        data_dir=path,
        vbuckets=VBUCKETS,
        durable=False,
        checkpoint_quota_bytes=1024 * 1024,
        checkpoint_max_bytes=2048,
    )


def preload(config: NodeConfig, clock: list[float]) -> None:
    """Every key written (every third with an expiry that will have passed, k0 deleted),
    flushed and closed: the reopened bucket has them in the store only."""
    bucket = Bucket.open(config, clock=lambda: clock[0], rng=random.Random(7))
    for n, key in enumerate(KEYS):
        expiry = int(START_S) + 5 if n % 3 == 2 else 0
        bucket.store_command(
            StoreCommand(Opcode.SET, vb_of(key), 1, key, b"stored-%d" % n, flags=n, expiry=expiry)
        )
    bucket.delete(vb_of(KEYS[0]), KEYS[0])
    for vbucket in bucket.vbuckets.values():
        vbucket.flush()
        vbucket.close()
    bucket.store.close()


Outcome = tuple[bytes, list[tuple[int, int]], dict[tuple[int, bytes], Record | None]]


async def serve(
    config: NodeConfig, reference: bool, plan: list[Request], clock: list[float]
) -> Outcome:
    users = Users()
    users.add("u", "p")
    bucket = Bucket.open(config, clock=lambda: clock[0], rng=random.Random(7))
    cases = {}
    for key in KEYS:
        found = bucket.vbucket(vb_of(key)).get(key)
        if found is not None:
            cases[key] = found.cas
    kind = FrameByFrame if reference else ClientConnection
    conn = kind(ServerContext(config, users, bucket))
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    try:
        auth = encode_plain("u", "p")
        conn.data_received(encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=auth))
        async with asyncio.timeout(30):
            while not transport.writes:  # the password is checked off the loop
                await asyncio.sleep(0.005)
        conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"))
        clock[0] = START_S + 60  # the preloaded expiries have passed
        for batch in batches(plan, cases):
            if batch is None:
                for vbucket in bucket.vbuckets.values():
                    vbucket.flush()
            elif batch:
                conn.data_received(batch)
        for vbucket in bucket.vbuckets.values():
            vbucket.flush()
        seqnos = [(vb.high_seqno, vb.persisted_seqno) for vb in bucket.vbuckets.values()]
        stored = {(vb_of(key), key): bucket.store.get(vb_of(key), key) for key in KEYS}
        return transport.data, seqnos, stored
    finally:
        conn.close()
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()


@settings(max_examples=40, deadline=None)
@given(requests)
@example(  # a GET and a DELETE after a SET of their stored key in one window; a flush; again
    [
        Request("set", 1, 0, 10, 0),
        Request("get", 1, 0, 0, 0),
        Request("set", 3, 0, 10, 0),
        Request("delete", 3, 0, 0, 0),
        Request("get", 3, 0, 0, 0),
        Request("flush", 0, 0, 0, 0),
        Request("get", 1, 0, 0, 0),
        Request("delete", 1, 0, 0, 1),
        Request("set", 1, 0, 0, 0),
        Request("get", 1, 0, 0, 0),
        Request("get", 4, 1, 0, 0),
        Request("delete", 5, 0, 0, 2),
    ]
)
@example(  # a GET of an expired document (its expiration is a write), then a SET on its vbucket
    [Request("get", 8, 0, 0, 0), Request("set", 0, 0, 0, 0)]
)
@example(  # the same for a document a SET of the window (then of an earlier one) wrote expired
    [
        Request("set", 4, 0, 10, 0),
        Request("get", 4, 0, 0, 0),
        Request("set", 0, 0, 0, 0),
        Request("flush", 0, 0, 0, 0),
        Request("set", 1, 0, 10, 0),
        Request("flush", 0, 0, 0, 0),
        Request("get", 1, 0, 0, 0),
        Request("set", 5, 0, 0, 0),
    ]
)
@example(  # k1 read ahead, rewritten, flushed out of memory: a later read must see the store
    [
        Request("delete", 1, 0, 0, 0),
        Request("set", 1, 0, BIG, 0),
        Request("set", 5, 0, BIG, 0),
        Request("flush", 0, 0, 0, 0),
        Request("lock", 1, 0, 0, 0),
    ]
)
def test_windows_answer_and_store_as_one_frame_at_a_time(
    tmp_path_factory: pytest.TempPathFactory, plan: list[Request]
) -> None:
    root = tmp_path_factory.mktemp("twins")
    outcomes = []
    for reference in (False, True):
        clock = [START_S]
        config = config_for(root / ("reference" if reference else "windows"))
        preload(config, clock)
        outcomes.append(asyncio.run(serve(config, reference, plan, clock)))
    (data, seqnos, stored), (want_data, want_seqnos, want_stored) = outcomes
    assert data == want_data
    assert seqnos == want_seqnos
    assert stored == want_stored
