"""A window's GETs and DELETEs read the keys memory has none of from the store in one
transaction (`Bucket.stored_read_ahead`): the answers and the state must be those of the same
requests served one frame at a time. Twin buckets with the same clock and rng: one behind a
connection that gathers windows, one behind a connection that serves every request alone
(`FrameByFrame`). Every key starts in the store only (written, flushed, bucket reopened), keys
repeat inside windows, checkpoints are small and flushed between received batches so keys
leave memory again, SETs of size 10 carry an expiry already past, a big value fills the 1 MiB
checkpoint quota (TMPFAIL), some keys are locked, expired or deleted, DELETEs carry a right or
wrong CAS, and one vbucket does not exist here (NOT_MY_VBUCKET). Some documents are JSON
(their datatype must come back on a window's GET), some SETs carry a relative expiry, and
some GETs and DELETEs an empty or over-long key (the handler's EINVAL, not KEY_ENOENT)."""

from __future__ import annotations

import asyncio
import random
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol.kv import StoreCommand, encode_request, encode_store
from changefeed.protocol.opcode import Datatype, Feature, Opcode
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from changefeed.storage import Record
from support.transports import RecordingTransport, sign_in

VBUCKETS = 4
KEYS = [b"k%d" % n for n in range(10)]
START_S = 1_800_000_000.0
BIG = 300_000  # four of these fill the 1 MiB quota: TMPFAIL
ODD_KEYS = [b"", b"o" * (limits.KEY_SIZE_MAX + 1)]  # a Request's odd_key 1 and 2
RELATIVE_S = 600  # a relset's expiry: relative, in the future whatever the clock says


class FrameByFrame(ClientConnection):
    """The reference: takes no SET runs, so no window forms and every request goes through
    the per-frame handlers, each reading the store for itself."""

    def _takes_set_runs(self) -> bool:
        return False


@dataclass(frozen=True)
class Request:
    kind: str  # set, jsonset (datatype JSON), relset (a relative expiry), get, delete, lock,
    # flush (between received batches), and never in a window: casset (a SET with the key's
    # preloaded CAS), baddelete (a DELETE with extras)
    key: int
    vb_shift: int  # 0: the key's vbucket; else a vbucket that does not exist here
    size: int
    cas_pick: int  # delete: 0 none, 1 the key's preloaded CAS, 2 a wrong one
    odd_key: int = 0  # get, delete: 1 an empty key, 2 one over KEY_SIZE_MAX (key's vbucket)


KINDS = ["set", "set", "jsonset", "relset", "get", "get", "delete", "delete", "lock", "flush"]
KINDS += ["casset", "baddelete"]
requests = st.lists(
    st.builds(
        Request,
        st.sampled_from(KINDS),
        st.integers(0, len(KEYS) - 1),
        st.sampled_from([0, 0, 0, 0, 0, 0, 0, 1]),
        st.sampled_from([0, 10, 100, BIG]),
        st.integers(0, 2),
        st.sampled_from([0] * 8 + [1, 2]),
    ),
    min_size=1,
    max_size=80,
)


def vb_of(key: bytes) -> int:
    return KEYS.index(key) % VBUCKETS


def encode(
    request: Request, opaque: int, cases: dict[bytes, int], collections: bool = False
) -> bytes:
    """`request` on the wire; with `collections` its key in the default collection (id 0,
    the prefix a client that negotiated Collections sends)."""
    key = KEYS[request.key]
    vb = vb_of(key) if not request.vb_shift else VBUCKETS + 1
    if request.odd_key and request.kind in ("get", "delete"):
        key = ODD_KEYS[request.odd_key - 1]
    wire_key = b"\x00" + key if collections else key
    if request.kind in ("set", "jsonset", "relset", "casset"):
        value = b"v%d-" % opaque + b"x" * request.size
        datatype = 0
        if request.kind == "jsonset":
            value, datatype = b'{"v":%d,"x":"%s"}' % (opaque, b"x" * request.size), Datatype.JSON
        expiry = int(START_S) + 30 if request.size == 10 else 0  # past once the plan runs
        if request.kind == "relset":
            expiry = RELATIVE_S
        cas = cases.get(key, 0) if request.kind == "casset" else 0
        command = StoreCommand(
            Opcode.SET, vb, opaque, wire_key, value, flags=opaque, expiry=expiry, cas=cas,
            datatype=datatype,
        )  # fmt: skip
        return encode_store(command)
    if request.kind == "get":
        return encode_request(Opcode.GET, opaque=opaque, vbucket=vb, key=wire_key)
    if request.kind == "lock":
        extras = struct.pack(">I", 15)
        return encode_request(
            Opcode.GET_LOCKED, opaque=opaque, vbucket=vb, key=wire_key, extras=extras
        )
    cas = (0, cases.get(key, 0), 77)[request.cas_pick]
    extras = b"\x00" * 4 if request.kind == "baddelete" else b""  # EINVAL, per frame
    return encode_request(
        Opcode.DELETE, opaque=opaque, vbucket=vb, key=wire_key, cas=cas, extras=extras
    )


def batches(
    plan: list[Request], cases: dict[bytes, int], collections: bool = False
) -> list[bytes | None]:
    """The received batches (None: flush every vbucket there)."""
    out: list[bytes | None] = []
    current: list[bytes] = []
    for opaque, request in enumerate(plan, start=100):
        if request.kind == "flush":
            out += [b"".join(current), None]
            current = []
            continue
        current.append(encode(request, opaque, cases, collections))
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
    """Every key written (every third with an expiry that will have passed, k0 deleted, the
    others of every third JSON), flushed and closed: the reopened bucket has them in the
    store only."""
    bucket = Bucket.open(config, clock=lambda: clock[0], rng=random.Random(7))
    for n, key in enumerate(KEYS):
        expiry = int(START_S) + 5 if n % 3 == 2 else 0
        value, datatype = b"stored-%d" % n, 0
        if n % 3 == 1:
            value, datatype = b'{"stored":%d}' % n, Datatype.JSON
        bucket.store_command(
            StoreCommand(Opcode.SET, vb_of(key), 1, key, value, flags=n, expiry=expiry,
                         datatype=datatype)
        )  # fmt: skip
    bucket.delete(vb_of(KEYS[0]), KEYS[0])
    for vbucket in bucket.vbuckets.values():
        vbucket.flush()
        vbucket.close()
    bucket.store.close()


Outcome = tuple[bytes, list[tuple[int, int]], dict[tuple[int, bytes], Record | None]]


async def serve(
    config: NodeConfig,
    reference: bool,
    plan: list[Request],
    clock: list[float],
    collections: bool = False,
) -> Outcome:
    """Serve `plan` on a bucket of `config`: the answers' bytes, each vbucket's seqnos and
    every key's stored record."""
    users = Users()
    users.add("u", "p")
    bucket = Bucket.open(config, clock=lambda: clock[0], rng=random.Random(7))
    cases = {}
    for key in KEYS:
        found = bucket.vbucket(vb_of(key)).get(key)
        if found is not None:
            cases[key] = found.cas
    kind = FrameByFrame if reference else ClientConnection
    context = ServerContext(config, users, bucket)
    conn = kind(context)
    transport = RecordingTransport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    try:
        await sign_in(conn, transport)
        if collections:
            hello = struct.pack(">HHH", Feature.COLLECTIONS, Feature.MUTATION_SEQNO, Feature.JSON)
            conn.data_received(encode_request(Opcode.HELLO, opaque=3, key=b"t", value=hello))
        clock[0] = START_S + 60  # the preloaded expiries have passed
        for batch in batches(plan, cases, collections):
            if batch is None:
                for vbucket in bucket.vbuckets.values():
                    vbucket.flush()
            elif batch:
                conn.data_received(batch)
        for vbucket in bucket.vbuckets.values():
            vbucket.flush()
        seqnos = [(vb.high_seqno, vb.persisted_seqno) for vb in bucket.vbuckets.values()]
        stored_as = (lambda key: b"\x00" + key) if collections else (lambda key: key)
        stored = {(vb_of(key), key): bucket.store.get(vb_of(key), stored_as(key)) for key in KEYS}
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
@example(  # memory runs short in a mixed window: its writes go one at a time in request order
    [
        Request("set", 0, 0, 0, 0),
        Request("set", 0, 0, BIG, 0),
        Request("set", 1, 0, BIG, 0),
        Request("set", 1, 0, BIG, 0),
        Request("get", 2, 0, 0, 0),  # expired: queues its expiration before the last SET
        Request("set", 0, 0, BIG, 0),
    ]
)
@example(  # the same across vbuckets: k0's last SET is refused, not k2's (a fresh-clone find)
    [Request("set", 0, 0, 0, 0)] * 8
    + [Request("set", 0, 0, BIG, 0)]
    + [Request("set", 1, 0, 0, 0)] * 3
    + [Request("set", 1, 0, BIG, 0), Request("set", 2, 0, BIG, 0), Request("set", 0, 0, BIG, 0)]
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
    assert_twins_agree(tmp_path_factory.mktemp("twins"), plan)


def assert_twins_agree(root: Path, plan: list[Request], collections: bool = False) -> None:
    """Serve `plan` to a windowed connection and to one taking one frame at a time, each on
    its own preloaded bucket: the answer bytes, the seqnos and the stored records agree."""
    outcomes = []
    for reference in (False, True):
        clock = [START_S]
        config = config_for(root / ("reference" if reference else "windows"))
        preload(config, clock)
        outcomes.append(asyncio.run(serve(config, reference, plan, clock, collections)))
    (data, seqnos, stored), (want_data, want_seqnos, want_stored) = outcomes
    assert data == want_data
    assert seqnos == want_seqnos
    assert stored == want_stored


def test_a_run_memory_cannot_hold_answers_as_one_at_a_time(tmp_path: Path) -> None:
    """A window of SETs memory cannot hold at once (987fdec answered the last two TMPFAIL:
    the run asked room for all of them, where one at a time a repeated key's version is
    replaced first): `Bucket.set_run` applies it one write at a time."""
    plan = [
        Request("set", 0, 0, 0, 0),
        Request("set", 0, 0, 0, 0),
        Request("set", 0, 0, BIG, 0),
        Request("set", 0, 0, BIG, 0),
        Request("set", 1, 0, BIG, 0),
        Request("set", 1, 0, BIG, 0),
    ]
    assert_twins_agree(tmp_path, plan)


CORNERS = {
    "set, delete, set again": [
        Request("set", 1, 0, 0, 0),
        Request("delete", 1, 0, 0, 0),
        Request("set", 1, 0, 100, 0),
        Request("get", 3, 0, 0, 0),
        Request("delete", 1, 0, 0, 2),
    ],
    "deletes of keys only in the store": [
        Request("delete", 4, 0, 0, 0),
        Request("set", 7, 0, 0, 0),
        Request("delete", 5, 0, 0, 1),
        Request("delete", 0, 0, 0, 0),  # deleted before: KEY_ENOENT
        Request("delete", 6, 0, 0, 2),
    ],
    "a wrong CAS between sets": [
        Request("set", 6, 0, 0, 0),
        Request("delete", 6, 0, 0, 2),
        Request("set", 6, 0, 100, 0),
        Request("delete", 6, 0, 0, 1),  # the preloaded CAS: stale after the set
        Request("set", 9, 0, 0, 0),
    ],
    "a CAS set in the middle": [
        Request("set", 1, 0, 0, 0),
        Request("delete", 3, 0, 0, 0),
        Request("casset", 4, 0, 0, 0),
        Request("delete", 4, 0, 0, 0),
        Request("set", 1, 0, 0, 0),
    ],
    "a malformed delete in the middle": [
        Request("set", 1, 0, 0, 0),
        Request("delete", 3, 0, 0, 0),
        Request("baddelete", 4, 0, 0, 0),
        Request("delete", 1, 0, 0, 0),
        Request("set", 5, 0, 0, 0),
    ],
    "JSON documents": [
        Request("set", 3, 0, 0, 0),
        Request("get", 1, 0, 0, 0),  # stored JSON
        Request("jsonset", 6, 0, 100, 0),
        Request("get", 6, 0, 0, 0),  # JSON the window wrote
        Request("get", 4, 0, 0, 0),  # stored JSON
        Request("delete", 7, 0, 0, 0),
    ],
    "relative expiries, memory short": [  # a run of SETs only, then one with a GET
        Request("set", 0, 0, BIG, 0),
        Request("relset", 6, 0, 10, 0),
        Request("set", 1, 0, BIG, 0),
        Request("relset", 9, 0, 10, 0),
        Request("set", 3, 0, BIG, 0),
        Request("set", 4, 0, BIG, 0),  # TMPFAIL
        Request("flush", 0, 0, 0, 0),
        Request("relset", 1, 0, 10, 0),
        Request("get", 6, 0, 0, 0),
        Request("get", 9, 0, 0, 0),
    ],
    "empty and over-long keys": [
        Request("set", 1, 0, 0, 0),
        Request("get", 3, 0, 0, 0, odd_key=1),
        Request("delete", 3, 0, 0, 0, odd_key=1),
        Request("get", 4, 0, 0, 0, odd_key=2),
        Request("delete", 4, 0, 0, 0, odd_key=2),
        Request("get", 1, 0, 0, 0),
        Request("delete", 6, 0, 0, 0),
    ],
}


@pytest.mark.parametrize("collections", [False, True], ids=["classic", "collections"])
@pytest.mark.parametrize("name", list(CORNERS))
def test_window_corners_answer_as_one_frame_at_a_time(
    tmp_path: Path, name: str, collections: bool
) -> None:
    """Windows' corner cases, classic and with HELLO Collections + MutationSeqno + JSON (a
    key SET, DELETEd and SET again; DELETEs of keys only in the store; a wrong CAS between
    SETs; a CAS SET or a malformed DELETE in the middle of a window; JSON documents; SETs
    with a relative expiry while memory runs short; GETs and DELETEs of an empty or
    over-long key): the same answers, seqnos and records as one frame at a time."""
    plan = CORNERS[name]
    assert_twins_agree(tmp_path, plan, collections)
