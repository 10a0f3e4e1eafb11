"""The collections manifest in a stream's position, and per-collection high seqnos, on a real
node: a collections stream request may carry the manifest uid its client saw (kv_engine's
stream-request value ``{"uid": "<hex>"}``); a node whose manifest is behind it answers
COLLECTIONS_MANIFEST_IS_AHEAD. `DcpClient` records the uid of the system events it received
in its session state and resumes with it. GET_ALL_VB_SEQNOS with a collection id answers each
vbucket's high seqno of that collection. Both over a raw socket, and through our clients.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Iterator

import pytest

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import ClientConfig, DcpClient
from changefeed.consumer.collections_admin import edit_manifest
from changefeed.consumer.events import (
    Changes,
    CollectionEvent,
    Event,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.handshake import call, connect
from changefeed.consumer.session import SessionState
from changefeed.protocol.collections import encode_leb128, manifest_uid_of_error, split_key
from changefeed.protocol.dcp import (
    DcpOpen,
    OpenFlag,
    StreamRequest,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import decode_vb_seqnos, encode_hello, encode_request
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from support.clients import BUCKET, PASSWORD, USER, dcp_config
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(120)
VBUCKETS = 4
SEQNO_FOREVER = 2**64 - 1


class RawClient:
    """A blocking socket past HELLO (with or without Collections), SASL PLAIN and
    SELECT_BUCKET; requests are sent as encoded here and answers read frame by frame."""

    def __init__(self, node: NodeProcess, *, collections: bool) -> None:
        self.sock = socket.create_connection((HOST, node.port), timeout=30)
        self.reader = FrameReader()
        features = [Feature.XERROR, Feature.SELECT_BUCKET]
        if collections:
            features.append(Feature.COLLECTIONS)
        hello = self.ask(encode_hello(1, "raw-position-test", [int(f) for f in features]))
        assert hello.status == Status.SUCCESS, hello
        auth = encode_request(
            Opcode.SASL_AUTH, opaque=2, key=b"PLAIN", value=encode_plain(USER, PASSWORD)
        )
        assert self.ask(auth).status == Status.SUCCESS
        select = encode_request(Opcode.SELECT_BUCKET, opaque=3, key=BUCKET.encode())
        assert self.ask(select).status == Status.SUCCESS

    def ask(self, request: bytes) -> Frame:
        """Send `request` and return the next frame that is a response."""
        self.sock.sendall(request)
        while True:  # bounded by the socket's timeout
            while (frame := self.reader.next_frame()) is NEED_DATA:
                data = self.sock.recv(65536)
                assert data, "the node closed the connection"
                self.reader.feed(data)
            assert isinstance(frame, Frame)
            if frame.magic in (0x81, 0x18):  # a response (plain or alt framing)
                return frame

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def raw_clients() -> Iterator[list[RawClient]]:
    opened: list[RawClient] = []
    yield opened
    for client in opened:
        client.close()


async def create_orders(node: NodeProcess) -> tuple[int, int]:
    """Create shop.orders and write 2 documents per vbucket into it and 1 into the default
    collection. Returns (orders id, manifest uid)."""
    features = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS]
    conn = await connect(
        HOST, node.port, agent="position-test", user=USER, password=PASSWORD,
        bucket=BUCKET, features=features,
    )  # fmt: skip
    try:
        manifest = await edit_manifest(
            conn, lambda m: m.with_scope("shop").with_collection("shop", "orders")
        )
        orders = manifest.resolve("shop.orders")[1]
        assert orders is not None
        for vb in range(VBUCKETS):
            for n in range(2):
                await call(
                    conn, Opcode.SET, vbucket=vb, extras=struct.pack(">II", 0, 0),
                    key=encode_leb128(orders.uid) + b"o%d-%d" % (vb, n), value=b"order",
                )  # fmt: skip
            await call(
                conn, Opcode.SET, vbucket=vb, extras=struct.pack(">II", 0, 0),
                key=b"\x00d%d" % vb, value=b"default",
            )  # fmt: skip
        return orders.uid, manifest.uid
    finally:
        await conn.close()


def stream_request(vb: int, opaque: int, value: dict[str, object]) -> bytes:
    return encode_stream_request(StreamRequest(vb, opaque, 0, 0, SEQNO_FOREVER, 0, 0, 0, value))


def test_stream_request_manifest_uid_over_a_raw_socket(
    nodes: NodeFactory, raw_clients: list[RawClient]
) -> None:
    node = nodes(vbuckets=VBUCKETS)
    orders, uid = asyncio.run(create_orders(node))
    assert uid == 2, uid

    aware = RawClient(node, collections=True)
    raw_clients.append(aware)
    opened = aware.ask(encode_dcp_open(DcpOpen(10, "raw:uid", OpenFlag.PRODUCER)))
    assert opened.status == Status.SUCCESS
    # A uid the node has not reached: refused, the body naming the node's uid.
    ahead = aware.ask(stream_request(0, 11, {"uid": f"{uid + 1:x}", "collections": ["0"]}))
    assert ahead.status == Status.COLLECTIONS_MANIFEST_IS_AHEAD, ahead
    assert manifest_uid_of_error(bytes(ahead.value)) == uid
    # Ahead wins over a filter naming a collection this node does not know (yet).
    unknown = {"uid": f"{uid + 5:x}", "collections": ["ff"]}
    assert aware.ask(stream_request(0, 12, unknown)).status == Status.COLLECTIONS_MANIFEST_IS_AHEAD
    # Without the uid, that collection is unknown.
    unknown_now = aware.ask(stream_request(0, 13, {"collections": ["ff"]}))
    assert unknown_now.status == Status.UNKNOWN_COLLECTION
    # Not a hex string: EINVAL, the value named.
    for bad in (5, "", "xyz", "1" * 17):
        refused = aware.ask(stream_request(0, 14, {"uid": bad}))
        assert refused.status == Status.EINVAL, (bad, refused)
    # The node's uid, or one below it: accepted (with and without a filter).
    assert aware.ask(stream_request(0, 15, {"uid": f"{uid:x}"})).status == Status.SUCCESS
    accepted = aware.ask(stream_request(1, 16, {"uid": "1", "collections": [f"{orders:x}"]}))
    assert accepted.status == Status.SUCCESS, accepted

    # A connection without HELLO Collections cannot send one.
    plain = RawClient(node, collections=False)
    raw_clients.append(plain)
    assert plain.ask(encode_dcp_open(DcpOpen(20, "raw:plain", OpenFlag.PRODUCER))).status == 0
    refused = plain.ask(stream_request(0, 21, {"uid": "1"}))
    assert refused.status == Status.EINVAL
    assert b"HELLO Collections" in bytes(refused.value)


async def run_until_ended(client: DcpClient, vbuckets: int) -> list[Event]:
    """Events until every vbucket's stream ended or was refused."""
    events: list[Event] = []
    done = 0
    async for event in client.events():
        events.append(event)
        if isinstance(event, StreamEnded | StreamRefused):
            done += 1
            if done == vbuckets:
                break
    return events


def test_dcp_client_records_and_resumes_with_the_manifest_uid(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=VBUCKETS)

    async def scenario() -> None:
        uid = (await create_orders(node))[1]
        config = dcp_config(node, collections=("shop.orders",), reconnect_backoff_s=(0.01,))
        async with DcpClient(config) as client:
            await client.stream(list(range(VBUCKETS)))
            events = await run_until_ended(client, VBUCKETS)
            state = SessionState.from_json(client.session.to_json())
        created = [e for e in events if isinstance(e, CollectionEvent)]
        assert {e.vbucket for e in created} == set(range(VBUCKETS))
        # Every vbucket's session saw the creation of orders, at manifest uid 2.
        for vb in range(VBUCKETS):
            assert state.vbuckets[vb].manifest_uid == uid, (vb, state.vbuckets[vb])
            assert json.loads(state.to_json())[str(vb)]["manifest_uid"] == f"{uid:x}"

        # A state from a client that saw a newer manifest (as if from a node ahead of this
        # one): the resume sends it, this node answers COLLECTIONS_MANIFEST_IS_AHEAD, the
        # client tries again (a node catches up from etcd) and refuses it once its budget is
        # spent — it never streams from a node that lacks what it saw.
        ahead = SessionState.from_json(state.to_json())
        ahead.vbuckets[0].manifest_uid = uid + 1
        async with DcpClient(dcp_config(node, **config_fields(config))) as client:
            await client.stream([0], ahead)
            refused = await run_until_ended(client, 1)
        assert isinstance(refused[-1], StreamRefused), refused
        assert refused[-1].status == Status.COLLECTIONS_MANIFEST_IS_AHEAD
        assert not any(isinstance(e, StreamOpened) for e in refused)

        # The recorded state resumes: the uid (2) is the node's; nothing is sent again.
        async with DcpClient(dcp_config(node, **config_fields(config))) as client:
            await client.stream(list(range(VBUCKETS)), state)
            again = await run_until_ended(client, VBUCKETS)
        assert not any(isinstance(e, StreamRefused) for e in again), again
        assert not any(isinstance(e, CollectionEvent) for e in again)
        assert sum(isinstance(e, StreamOpened) for e in again) == VBUCKETS

    asyncio.run(scenario())


def config_fields(config: ClientConfig) -> dict[str, object]:
    """The options of `config` a second client reuses (its DCP name is new: dcp_config)."""
    return {
        "collections": config.collections,
        "reconnect_backoff_s": config.reconnect_backoff_s,
    }


def all_vb_seqnos(client: RawClient, state: int, cid: int | None) -> Frame:
    extras = struct.pack(">I", state) + (b"" if cid is None else struct.pack(">I", cid))
    return client.ask(encode_request(Opcode.GET_ALL_VB_SEQNOS, opaque=40, extras=extras))


def expected_high_seqnos(node: NodeProcess) -> dict[int, dict[int, int]]:
    """Per collection id, per vbucket: the newest seqno of its changes or its creation, from
    a collections stream of everything (the model the node's answer must equal)."""

    async def read() -> list[Event]:
        async with DcpClient(dcp_config(node, collections_aware=True)) as client:
            await client.stream(list(range(VBUCKETS)))
            return await run_until_ended(client, VBUCKETS)

    high: dict[int, dict[int, int]] = {}
    for event in asyncio.run(read()):
        if isinstance(event, Changes):
            cols = event.columns
            for vb, seqno, key in zip(cols.vbucket, cols.seqno, cols.key, strict=True):
                per_vb = high.setdefault(split_key(bytes(key))[0], {})
                per_vb[int(vb)] = max(per_vb.get(int(vb), 0), int(seqno))
        elif isinstance(event, CollectionEvent) and event.message.collection_id is not None:
            per_vb = high.setdefault(event.message.collection_id, {})
            per_vb[event.vbucket] = max(per_vb.get(event.vbucket, 0), event.message.seqno)
    return high


def test_all_vb_seqnos_of_one_collection(nodes: NodeFactory, raw_clients: list[RawClient]) -> None:
    node = nodes(vbuckets=VBUCKETS)

    async def load() -> tuple[int, int]:
        orders, _ = await create_orders(node)
        conn = await connect(
            HOST, node.port, agent="position-test", user=USER, password=PASSWORD,
            bucket=BUCKET, features=[Feature.XERROR, Feature.SELECT_BUCKET, Feature.COLLECTIONS],
        )  # fmt: skip
        try:
            manifest = await edit_manifest(conn, lambda m: m.with_collection("shop", "empty"))
            empty = manifest.resolve("shop.empty")[1]
            assert empty is not None
            # vb 1's newest orders change is a tombstone; vb 2 gets default writes after it.
            await call(conn, Opcode.DELETE, vbucket=1, key=encode_leb128(orders) + b"o1-0")
            for n in range(3):
                await call(
                    conn, Opcode.SET, vbucket=2, extras=struct.pack(">II", 0, 0),
                    key=b"\x00late%d" % n, value=b"default",
                )  # fmt: skip
            return orders, empty.uid
        finally:
            await conn.close()

    orders, empty = asyncio.run(load())

    def check() -> None:
        expected = expected_high_seqnos(node)
        client = RawClient(node, collections=True)
        raw_clients.append(client)
        for cid in (0, orders, empty):
            answer = all_vb_seqnos(client, 0, cid)
            assert answer.status == Status.SUCCESS, (cid, answer)
            got = decode_vb_seqnos(bytes(answer.value))
            want = [(vb, expected.get(cid, {}).get(vb, 0)) for vb in range(VBUCKETS)]
            assert got == want, (cid, got, want)
        # An empty collection's high seqno is its creation; vb 2's default writes came after.
        plain = dict(decode_vb_seqnos(bytes(all_vb_seqnos(client, 0, None).value)))
        assert all(0 < expected[empty][vb] <= plain[vb] for vb in range(VBUCKETS))
        assert expected[empty][2] < plain[2] and expected[0][2] == plain[2]
        # State filter 1 (active): every vbucket of this single node.
        active = decode_vb_seqnos(bytes(all_vb_seqnos(client, 1, orders).value))
        assert [vb for vb, _ in active] == list(range(VBUCKETS))
        # A collection the manifest does not hold: UNKNOWN_COLLECTION with the manifest uid.
        unknown = all_vb_seqnos(client, 0, 0x7777)
        assert unknown.status == Status.UNKNOWN_COLLECTION
        assert manifest_uid_of_error(bytes(unknown.value)) == 3
        # A connection without Collections may not name one.
        plain_client = RawClient(node, collections=False)
        raw_clients.append(plain_client)
        assert all_vb_seqnos(plain_client, 0, orders).status == Status.EINVAL

    check()  # partly in memory
    node.restart(clean=True)
    check()  # from disk only
