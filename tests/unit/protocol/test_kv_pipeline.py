"""``protocol/kv_pipeline.py`` (windows of pipelined store requests) against the per-frame codec
as the model, and the client paths built on it.

* ``encode_stores`` is byte for byte the concatenation of ``kv.encode_store`` per item, and
  raises the same ``ValueError`` for what that refuses;
* ``StoreReplies.feed`` (driven as ``Connection`` drives it: stop, decode the one frame it did
  not take, go on) gives, for any order of replies, any non-success statuses among them, any
  foreign frames in between and any split of the bytes into reads, exactly what decoding the
  whole stream with ``FrameReader`` and matching by opaque gives; plain successes, and only
  they, take the fast path;
* random and mutated bytes give a ``ProtocolError`` or a valid result, never another error;
* ``Connection`` routes a window's replies, single requests' replies and pushes as before, for
  any split of the stream into reads; ``KvClient.upsert_many`` against a fake node that answers
  out of order, with TMPFAIL and errors among the answers, keeps its results and errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import struct
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed.consumer.connection import Connection
from changefeed.consumer.kv_client import (
    PIPELINE_DEPTH_MAX,
    KvClient,
    _mutation_result,
    _vbuckets_of,
)
from changefeed.protocol.batch import Batch
from changefeed.protocol.dcp_items import Mutation, encode_mutation
from changefeed.protocol.errors import KeyExistsError, ProtocolError
from changefeed.protocol.frame import Frame, decode_frame, encode_frame
from changefeed.protocol.frame_info import encode_stream_id
from changefeed.protocol.kv import (
    MUTATION_TOKEN,
    MutationResult,
    StoreCommand,
    decode_store,
    encode_store,
)
from changefeed.protocol.kv_pipeline import (
    FRAME,
    OPAQUE_MASK,
    TOKEN,
    WAITING,
    StoreReplies,
    complete_frame_size,
    encode_stores,
)
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import FrameReader
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap, NodeAddress, vbucket_for_key

RESPONSE_MAGICS = (Magic.RESPONSE, Magic.ALT_RESPONSE)
FRAME_SIZE_MAX = 1 << 20

keys = st.binary(min_size=1, max_size=40)
values = st.binary(max_size=120)
opaques = st.one_of(
    st.integers(0, OPAQUE_MASK),
    st.integers(OPAQUE_MASK - 40, OPAQUE_MASK),  # windows that wrap around 2**32
    st.integers(0, 40),
)
store_opcodes = st.sampled_from([Opcode.SET, Opcode.ADD, Opcode.REPLACE])


# -- encoding --------------------------------------------------------------------------------


@given(
    items=st.lists(st.tuples(keys, values), max_size=30),
    opcode=store_opcodes,
    first=opaques,
    data=st.data(),
)
def test_encode_stores_is_encode_store_per_item(
    items: list[tuple[bytes, bytes]], opcode: int, first: int, data: st.DataObject
) -> None:
    vbuckets = data.draw(st.lists(st.integers(0, 0xFFFF), min_size=len(items), max_size=len(items)))
    expected = b"".join(
        encode_store(StoreCommand(opcode, vb, (first + i) & OPAQUE_MASK, key, value))
        for i, ((key, value), vb) in enumerate(zip(items, vbuckets, strict=True))
    )
    encoded = encode_stores(opcode, items, vbuckets, first)
    assert encoded == expected
    reader = FrameReader(FRAME_SIZE_MAX)
    reader.feed(encoded)
    commands = [decode_store(frame) for frame in reader.frames()]
    assert [(c.key, c.value, c.vbucket) for c in commands] == [
        (k, v, vb) for (k, v), vb in zip(items, vbuckets, strict=True)
    ]


@pytest.mark.parametrize(
    ("opcode", "key"),
    [(Opcode.GET, b"k"), (Opcode.SET, b"k" * 0x10000)],
    ids=["not a store opcode", "key too long"],
)
def test_encode_stores_refuses_what_encode_store_refuses(opcode: int, key: bytes) -> None:
    with pytest.raises(ValueError) as per_item:
        encode_store(StoreCommand(opcode, 0, 1, key, b"v"))
    with pytest.raises(ValueError) as window:
        encode_stores(opcode, [(b"a", b"1"), (key, b"v")], [0, 1], 1)
    assert str(window.value) == str(per_item.value)


@given(st.lists(st.tuples(keys, values), max_size=50), st.sampled_from([1, 4, 64, 1024]))
def test_vbuckets_of_is_vbucket_for_key(items: list[tuple[bytes, bytes]], vbuckets: int) -> None:
    assert _vbuckets_of(items, vbuckets) == [vbucket_for_key(k, vbuckets) for k, _ in items]


# -- replies: the model ------------------------------------------------------------------------


def token_reply(opaque: int, cas: int, uuid: int, seqno: int) -> bytes:
    return encode_frame(
        Magic.RESPONSE,
        Opcode.SET,
        opaque=opaque,
        cas=cas,
        extras=MUTATION_TOKEN.pack(uuid, seqno),
    )


u64 = st.integers(0, 2**64 - 1)


@st.composite
def reply_to(draw: st.DrawFn, opaque: int) -> bytes:
    """Any answer a node may give a SET: mostly plain successes, every other shape too."""
    kind = draw(
        st.sampled_from(
            ["token"] * 4 + ["bare", "with value", "status", "alt", "datatype", "key", "short"]
        )
    )
    cas, uuid, seqno = draw(u64), draw(u64), draw(u64)
    token = MUTATION_TOKEN.pack(uuid, seqno)
    if kind == "token":
        return token_reply(opaque, cas, uuid, seqno)
    if kind == "bare":  # MutationSeqno not negotiated
        return encode_frame(Magic.RESPONSE, Opcode.SET, opaque=opaque, cas=cas)
    if kind == "with value":
        value = draw(st.binary(min_size=1, max_size=30))
        return encode_frame(
            Magic.RESPONSE, Opcode.SET, opaque=opaque, cas=cas, extras=token, value=value
        )
    if kind == "status":
        status = draw(
            st.sampled_from(
                [Status.NOT_MY_VBUCKET, Status.ETMPFAIL, Status.KEY_EEXISTS, Status.E2BIG, 0x99]
            )
        )
        body = draw(st.sampled_from([b"", b'{"rev": 1}', b"not found", token]))
        return encode_frame(Magic.RESPONSE, Opcode.SET, vbucket=status, opaque=opaque, value=body)
    if kind == "alt":
        return encode_frame(
            Magic.ALT_RESPONSE,
            Opcode.SET,
            opaque=opaque,
            cas=cas,
            extras=token,
            framing_extras=encode_stream_id(draw(st.integers(1, 0xFFFF))),
        )
    if kind == "datatype":
        return encode_frame(
            Magic.RESPONSE, Opcode.SET, datatype=1, opaque=opaque, cas=cas, extras=token
        )
    if kind == "key":
        return encode_frame(Magic.RESPONSE, Opcode.SET, opaque=opaque, extras=token, key=b"k")
    return encode_frame(Magic.RESPONSE, Opcode.SET, opaque=opaque, extras=token[:8])  # short


@st.composite
def foreign_frame(draw: st.DrawFn, first: int, count: int) -> bytes:
    """A frame that is no answer to the window: another request's reply, a server push."""
    kind = draw(st.sampled_from(["reply", "noop", "mutation"]))
    if kind == "reply":
        outside = (first + count + draw(st.integers(0, 1000))) & OPAQUE_MASK
        return token_reply(outside, draw(u64), draw(u64), draw(u64))
    if kind == "noop":  # a request with an opaque inside the window: still not a reply
        return encode_frame(Magic.REQUEST, Opcode.DCP_NOOP, opaque=first)
    return encode_mutation(Mutation(vbucket=3, opaque=first, key=b"key", value=b"value", seqno=7))


@st.composite
def reply_streams(draw: st.DrawFn) -> tuple[int, int, bytes, list[int]]:
    """(first opaque, count, the wire bytes, split points): replies to some of a window's
    requests, in any order, some twice, foreign frames between them."""
    first = draw(opaques)
    count = draw(st.integers(1, 24))
    answered = draw(st.lists(st.integers(0, count - 1), max_size=2 * count))
    frames = [draw(reply_to((first + index) & OPAQUE_MASK)) for index in answered]
    frames += draw(st.lists(foreign_frame(first, count), max_size=4))
    frames = draw(st.permutations(frames))
    stream = b"".join(frames)
    splits = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    return first, count, stream, splits


def chunked(stream: bytes, splits: list[int]) -> list[bytes]:
    bounds = [0, *splits, len(stream)]
    return [stream[a:b] for a, b in itertools.pairwise(bounds)]


def model(first: int, count: int, stream: bytes) -> tuple[dict[int, Frame], list[Frame]]:
    """The per-frame path: every frame decoded; the first response per request index is the
    window's, everything else foreign."""
    reader = FrameReader(FRAME_SIZE_MAX)
    reader.feed(stream)
    answers: dict[int, Frame] = {}
    foreign: list[Frame] = []
    for frame in reader.frames():
        index = (frame.opaque - first) & OPAQUE_MASK
        if frame.magic in RESPONSE_MAGICS and index < count and index not in answers:
            answers[index] = frame
        else:
            foreign.append(frame)
    return answers, foreign


def drive(
    replies: StoreReplies, chunks: list[bytes], vectorise: bool | None = None
) -> tuple[list[Frame], int]:
    """Feed reads as ``Connection._receive`` does; returns the frames not taken and the bytes
    left unconsumed (an unfinished frame)."""
    buffer = bytearray()
    start = 0
    foreign: list[Frame] = []
    for chunk in chunks:
        buffer += chunk
        while True:  # bounded: each turn consumes a frame
            start = replies.feed(buffer, start, FRAME_SIZE_MAX, vectorise=vectorise)
            assert 0 <= start <= len(buffer)
            size = complete_frame_size(buffer, start, FRAME_SIZE_MAX)
            if size == 0:
                break
            frame = decode_frame(buffer, start, size)
            start += size
            assert not replies.take(frame), "feed left a frame the window takes"
            foreign.append(frame)
    return foreign, len(buffer) - start


def is_plain(frame: Frame) -> bool:
    return (
        frame.magic == Magic.RESPONSE
        and frame.status == Status.SUCCESS
        and len(frame.extras) == 16
        and not frame.key
        and not frame.value
        and not frame.framing_extras
        and frame.datatype == 0
    )


def check_against_model(
    replies: StoreReplies, answers: dict[int, Frame], *, fast_only: bool = True
) -> None:
    """``replies`` holds what the model found. ``fast_only``: every plain success took the
    fast path (``Connection`` decodes the rest of a read by the general path after a server
    push, so there some may arrive as frames)."""
    assert replies.remaining == replies.count - len(answers)
    for index in range(replies.count):
        frame = answers.get(index)
        state = replies.state[index]
        if frame is None:
            assert state == WAITING, index
            continue
        if is_plain(frame) and (fast_only or state == TOKEN):
            assert state == TOKEN, (index, frame)
            vb = index % 1024
            fast = MutationResult(
                vbucket=vb,
                seqno=replies.seqno[index],
                cas=replies.cas[index],
                vb_uuid=replies.vb_uuid[index],
            )
            assert fast == _mutation_result(frame, vb)  # what the general path makes of it
        else:
            assert state == FRAME, (index, frame)
            assert replies.frames[index] == frame
    assert set(replies.frames) == {i for i in range(replies.count) if replies.state[i] == FRAME}


vectorising = st.sampled_from([None, True, False])


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(reply_streams(), vectorising)
def test_feed_is_the_per_frame_path(
    case: tuple[int, int, bytes, list[int]], vectorise: bool | None
) -> None:
    first, count, stream, splits = case
    answers, foreign_expected = model(first, count, stream)
    replies = StoreReplies(first, count)
    foreign, left = drive(replies, chunked(stream, splits), vectorise)
    assert left == 0
    check_against_model(replies, answers)
    assert foreign == foreign_expected


@given(st.integers(1, 200), opaques, st.randoms(use_true_random=False), vectorising)
def test_in_order_plain_successes_all_take_the_fast_path(
    count: int, first: int, rnd: random.Random, vectorise: bool | None
) -> None:
    stream = b"".join(
        token_reply((first + i) & OPAQUE_MASK, i + 1, 77, 1000 + i) for i in range(count)
    )
    replies = StoreReplies(first, count)
    cut = rnd.randrange(len(stream) + 1)
    foreign, left = drive(replies, [stream[:cut], stream[cut:]], vectorise)
    assert (foreign, left, replies.remaining, replies.frames) == ([], 0, 0, {})
    assert replies.cas == [i + 1 for i in range(count)]
    assert replies.seqno == [1000 + i for i in range(count)]
    assert bytes(replies.state) == bytes([TOKEN]) * count


# -- fuzz ------------------------------------------------------------------------------------


def feed_or_protocol_error(
    first: int, count: int, chunks: list[bytes], vectorise: bool | None = None
) -> None:
    """The fuzz invariant: a valid result or ``ProtocolError``, and a consistent window."""
    replies = StoreReplies(first, count)
    with contextlib.suppress(ProtocolError):
        drive(replies, chunks, vectorise)
    states = bytes(replies.state)
    assert replies.remaining == states.count(WAITING)
    assert set(replies.frames) == {i for i, s in enumerate(states) if s == FRAME}
    assert all(s in (WAITING, TOKEN, FRAME) for s in states)


@settings(max_examples=300)
@given(
    opaques,
    st.integers(0, 40),
    st.binary(max_size=300),
    st.lists(st.integers(0, 300), max_size=5),
    vectorising,
)
def test_fuzz_random_bytes(
    first: int, count: int, data: bytes, splits: list[int], vectorise: bool | None
) -> None:
    cuts = sorted(min(s, len(data)) for s in splits)
    feed_or_protocol_error(first, count, chunked(data, cuts), vectorise)


def mutate(stream: bytes, rnd: random.Random) -> bytes:
    """Bit flips, overwrites, truncation, header field corruption, insertion and deletion."""
    data = bytearray(stream)
    for _ in range(rnd.randint(1, 4)):
        if not data:
            data += rnd.randbytes(rnd.randint(1, 40))
        what = rnd.randrange(6)
        at = rnd.randrange(len(data))
        if what == 0:
            data[at] ^= 1 << rnd.randrange(8)
        elif what == 1:
            data[at] = rnd.choice([0x00, 0x08, 0x18, 0x80, 0x81, 0x82, 0xFF, rnd.randrange(256)])
        elif what == 2:
            del data[at:]
        elif what == 3 and len(data) >= at + 12:  # a length field: body, key, extras
            field = rnd.choice([(8, ">I"), (2, ">H"), (4, ">B")])
            offset, fmt = field
            if at + offset + struct.calcsize(fmt) <= len(data):
                limit = 2 ** (8 * struct.calcsize(fmt)) - 1
                struct.pack_into(fmt, data, at + offset, rnd.choice([0, 1, 16, 17, limit]))
        elif what == 4:
            data[at:at] = rnd.randbytes(rnd.randint(1, 30))
        else:
            del data[at : at + rnd.randint(1, 30)]
    return bytes(data)


def test_fuzz_mutated_reply_streams(rng: random.Random) -> None:
    for case in range(3000):
        first = rng.choice([0, 1, OPAQUE_MASK - 3, rng.randrange(OPAQUE_MASK + 1)])
        count = rng.randint(1, 12)
        frames = [
            token_reply((first + rng.randrange(count + 2)) & OPAQUE_MASK, case, 5, 9)
            if rng.random() < 0.7
            else encode_frame(
                rng.choice([Magic.RESPONSE, Magic.ALT_RESPONSE, Magic.REQUEST]),
                Opcode.SET,
                vbucket=rng.choice([0, Status.ETMPFAIL, Status.NOT_MY_VBUCKET]),
                opaque=(first + rng.randrange(count)) & OPAQUE_MASK,
                value=rng.randbytes(rng.randint(0, 20)),
            )
            for _ in range(rng.randint(1, 8))
        ]
        stream = mutate(b"".join(frames), rng)
        cuts = sorted(rng.randrange(len(stream) + 1) for _ in range(rng.randint(0, 3)))
        try:
            feed_or_protocol_error(first, count, chunked(stream, cuts), rng.choice([True, False]))
        except AssertionError as error:
            raise AssertionError(f"case {case}: {stream.hex()}") from error


# -- Connection -------------------------------------------------------------------------------


class _Transport:
    def is_closing(self) -> bool:
        return False


class FakeWriter:
    """What ``Connection`` uses of a ``StreamWriter``; nothing is sent anywhere."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None

    async def wait_closed(self) -> None:
        return None


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reply_streams(), st.booleans())
def test_connection_routes_window_replies_for_any_reads(
    case: tuple[int, int, bytes, list[int]], single_first: bool
) -> None:
    """A window, a single request waiting amid it, pushes: each gets what the model says."""
    first, count, stream, splits = case
    single_opaque = (first + count + 5000) & OPAQUE_MASK
    single_reply = token_reply(single_opaque, 1, 2, 3)
    stream = single_reply + stream if single_first else stream + single_reply
    splits = [s + (len(single_reply) if single_first else 0) for s in splits]
    answers, foreign = model(first, count, stream)
    foreign = [f for f in foreign if f.opaque != single_opaque]
    pushed: list[Frame] = []
    changes = 0

    def on_push(batch: Batch) -> None:
        nonlocal changes
        pushed.extend(frame for _, frame in batch.controls)
        changes += len(batch.changes)

    async def main() -> tuple[StoreReplies, asyncio.Future[StoreReplies], Frame]:
        reader = asyncio.StreamReader()
        conn = Connection(reader, FakeWriter())  # type: ignore[arg-type]
        conn.on_push = on_push
        conn._next_opaque = first  # the window starts where the case says
        start = conn.reserve_opaques(count)
        assert start == first
        replies, done = conn.expect_window(start, count)
        waiting = conn.expect(single_opaque)
        for chunk in chunked(stream, splits):
            reader.feed_data(chunk)
            for _ in range(3):
                await asyncio.sleep(0)  # the read loop takes the chunk alone
        assert conn.closed is None
        single = await asyncio.wait_for(waiting, 5)
        await conn.close()
        return replies, done, single

    replies, done, single = asyncio.run(main())
    assert single == decode_frame(single_reply, 0, len(single_reply))
    check_against_model(replies, answers, fast_only=False)
    if len(answers) == count:
        assert done.result() is replies
    dcp_items = sum(1 for f in foreign if f.magic == Magic.REQUEST and f.opcode != Opcode.DCP_NOOP)
    assert changes == dcp_items
    assert pushed == [
        f for f in foreign if not (f.magic == Magic.REQUEST and f.opcode != Opcode.DCP_NOOP)
    ]


# -- KvClient against a fake node -------------------------------------------------------------


def fake_node(answer: Callable[[Frame, int], bytes]) -> Callable[..., Coroutine[Any, Any, None]]:
    """A node that answers each read's requests in reverse order (out of order), each with
    ``answer(request, attempt)`` (attempt: how many times that key came before)."""
    seen: dict[bytes, int] = {}

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = FrameReader(1 << 20)
        while True:  # until the client closes
            data = await reader.read(1 << 16)
            if not data:
                break
            frames.feed(data)
            out = []
            for frame in frames.frames():
                out.append(answer(frame, seen.get(frame.key, 0)))
                seen[frame.key] = seen.get(frame.key, 0) + 1
            writer.write(b"".join(reversed(out)))
            await writer.drain()
        writer.close()

    return serve


def run_client(
    answer: Callable[[Frame, int], bytes],
    scenario: Callable[[KvClient], Coroutine[Any, Any, None]],
) -> None:
    async def main() -> None:
        server = await asyncio.start_server(fake_node(answer), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        kv = KvClient(await Connection.open("127.0.0.1", port), 16, tmpfail_retry_s=5.0)
        try:
            await scenario(kv)
        finally:
            await kv.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())


def expected_result(key: bytes, vb: int) -> MutationResult:
    n = int(key.split(b"-")[1])
    return MutationResult(vbucket=vb, seqno=n + 1, cas=1000 + n, vb_uuid=42 + vb)


def succeed(frame: Frame) -> bytes:
    n = int(frame.key.split(b"-")[1])
    return token_reply(frame.opaque, 1000 + n, 42 + frame.vbucket, n + 1)


def test_upsert_many_out_of_order_with_tmpfail_and_bare_answers() -> None:
    items = [(b"key-%d" % n, b"v%d" % n) for n in range(2500)]

    def answer(frame: Frame, attempt: int) -> bytes:
        n = int(frame.key.split(b"-")[1])
        if n % 7 == 0 and attempt < 2:  # shedding load: TMPFAIL twice, then taken
            return encode_frame(
                Magic.RESPONSE, Opcode.SET, vbucket=Status.ETMPFAIL, opaque=frame.opaque
            )
        if n % 11 == 0:  # MutationSeqno not negotiated: no token
            return encode_frame(Magic.RESPONSE, Opcode.SET, opaque=frame.opaque, cas=1000 + n)
        return succeed(frame)

    async def scenario(kv: KvClient) -> None:
        results = await kv.upsert_many(items)
        expected = []
        for key, _ in items:
            vb = kv.vbucket_of(key)
            n = int(key.split(b"-")[1])
            if n % 11 == 0:
                expected.append(MutationResult(vbucket=vb, seqno=0, cas=1000 + n, vb_uuid=0))
            else:
                expected.append(expected_result(key, vb))
        assert results == expected
        assert kv.temporary_failures == 2 * len([1 for n in range(2500) if n % 7 == 0])

    run_client(answer, scenario)


def test_upsert_many_raises_the_first_error_in_input_order() -> None:
    items = [(b"key-%d" % n, b"v") for n in range(300)]

    def answer(frame: Frame, attempt: int) -> bytes:
        n = int(frame.key.split(b"-")[1])
        if n in (120, 250):
            return encode_frame(
                Magic.RESPONSE,
                Opcode.SET,
                vbucket=Status.KEY_EEXISTS,
                opaque=frame.opaque,
                value=b"exists %d" % n,
            )
        return succeed(frame)

    async def scenario(kv: KvClient) -> None:
        with pytest.raises(KeyExistsError, match="exists 120"):
            await kv.upsert_many(items)
        # The connection is fine afterwards: the next window is answered.
        results = await kv.upsert_many(items[:5])
        assert results == [expected_result(k, kv.vbucket_of(k)) for k, _ in items[:5]]

    run_client(answer, scenario)


def test_upsert_many_follows_the_map_across_two_nodes() -> None:
    """A stale map sends every write to node A; A answers NOT_MY_VBUCKET with the real map
    for the vbuckets B holds; the client adopts it, sends those to B, keeps input order, and
    sends later windows by the real map."""
    vbuckets = 16
    items = [(b"key-%d" % n, b"v") for n in range(2 * PIPELINE_DEPTH_MAX + 452)]

    async def main() -> None:
        maps: dict[str, ClusterMap] = {}

        def answer_as(owner: int) -> Callable[[Frame, int], bytes]:
            def answer(frame: Frame, attempt: int) -> bytes:
                config = json.dumps(maps["real"].couchbase_config("default")).encode()
                if frame.opcode == Opcode.GET_CLUSTER_CONFIG:
                    return encode_frame(
                        Magic.RESPONSE, frame.opcode, opaque=frame.opaque, value=config
                    )
                if frame.vbucket % 2 != owner:
                    return encode_frame(
                        Magic.RESPONSE,
                        Opcode.SET,
                        vbucket=Status.NOT_MY_VBUCKET,
                        opaque=frame.opaque,
                        value=config,
                    )
                return succeed(frame)

            return answer

        servers = [
            await asyncio.start_server(fake_node(answer_as(o)), "127.0.0.1", 0) for o in (0, 1)
        ]
        nodes = tuple(
            NodeAddress(f"127.0.0.1:{port}", "127.0.0.1", port)
            for port in (server.sockets[0].getsockname()[1] for server in servers)
        )
        maps["real"] = ClusterMap(5, nodes, tuple((vb % 2,) for vb in range(vbuckets)))
        stale = ClusterMap(1, nodes, tuple((0,) for _ in range(vbuckets)))

        async def connector(host: str, port: int) -> Connection:
            return await Connection.open(host, port)

        kv = KvClient(
            await connector("127.0.0.1", nodes[0].port),
            vbuckets,
            cluster_map=stale,
            connector=connector,
        )
        try:
            results = await kv.upsert_many(items)
            assert results == [expected_result(k, kv.vbucket_of(k)) for k, _ in items]
            # Two windows are in flight: the second left on the stale map too, before the
            # first's answers taught the new one; the third went out on the real map.
            first_two_windows = items[: 2 * PIPELINE_DEPTH_MAX]
            assert len(items) > 2 * PIPELINE_DEPTH_MAX
            assert kv.retries == sum(kv.vbucket_of(k) % 2 for k, _ in first_two_windows)
            assert kv.cluster_map == maps["real"]
        finally:
            await kv.close()
            for server in servers:
                server.close()
                await server.wait_closed()

    asyncio.run(main())
