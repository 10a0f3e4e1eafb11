"""The node's side of the Couchbase SDK's bootstrap and KV surface, through a connection in
this process: HELLO negotiation, GET_ERROR_MAP, SELECT_BUCKET of an unknown bucket, the
cluster map push (sent once per version, only to who asked), the XERROR-less statuses, the
second privilege of GAT and counters, and DURABILITY_IMPOSSIBLE on every new mutation."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from changefeed.protocol import kv_ops, subdoc
from changefeed.protocol.error_map import decode_error_map, encode_get_error_map
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.frame_info import FRAME_INFO_DURABILITY, encode_frame_info
from changefeed.protocol.kv import (
    StoreCommand,
    decode_hello,
    encode_hello,
    encode_request,
    encode_store,
)
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.reader import NEED_DATA, FrameReader
from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from changefeed.protocol.subdoc import DocFlag, PathFlag, Spec
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from changefeed.vbmap import vbucket_for_key
from support.buckets import ManualClock
from support.transports import RecordingTransport

VBUCKETS = 4
# What the SDK's C++ core asks for in its HELLO (core/protocol/cmd_hello.hxx, with its default
# options: unordered execution, cluster map notification, compression, mutation tokens).
SDK_FEATURES = [
    Feature.TCP_NODELAY, Feature.XATTR, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON,
    Feature.DUPLEX, Feature.ALT_REQUEST_SUPPORT, Feature.TRACING, Feature.SYNC_REPLICATION,
    Feature.VATTR, Feature.COLLECTIONS, Feature.SUBDOC_CREATE_AS_DELETED, Feature.PRESERVE_TTL,
    Feature.SUBDOC_REPLICA_READ, Feature.SUBDOC_BINARY_XATTR, Feature.UNORDERED_EXECUTION,
    Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.DEDUPE_NOT_MY_VBUCKET_CLUSTERMAP,
    Feature.SNAPPY, Feature.MUTATION_SEQNO,
]  # fmt: skip
GRANTED = [
    Feature.TCP_NODELAY, Feature.XATTR, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON,
    Feature.DUPLEX, Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION, Feature.VATTR,
    Feature.COLLECTIONS, Feature.PRESERVE_TTL, Feature.SUBDOC_REPLICA_READ,
    Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.MUTATION_SEQNO,
]  # fmt: skip


def replies(data: bytes) -> list[Frame]:
    if not data:  # feeding b"" would mean end of stream
        return []
    reader = FrameReader(1 << 26)
    reader.feed(data)
    out = []
    while (frame := reader.next_frame()) is not NEED_DATA:
        assert isinstance(frame, Frame)
        out.append(frame)
    return out


class Node:
    """A bucket, a context and connections made on it, all in this process."""

    def __init__(self, path: Path) -> None:
        self.clock = ManualClock()
        config = NodeConfig(data_dir=path, vbuckets=VBUCKETS, durable=False)
        users = Users()
        users.add("admin", "pw")
        users.add("writer", "pw", roles=["data_writer"])
        self.bucket = Bucket.open(config, clock=self.clock)
        self.context = ServerContext(config, users, self.bucket)
        self.loop = asyncio.new_event_loop()

    def connect(
        self, features: Sequence[int], *, user: str = "admin", bucket: str | None = "default"
    ) -> Client:
        client = Client(ClientConnection(self.context), self.loop)
        client.hello(features)
        client.login(user)
        if bucket is not None:
            assert (
                client.call(encode_request(Opcode.SELECT_BUCKET, key=bucket.encode())).status == 0
            )
        return client

    def close(self) -> None:
        for vbucket in self.bucket.vbuckets.values():
            vbucket.close()
        self.bucket.store.close()
        self.loop.close()


class Client:
    def __init__(self, connection: ClientConnection, loop: asyncio.AbstractEventLoop) -> None:
        self.connection = connection
        self.transport = RecordingTransport()
        self.loop = loop
        connection.connection_made(self.transport)  # type: ignore[arg-type]

    def frames(self) -> list[Frame]:
        """Everything written since the last call."""
        data = b"".join(self.transport.writes)
        self.transport.writes.clear()
        return replies(data)

    def call(self, request: bytes) -> Frame:
        self.connection.data_received(request)
        (answer,) = self.frames()
        return answer

    def hello(self, features: Sequence[int]) -> list[int]:
        answer = self.call(encode_hello(1, "test", list(features)))
        return list(decode_hello(answer).features)

    def login(self, user: str) -> None:
        request = encode_request(Opcode.SASL_AUTH, key=b"PLAIN", value=encode_plain(user, "pw"))

        async def wait() -> None:
            self.connection.data_received(request)
            while not self.transport.writes:  # PLAIN is hashed off the loop
                await asyncio.sleep(0.001)

        self.loop.run_until_complete(wait())
        (answer,) = self.frames()
        assert answer.status == Status.SUCCESS


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    made = Node(tmp_path)
    try:
        yield made
    finally:
        made.close()


def vb(key: bytes) -> int:
    return vbucket_for_key(key, VBUCKETS)


def test_hello_grants_what_the_sdk_asks_that_the_node_supports(node: Node) -> None:
    client = Client(ClientConnection(node.context), node.loop)
    assert client.hello(SDK_FEATURES) == GRANTED
    # Notifications need Duplex; the brief form wins when both are asked; VATTR needs XATTR.
    assert client.hello([Feature.CLUSTERMAP_CHANGE_NOTIFICATION]) == []
    both = [
        Feature.DUPLEX,
        Feature.CLUSTERMAP_CHANGE_NOTIFICATION,
        Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF,
    ]
    assert client.hello(both) == [Feature.DUPLEX, Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF]
    assert client.hello([Feature.VATTR]) == []


def test_the_error_map_and_select_bucket_statuses(node: Node) -> None:
    client = node.connect([Feature.XERROR], bucket=None)
    answer = client.call(encode_get_error_map(3, 2))
    assert answer.status == Status.SUCCESS and answer.datatype == 1
    version, _, entries = decode_error_map(answer.value)
    assert version == 2 and Status.LOCKED in entries
    assert client.call(encode_get_error_map(4, 0)).status == Status.KEY_ENOENT
    # An unknown bucket is "no access", as Couchbase says it (the SDK: BucketNotFound).
    unknown = client.call(encode_request(Opcode.SELECT_BUCKET, key=b"nope"))
    assert unknown.status == Status.EACCESS
    assert client.call(encode_request(Opcode.SELECT_BUCKET, key=b"default")).status == 0


def notifications(client: Client) -> list[kv_ops.ClusterMapNotification]:
    return [kv_ops.decode_clustermap_notification(f) for f in client.frames()]


def test_the_cluster_map_is_pushed_once_per_version_to_who_asked(node: Node) -> None:
    full = node.connect([Feature.DUPLEX, Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.JSON])
    brief = node.connect([Feature.DUPLEX, Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF])
    silent = node.connect([Feature.XERROR])
    unselected = node.connect([Feature.DUPLEX, Feature.CLUSTERMAP_CHANGE_NOTIFICATION], bucket=None)
    context = node.context
    epoch, rev = context.cluster_map_version()
    # A client that fetched the map is not sent the same version.
    fetched = full.call(encode_request(Opcode.GET_CLUSTER_CONFIG))
    assert json.loads(fetched.value)["rev"] == rev
    assert context.push_cluster_map() == 1  # only `brief` has not seen this version
    (sent,) = notifications(brief)
    assert (sent.epoch, sent.revision, sent.bucket, sent.config) == (epoch, rev, "default", b"")
    assert notifications(full) == [] and context.push_cluster_map() == 0

    context.cluster_map = dataclasses.replace(context.current_map(), rev=rev + 1)
    assert context.push_cluster_map() == 2
    (sent,) = notifications(full)
    assert sent.revision == rev + 1 and sent.config == context.cluster_config_json()
    assert json.loads(sent.config)["rev"] == rev + 1
    assert [n.revision for n in notifications(brief)] == [rev + 1]
    assert notifications(silent) == [] and notifications(unselected) == []
    assert context.push_cluster_map() == 0  # deduplicated

    full.connection.connection_lost(None)
    assert full.connection not in context.map_subscribers


def test_locked_statuses_are_etmpfail_without_xerror(node: Node) -> None:
    key = b"k"
    old = node.connect([])
    new = node.connect([Feature.XERROR])
    old.call(encode_store(StoreCommand(Opcode.SET, vb(key), 1, key, b"v")))
    unlock = encode_request(Opcode.UNLOCK_KEY, vbucket=vb(key), key=key, cas=5)
    assert new.call(unlock).status == Status.NOT_LOCKED
    assert old.call(unlock).status == Status.ETMPFAIL
    new.call(kv_ops.encode_get_locked(key, 5, vbucket=vb(key)))
    write = encode_store(StoreCommand(Opcode.SET, vb(key), 2, key, b"w"))
    assert new.call(write).status == Status.LOCKED
    assert old.call(write).status == Status.ETMPFAIL


def test_gat_and_counters_need_read_as_well_as_write(node: Node) -> None:
    writer = node.connect([Feature.XERROR], user="writer")
    key = b"k"
    writer.call(encode_store(StoreCommand(Opcode.SET, vb(key), 1, key, b"1")))
    assert writer.call(kv_ops.encode_touch(Opcode.TOUCH, key, 5, vbucket=vb(key))).status == 0
    gat = writer.call(kv_ops.encode_touch(Opcode.GAT, key, 5, vbucket=vb(key)))
    assert gat.status == Status.EACCESS
    increment = kv_ops.Arithmetic(Opcode.INCREMENT, key, 1, 0, 0)
    counter = writer.call(kv_ops.encode_arithmetic(increment, vbucket=vb(key)))
    assert counter.status == Status.EACCESS


def test_counters_append_and_subdoc_over_the_wire(node: Node) -> None:
    client = node.connect([Feature.XERROR, Feature.MUTATION_SEQNO, Feature.XATTR])
    key = b"n"
    command = kv_ops.Arithmetic(Opcode.INCREMENT, key, 5, 2**64 - 2, 0)
    created = client.call(kv_ops.encode_arithmetic(command, vbucket=vb(key)))
    assert kv_ops.decode_arithmetic_value(created.value) == 2**64 - 2
    assert len(created.extras) == 16  # the mutation token
    wrapped = client.call(kv_ops.encode_arithmetic(command, vbucket=vb(key)))
    assert kv_ops.decode_arithmetic_value(wrapped.value) == 3
    append = encode_request(Opcode.APPEND, vbucket=vb(key), key=key, value=b"x")
    assert client.call(append).status == Status.SUCCESS
    again = client.call(kv_ops.encode_arithmetic(command, vbucket=vb(key)))
    assert again.status == Status.DELTA_BADVAL  # "3x" is not a number
    missing = encode_request(Opcode.PREPEND, vbucket=vb(b"m"), key=b"m", value=b"x")
    assert client.call(missing).status == Status.NOT_STORED

    doc = b"d"
    client.call(encode_store(StoreCommand(Opcode.SET, vb(doc), 1, doc, b'{"a": [1]}')))
    lookup = subdoc.MultiLookup(
        doc,
        (
            Spec(Opcode.SUBDOC_GET, PathFlag.XATTR_PATH, b"$document.revid"),
            Spec(Opcode.SUBDOC_GET, PathFlag.XATTR_PATH, b"$nope"),
            Spec(Opcode.SUBDOC_GET, PathFlag.XATTR_PATH, b"user"),
            Spec(Opcode.SUBDOC_GET_COUNT, PathFlag.NONE, b"a"),
            Spec(Opcode.SUBDOC_GET, PathFlag.NONE, b"b"),
        ),
    )
    answer = client.call(subdoc.encode_multi_lookup(lookup, vbucket=vb(doc)))
    assert answer.status == Status.SUBDOC_MULTI_PATH_FAILURE
    assert subdoc.decode_lookup_results(answer.value) == [
        subdoc.LookupResult(Status.SUCCESS, b'"1"'),
        subdoc.LookupResult(Status.SUBDOC_XATTR_UNKNOWN_VATTR),
        subdoc.LookupResult(Status.SUBDOC_PATH_ENOENT),
        subdoc.LookupResult(Status.SUCCESS, b"1"),
        subdoc.LookupResult(Status.SUBDOC_PATH_ENOENT),
    ]
    plain = node.connect([Feature.XERROR])  # no XATTR: xattr paths are not supported
    assert plain.call(subdoc.encode_multi_lookup(lookup, vbucket=vb(doc))).status == (
        Status.NOT_SUPPORTED
    )
    user_xattr = subdoc.MultiMutation(
        doc, (Spec(Opcode.SUBDOC_DICT_UPSERT, PathFlag.XATTR_PATH, b"u", b"1"),)
    )
    assert client.call(subdoc.encode_multi_mutation(user_xattr, vbucket=vb(doc))).status == (
        Status.NOT_SUPPORTED
    )
    failing = subdoc.MultiMutation(
        doc,
        (
            Spec(Opcode.SUBDOC_COUNTER, PathFlag.NONE, b"c", b"1"),
            Spec(Opcode.SUBDOC_DICT_ADD, PathFlag.NONE, b"a", b"2"),
        ),
    )
    answer = client.call(subdoc.encode_multi_mutation(failing, vbucket=vb(doc)))
    assert answer.status == Status.SUBDOC_MULTI_PATH_FAILURE
    assert subdoc.decode_mutation_results(answer.value) == [
        subdoc.MutationResult(1, Status.SUBDOC_PATH_EEXISTS)
    ]
    creating = subdoc.MultiMutation(
        b"new", (Spec(Opcode.SUBDOC_ARRAY_PUSH_LAST, PathFlag.NONE, b"", b"1, 2"),), DocFlag.ADD, 60
    )
    answer = client.call(subdoc.encode_multi_mutation(creating, vbucket=vb(b"new")))
    assert answer.status == Status.SUCCESS and len(answer.extras) == 16
    document = node.bucket.get(vb(b"new"), b"new")
    assert document.value == b"[1,2]" and document.datatype == 1
    assert document.expiry == int(node.clock.now) + 60


def durable(opcode: int, key: bytes, extras: bytes = b"", value: bytes = b"") -> bytes:
    return encode_frame(
        Magic.ALT_REQUEST,
        opcode,
        vbucket=vb(key),
        extras=extras,
        key=key,
        value=value,
        framing_extras=encode_frame_info(FRAME_INFO_DURABILITY, b"\x01"),
    )


# Counters, append/prepend and mutate_in take durability levels (tests/sdk: honoured on a
# node); TOUCH and GAT take none, as the SDKs send none.
DURABLE_REQUESTS: dict[str, Callable[[], bytes]] = {
    "touch": lambda: durable(Opcode.TOUCH, b"k", kv_ops.U32.pack(9)),
    "gat": lambda: durable(Opcode.GAT, b"k", kv_ops.U32.pack(9)),
}


@pytest.mark.parametrize("name", list(DURABLE_REQUESTS))
def test_touch_and_gat_refuse_durability(node: Node, name: str) -> None:
    client = node.connect([Feature.XERROR, Feature.ALT_REQUEST_SUPPORT, Feature.SYNC_REPLICATION])
    client.call(encode_store(StoreCommand(Opcode.SET, vb(b"k"), 1, b"k", b"1")))
    before = node.bucket.get(vb(b"k"), b"k")
    assert client.call(DURABLE_REQUESTS[name]()).status == Status.DURABILITY_IMPOSSIBLE
    assert node.bucket.get(vb(b"k"), b"k") == before
