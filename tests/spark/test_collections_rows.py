"""The pieces of Spark per collection without Spark or a node: cutting the collection id off
keys (against ``protocol.collections.split_key``, property-based and fuzzed), the rows' names,
the rows a DROPMALFORMED parse kept, and the registry of a collection-aware mirror (created,
dropped, created again) against a model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.consumer.change_rows import CHANGE_ROW_SCHEMA
from changefeed.protocol.batch import FIELD_DTYPES, ChangeColumns
from changefeed.protocol.collections import (
    SystemEvent,
    SystemEventMessage,
    encode_leb128,
    split_key,
)
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.errors import ProtocolError
from changefeed.spark.collection_registry import DROPPED_FILE, Registry
from changefeed.spark.collection_rows import (
    NAMED_ROW_SCHEMA,
    NO_COLLECTION,
    CollectionNames,
    NamedRows,
    strip_collection_ids,
    with_names,
)

OP_MUTATION = 0x57  # DCP_MUTATION


def columns_of(keys: list[bytes], vbuckets: list[int] | None = None) -> ChangeColumns:
    """Mutations with these raw keys (seqnos 1, 2, ... per vbucket), each with a value."""
    data = b""
    starts, ends, value_ends = [], [], []
    for key in keys:
        starts.append(len(data))
        data += key
        ends.append(len(data))
        data += b"{}"
        value_ends.append(len(data))
    count = len(keys)
    vbs = vbuckets or [0] * count
    arrays = {name: np.zeros(count, dtype) for name, dtype in FIELD_DTYPES.items()}
    arrays["opcode"] = np.full(count, OP_MUTATION, np.uint8)
    arrays["vbucket"] = np.array(vbs, np.uint16)
    seen: dict[int, int] = {}
    seqnos = []
    for vb in vbs:
        seen[vb] = seen.get(vb, 0) + 1
        seqnos.append(seen[vb])
    arrays["seqno"] = np.array(seqnos, np.uint64)
    arrays["cas"] = np.arange(1, count + 1, dtype=np.uint64)
    return ChangeColumns(
        {**arrays, "key_start": np.array(starts, np.int64), "key_end": np.array(ends, np.int64),
         "value_end": np.array(value_ends, np.int64)},
        data,
    )  # fmt: skip


ids = st.integers(0, 2**32 - 1) | st.integers(0, 300)
doc_keys = st.binary(min_size=1, max_size=12)


@given(st.lists(st.tuples(ids, doc_keys), min_size=1, max_size=40))
def test_strip_cuts_the_id_off_every_key(pairs: list[tuple[int, bytes]]) -> None:
    columns = columns_of([encode_leb128(cid) + key for cid, key in pairs])
    stripped, cids = strip_collection_ids(columns)
    assert stripped.key == [key for _, key in pairs]
    assert cids.tolist() == [cid for cid, _ in pairs]
    assert stripped.value == columns.value  # the values did not move


@settings(max_examples=300)
@given(st.lists(st.binary(min_size=1, max_size=8), min_size=1, max_size=20))
def test_strip_of_any_bytes_splits_or_refuses(keys: list[bytes]) -> None:
    """Fuzz: whatever the key bytes, the result is split_key's, or the ProtocolError it
    raises for some key."""
    expected = []
    refused = False
    for key in keys:
        try:
            expected.append(split_key(key))
        except ProtocolError:
            refused = True
    if refused:
        with pytest.raises(ProtocolError):
            strip_collection_ids(columns_of(keys))
        return
    stripped, cids = strip_collection_ids(columns_of(keys))
    assert list(zip(cids.tolist(), stripped.key, strict=True)) == expected


def test_named_rows_keep_names_through_end_seqnos_and_rollbacks() -> None:
    manifest = Manifest.default().with_scope("shop").with_collection("shop", "orders")
    orders = manifest.resolve("shop.orders")[1]
    assert orders is not None
    names = CollectionNames()
    names.learn_manifest(manifest)
    keys = [encode_leb128(cid) + b"k%d" % i for i, cid in enumerate([0, orders.uid, 0x99, 0])]
    rows = NamedRows(names)
    # vbucket 0: seqnos 1, 2, 3 (the third past its end 2); vbucket 1: seqno 1.
    reached = rows.append_changes(columns_of(keys, [0, 0, 0, 1]), {0: (1, 3), 1: (1, 1)},
                                  {0: 2, 1: 5})  # fmt: skip
    assert reached == {0}
    rows.append_rollback(1, 0)
    # A collection created later names itself in its system event.
    names.learn_event(SystemEventMessage(1, 0, 2, SystemEvent.CREATE_SCOPE, 9, 0x20, None,
                                         b"late"))  # fmt: skip
    names.learn_event(SystemEventMessage(1, 0, 3, SystemEvent.BEGIN_COLLECTION, 9, 0x20, 0x77,
                                         b"items"))  # fmt: skip
    more = [encode_leb128(0x77) + b"new", encode_leb128(0x55) + b"gone"]
    rows.append_changes(columns_of(more, [2, 2]), {2: (1, 2)}, {2: 9})
    batch = rows.to_batch()
    assert batch.schema == NAMED_ROW_SCHEMA
    got = list(zip(batch.column("key").to_pylist(), batch.column("scope").to_pylist(),
                   batch.column("collection").to_pylist(),
                   batch.column("collection_id").to_pylist(), strict=True))  # fmt: skip
    assert got == [
        ("k0", "_default", "_default", 0), ("k1", "shop", "orders", orders.uid),
        ("k3", "_default", "_default", 0), ("", None, None, None), ("new", "late", "items", 0x77),
        ("gone", "_unknown", "cid_55", 0x55),
    ]  # fmt: skip
    assert NO_COLLECTION < 0


def test_with_names_follows_the_rows_a_parse_kept() -> None:
    rows = [
        {"vbucket": vb, "seqno": seqno, "key": f"k{vb}{seqno}", "value": b"", "op": op,
         "cas": 1, "expiry": 0, "flags": 0, "rev_seqno": 1, "snap_start": 1, "snap_end": 9}
        for vb, seqno, op in [(0, 1, "mutation"), (0, 2, "mutation"), (1, 1, "rollback"),
                              (1, 2, "mutation"), (2, 1, "mutation")]
    ]  # fmt: skip
    changes = pa.RecordBatch.from_pylist(rows, schema=CHANGE_ROW_SCHEMA)
    names = [pa.array(list("abcde")), pa.array(list("vwxyz")), pa.array([1, 2, None, 4, 5])]
    dropped = changes.filter(pa.array([True, False, True, False, True]))  # malformed 2 and 4
    out = with_names(changes, names, dropped)
    assert out.column("scope").to_pylist() == ["a", "c", "e"]
    assert out.column("collection").to_pylist() == ["v", "x", "z"]
    assert out.column("collection_id").to_pylist() == [1, None, 5]
    whole = with_names(changes, names, changes)
    assert whole.column("scope").to_pylist() == list("abcde")


def test_registry_adds_marks_dropped_and_separates_a_recreated_collection(
    tmp_path: Path,
) -> None:
    root = str(tmp_path / "tables")
    assert Registry.load(root).entries == [] and not (tmp_path / "tables").exists()

    def wants(scope: str, collection: str) -> bool:
        return scope == "shop"

    one = Manifest.default().with_scope("shop").with_collection("shop", "orders")
    registry = Registry.load(root)
    assert registry.sync(one, wants, batch=0) == (["shop.orders"], [])
    registry.save()
    two = one.with_collection("shop", "carts").with_scope("crm").with_collection("crm", "x")
    registry = Registry.load(root)
    assert registry.sync(two, wants, batch=3) == (["shop.carts"], [])  # crm is not wanted
    assert registry.sync(two, wants, batch=4) == ([], [])  # nothing new: nothing changes
    three = two.without_collection("shop", "orders")
    assert registry.sync(three, wants, batch=5) == ([], ["shop.orders"])
    four = three.with_collection("shop", "orders")  # created again: a new id
    added, _ = registry.sync(four, wants, batch=6)
    assert added == ["shop.orders"]
    registry.save()
    entries = Registry.load(root).entries
    paths = [(e.name, e.path, e.dropped is not None) for e in entries]
    new_id = four.resolve("shop.orders")[1]
    assert new_id is not None
    assert paths == [
        ("shop.orders", "shop/orders", True), ("shop.carts", "shop/carts", False),
        ("shop.orders", f"shop/orders~{new_id.uid:x}", False),
    ]  # fmt: skip
    live = Registry.load(root).live("shop", "orders")
    assert live is not None and live.path == f"shop/orders~{new_id.uid:x}"
    marker = json.loads((tmp_path / "tables" / "shop" / "orders" / DROPPED_FILE).read_text())
    assert marker["collection"] == "shop.orders" and marker["batch"] == 5
    (tmp_path / "tables" / "_changefeed_collections.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a registry"):
        Registry.load(root)


def test_rows_of_a_dropped_collection_go_to_its_tables_not_to_its_successors(
    tmp_path: Path,
) -> None:
    """``s.c`` dropped and created again (a new id) before the mirror saw the drop: each id's
    rows go to its own tables, whatever their names say."""
    one = Manifest.default().with_scope("s").with_collection("s", "c")
    two = one.without_collection("s", "c").with_collection("s", "c")
    old, new = (m.resolve("s.c")[1] for m in (one, two))
    assert old is not None and new is not None and old.uid != new.uid
    registry = Registry.load(str(tmp_path / "tables"))
    registry.sync(one, lambda s, c: True, batch=0)
    registry.sync(two, lambda s, c: True, batch=1)
    routes = registry.route([("s", "c", old.uid), ("s", "c", new.uid)], batch=1)
    assert routes[old.uid].path == "s/c" and routes[old.uid].cid == old.uid
    assert routes[new.uid].path == f"s/c~{new.uid:x}" and routes[new.uid].cid == new.uid


# A run of a bucket: create or drop a collection of names "a"/"b", the mirror catching up with
# the manifest (sync), or a batch with rows of some collections that ever existed.
registry_steps = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["create", "drop"]), st.sampled_from(["a", "b"])),
        st.just(("sync", "")),
        st.tuples(st.just("rows"), st.lists(st.integers(0, 20), max_size=4)),
    ),
    max_size=25,
)


@given(registry_steps)
@settings(max_examples=150, deadline=None)
def test_registry_routes_each_collection_id_to_its_own_tables(
    steps: list[tuple[str, object]],
) -> None:
    """Against a model (collection id -> the first tables its rows went to): every id's rows
    go to an entry of that id, always the same tables, and two ids never share tables, however
    far the mirror lags behind drops and re-creations under the same name."""
    import tempfile

    manifest = Manifest.default().with_scope("s")
    ever: dict[int, str] = {}  # every collection id there was -> its name
    tables_of: dict[int, str] = {}  # the model: id -> the tables its rows first went to
    with tempfile.TemporaryDirectory() as root:
        registry = Registry.load(root)
        for batch, (op, arg) in enumerate(steps):
            alive = manifest.resolve(f"s.{arg}")[1] if op in ("create", "drop") else None
            if op == "create" and alive is None:
                manifest = manifest.with_collection("s", str(arg))
                created = manifest.resolve(f"s.{arg}")[1]
                assert created is not None
                ever[created.uid] = str(arg)
            elif op == "drop" and alive is not None:
                manifest = manifest.without_collection("s", str(arg))
            elif op == "sync":
                registry.sync(manifest, lambda s, c: True, batch)
            elif op == "rows" and ever:
                ids = sorted(ever)
                picked = {ids[i % len(ids)] for i in arg}  # type: ignore[attr-defined]
                routes = registry.route([("s", ever[cid], cid) for cid in picked], batch)
                assert set(routes) == picked
                for cid, entry in routes.items():
                    assert entry.cid == cid, (cid, entry)
                    assert tables_of.setdefault(cid, entry.path) == entry.path, (cid, entry)
                assert len(set(tables_of.values())) == len(tables_of), tables_of
