"""Collection-aware DCP on a real node: writes in named collections over a collections KV
connection, then streams that see only their collections, system events in seqno order with
the documents, SEQNO_ADVANCED over what a filter leaves out, a client without collections that
sees the default collection only as before, and a resume from a state that records its filter.
"""

from __future__ import annotations

import asyncio
import json
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import DcpClient
from changefeed.consumer.collections_admin import edit_manifest
from changefeed.consumer.connection import Connection
from changefeed.consumer.events import (
    Changes,
    CollectionEvent,
    Event,
    SeqnoAdvanced,
    StreamEnded,
    StreamRefused,
)
from changefeed.consumer.handshake import call, connect
from changefeed.protocol.collections import SystemEvent, encode_leb128, split_key
from changefeed.protocol.errors import StatusError
from changefeed.protocol.kv import CompactDb, encode_compact_db
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.status import Status
from support.clients import BUCKET, PASSWORD, USER, dcp_config
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(120)
VBUCKETS = 4


async def kv(node: NodeProcess) -> Connection:
    features = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS]
    return await connect(
        HOST, node.port, agent="collections-test", user=USER, password=PASSWORD,
        bucket=BUCKET, features=features,
    )  # fmt: skip


async def put(conn: Connection, cid: int, key: bytes, value: bytes, vb: int) -> None:
    await call(
        conn, Opcode.SET, vbucket=vb, extras=struct.pack(">II", 0, 0),
        key=encode_leb128(cid) + key, value=value,
    )  # fmt: skip


async def collect(node: NodeProcess, **config: object) -> list[Event]:
    """Every event of every vbucket up to the high seqnos now (to_latest)."""
    events: list[Event] = []
    async with DcpClient(dcp_config(node, to_latest=True, **config)) as client:
        await client.stream(list(range(VBUCKETS)))
        ended = 0
        async for event in client.events():
            events.append(event)
            if isinstance(event, StreamRefused):
                break
            if isinstance(event, StreamEnded):
                ended += 1
                if ended == VBUCKETS:
                    break
    return events


def changes(events: list[Event]) -> list[tuple[int, int, bytes]]:
    """(vb, seqno, key as received) of every change."""
    out = []
    for event in events:
        if isinstance(event, Changes):
            cols = event.columns
            out += list(zip(cols.vbucket, cols.seqno, cols.key, strict=True))
    return [(int(vb), int(s), bytes(k)) for vb, s, k in out]


def positions(events: list[Event]) -> dict[int, list[tuple[int, str]]]:
    """Per vbucket, in arrival order: (seqno, what) of changes, events and seqno advances."""
    out: dict[int, list[tuple[int, str]]] = {}
    for event in events:
        if isinstance(event, Changes):
            cols = event.columns
            for vb, seqno in zip(cols.vbucket, cols.seqno, strict=True):
                out.setdefault(int(vb), []).append((int(seqno), "change"))
        elif isinstance(event, CollectionEvent):
            out.setdefault(event.vbucket, []).append((event.message.seqno, "event"))
        elif isinstance(event, SeqnoAdvanced):
            out.setdefault(event.vbucket, []).append((event.seqno, "advanced"))
    return out


def test_filtered_streams_events_and_legacy_clients(nodes: NodeFactory, tmp_path: Path) -> None:
    node = nodes(vbuckets=VBUCKETS)

    async def scenario() -> int:
        conn = await kv(node)
        try:
            manifest = await edit_manifest(
                conn,
                lambda m: (
                    m.with_scope("shop")
                    .with_collection("shop", "orders")
                    .with_collection("shop", "carts")
                ),
            )
            scope, orders = manifest.resolve("shop.orders")
            carts = manifest.resolve("shop.carts")[1]
            assert scope is not None and orders is not None and carts is not None
            for i in range(40):
                vb = i % VBUCKETS
                await put(conn, 0, b"d%02d" % i, b"default", vb)
                await put(conn, orders.uid, b"o%02d" % i, b"order", vb)
                await put(conn, carts.uid, b"c%02d" % i, b"cart", vb)
            # A key not in any collection the manifest holds: UNKNOWN_COLLECTION with its uid.
            with pytest.raises(StatusError) as caught:
                await put(conn, 0x7777, b"x", b"v", 0)
            assert caught.value.code == Status.UNKNOWN_COLLECTION
            assert '"manifest_uid": "3"' in str(caught.value)
            # Drop carts, then write orders again: the drop sits between them in seqno order.
            await edit_manifest(conn, lambda m: m.without_collection("shop", "carts"))
            for i in range(VBUCKETS):
                await put(conn, orders.uid, b"late%d" % i, b"after the drop", i)
                await put(conn, 0, b"tail%d" % i, b"last in its vbucket", i)
        finally:
            await conn.close()

        # A client without collections writing a key that starts with 0xff (never UTF-8): it
        # stays the default collection's, however its bytes look like a marked key.
        odd = b"\xff" + encode_leb128(orders.uid) + b"odd"
        legacy_conn = await connect(
            HOST, node.port, agent="legacy", user=USER, password=PASSWORD, bucket=BUCKET,
            features=[Feature.XERROR, Feature.SELECT_BUCKET],
        )  # fmt: skip
        try:
            await call(
                legacy_conn, Opcode.SET, vbucket=1, extras=struct.pack(">II", 0, 0),
                key=odd, value=b"legacy",
            )  # fmt: skip
            got = await call(legacy_conn, Opcode.GET, vbucket=1, key=odd)
            assert got.value == b"legacy"
        finally:
            await legacy_conn.close()

        # A client without collections: the default collection only, keys as written.
        legacy = changes(await collect(node))
        assert sorted(k for _, _, k in legacy) == sorted(
            [b"d%02d" % i for i in range(40)] + [b"tail%d" % i for i in range(VBUCKETS)] + [odd]
        )

        # Filtered to shop.orders: only its documents, keyed with its id.
        filtered = await collect(node, collections=("shop.orders",))
        keys = [split_key(k) for _, _, k in changes(filtered)]
        assert {cid for cid, _ in keys} == {orders.uid}
        assert sorted(k for _, k in keys) == sorted(
            [b"o%02d" % i for i in range(40)] + [b"late%d" % i for i in range(VBUCKETS)]
        )
        # Its creation is the one system event it gets.
        events = [e for e in filtered if isinstance(e, CollectionEvent)]
        assert {e.message.event for e in events} == {SystemEvent.BEGIN_COLLECTION}
        assert {e.message.collection_id for e in events} == {orders.uid}

        # Every collection, with every system event, in seqno order with the documents.
        everything = await collect(node, collections_aware=True)
        for vb in range(VBUCKETS):
            mine = [e for e in everything if isinstance(e, CollectionEvent) and e.vbucket == vb]
            kinds = [e.message.event for e in mine]
            assert kinds == [
                SystemEvent.CREATE_SCOPE,
                SystemEvent.BEGIN_COLLECTION,
                SystemEvent.BEGIN_COLLECTION,
                SystemEvent.END_COLLECTION,
            ], (vb, kinds)
            drop_seqno = mine[-1].message.seqno
            vb_changes = [(s, split_key(k)) for v, s, k in changes(everything) if v == vb]
            assert all(s < drop_seqno for s, (cid, _) in vb_changes if cid == carts.uid)
            assert all(s > drop_seqno for s, (_, k) in vb_changes if k.startswith(b"late"))
        assert {split_key(k)[0] for _, _, k in changes(everything)} == {0, orders.uid, carts.uid}

        # The filtered stream's seqnos rise through changes, events and advances, and each
        # vbucket ends with an advance to its high seqno (its last change, a default-collection
        # tail, is not for this stream): a resume starts past what it was not sent.
        high = {vb: max(s for s, _ in seen) for vb, seen in positions(everything).items()}
        for vb, seen in positions(filtered).items():
            seqnos = [s for s, _ in seen]
            assert seqnos == sorted(seqnos) and len(set(seqnos)) == len(seqnos), vb
            assert seen[-1] == (high[vb], "advanced"), (vb, seen[-3:])

        # After a restart the same streams come from disk (backfill of stored records).
        node.restart(clean=True)
        from_disk = await collect(node, collections=("shop.orders",))
        assert sorted(changes(from_disk)) == sorted(changes(filtered))
        assert positions(from_disk).keys() == positions(filtered).keys()
        # The keyed backfill reads only orders' (and the events') records, and still ends
        # each vbucket at its high seqno with an advance (the snapshot's last record).
        for vb, seen in positions(from_disk).items():
            seqnos = [s for s, _ in seen]
            assert seqnos == sorted(seqnos) and len(set(seqnos)) == len(seqnos), vb
            assert seen[-1] == (high[vb], "advanced"), (vb, seen[-3:])
        legacy_disk = changes(await collect(node))
        assert sorted(k for _, _, k in legacy_disk) == sorted(k for _, _, k in legacy)
        everything_disk = await collect(node, collections_aware=True)
        assert [
            (e.vbucket, e.message) for e in everything_disk if isinstance(e, CollectionEvent)
        ] == [(e.vbucket, e.message) for e in everything if isinstance(e, CollectionEvent)]

        # Compaction purges the dropped collection's documents (lazily: not at the drop); the
        # drop event and everything else stay.
        conn = await kv(node)
        try:
            for vb in range(VBUCKETS):
                opaque = conn.next_opaque()
                request = encode_compact_db(CompactDb(vb, opaque, 0, 0, drop_deletes=True))
                assert (await conn.request(request, opaque)).status == Status.SUCCESS
        finally:
            await conn.close()
        after = await collect(node, collections_aware=True)
        assert sorted(
            (v, s, k) for v, s, k in changes(everything) if split_key(k)[0] != carts.uid
        ) == sorted(changes(after))
        assert [e.message for e in after if isinstance(e, CollectionEvent)] == [
            e.message for e in everything if isinstance(e, CollectionEvent)
        ]

        # A filter naming a dropped collection is refused UNKNOWN_COLLECTION.
        with pytest.raises(Exception, match="UNKNOWN_COLLECTION"):
            await collect(node, collections=("shop.carts",))
        return orders.uid

    orders_id = asyncio.run(scenario())

    # The command: lines name their collection; a rerun from its state sends nothing again; a
    # rerun with another filter is refused (the state's positions are the first filter's).
    out, state = tmp_path / "out.jsonl", tmp_path / "state.json"
    common = ["stream", "--to-latest", "--port", str(node.port), "--user", USER,
              "--password", PASSWORD, "--output", str(out), "--state", str(state)]  # fmt: skip
    first = CliRunner().invoke(cli, [*common, "--collections", "shop.orders"])
    assert first.exit_code == 0, first.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    docs = [line for line in lines if line["op"] == "mutation"]
    assert {line["collection"] for line in docs} == {orders_id}
    assert len(docs) == 40 + VBUCKETS
    assert {line["op"] for line in lines} == {"mutation", "collection_created"}
    assert json.loads(state.read_text())["vbuckets"]["filter"] == {
        "collections": [f"{orders_id:x}"]
    }
    again = CliRunner().invoke(cli, [*common, "--collections", "shop.orders"])
    assert again.exit_code == 0, again.output
    assert len(out.read_text().splitlines()) == len(lines)
    other = CliRunner().invoke(cli, [*common, "--scope", "shop"])
    assert other.exit_code == 1 and "filter" in other.output
