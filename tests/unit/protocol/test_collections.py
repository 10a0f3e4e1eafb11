"""The collection-id codecs: LEB128 prefixes (kv_engine's table, canonical form, a model), the
stored-key marker, the stream filter JSON, system events, and the manifest's rules and edits.
Every decoder here is fuzzed: its only outcomes are a value or its typed error."""

from __future__ import annotations

import contextlib
import json
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.collections import (
    StreamFilter,
    SystemEvent,
    SystemEventMessage,
    decode_id_extras,
    decode_leb128,
    decode_stream_filter,
    decode_system_event,
    encode_id_extras,
    encode_leb128,
    encode_system_event,
    manifest_uid_of_error,
    split_key,
    split_keys,
    unknown_collection_body,
)
from changefeed.protocol.collections_manifest import Manifest, ManifestError
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import decode_frame
from changefeed.storage.errors import CorruptRecordError
from changefeed.storage.keys import collection_of, split_stored_key, stored_key

from .helpers import SETTINGS

# kv_engine docs/Collections.md, "LEB128 Encoded Examples".
KV_ENGINE_TABLE = [
    (0x00, "00"),
    (0x01, "01"),
    (0x7F, "7f"),
    (0x80, "8001"),
    (0x555, "d50a"),
    (0x7FFF, "ffff01"),
    (0xBFFF, "ffff02"),
    (0xFFFF, "ffff03"),
    (0x8000, "808002"),
    (0x5555, "d5aa01"),
    (0xCAFEF00, "80debf65"),
    (0xCAFEF00D, "8de0fbd70c"),
    (0xFFFFFFFF, "ffffffff0f"),
]


@pytest.mark.parametrize(("cid", "encoded"), KV_ENGINE_TABLE)
def test_leb128_matches_kv_engine_table(cid: int, encoded: str) -> None:
    assert encode_leb128(cid).hex() == encoded
    assert decode_leb128(bytes.fromhex(encoded) + b"key") == (cid, len(encoded) // 2)


def _model_leb128(value: int) -> bytes:
    """The textbook definition: 7-bit groups, low first, high bit set on all but the last."""
    groups = [(value >> shift) & 0x7F for shift in range(0, 35, 7)]
    while len(groups) > 1 and groups[-1] == 0:
        groups.pop()
    return bytes([g | 0x80 for g in groups[:-1]] + [groups[-1]])


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=20))
def test_leb128_round_trips_against_model(cid: int, key: bytes) -> None:
    assert encode_leb128(cid) == _model_leb128(cid)
    assert split_key(encode_leb128(cid) + key) == (cid, key)


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ("81006b", "not canonical"),  # 1 as two bytes
        ("8180006b", "not canonical"),
        ("80808080006b", "not canonical"),
        ("808080808000", "stop byte"),  # 0 as six bytes: no stop byte within five
        ("8080808010", "above 2\\*\\*32"),
        ("ff", "stop byte"),
        ("", "stop byte"),
        ("80808080", "stop byte"),
    ],
)
def test_leb128_refuses_non_canonical_long_or_unterminated(data: str, why: str) -> None:
    with pytest.raises(ProtocolError, match=why):
        split_key(bytes.fromhex(data))


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=8))))
def test_split_keys_is_split_key_of_each(pairs: list[tuple[int, bytes]]) -> None:
    keys = [encode_leb128(cid) + key for cid, key in pairs]
    assert split_keys(keys) == ([cid for cid, _ in pairs], [key for _, key in pairs])


def test_split_keys_refuses_what_split_key_refuses() -> None:
    for bad in (b"", b"\x08", b"\x81\x00k"):
        with pytest.raises(ProtocolError):
            split_keys([b"\x00ok", bad])


def test_key_that_is_only_a_prefix_is_refused() -> None:
    with pytest.raises(ProtocolError, match="no key"):
        split_key(b"\x08")


def test_encoding_our_own_bad_id_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        encode_leb128(2**32)
    with pytest.raises(ValueError):
        encode_leb128(-1)


@SETTINGS
@given(st.binary(max_size=12))
def test_fuzz_leb128_outcomes(data: bytes) -> None:
    try:
        cid, used = decode_leb128(data)
    except ProtocolError:
        return
    assert 1 <= used <= 5 and encode_leb128(cid) == data[:used]


# -- stored keys -------------------------------------------------------------------------------


@SETTINGS
@given(st.integers(0, 2**28 - 1), st.binary(min_size=1, max_size=40))
def test_stored_key_is_one_to_one(cid: int, key: bytes) -> None:
    stored = stored_key(cid, key)
    assert split_stored_key(stored) == (cid, key)
    assert collection_of(stored) == cid
    if cid == 0 and key[:1] != b"\xff":
        assert stored == key  # the default collection is stored as before collections


@SETTINGS
@given(
    st.tuples(st.integers(0, 2**28 - 1), st.binary(min_size=1, max_size=8)),
    st.tuples(st.integers(0, 2**28 - 1), st.binary(min_size=1, max_size=8)),
)
def test_stored_keys_of_different_documents_differ(
    a: tuple[int, bytes], b: tuple[int, bytes]
) -> None:
    if a != b:
        assert stored_key(*a) != stored_key(*b)


def test_a_damaged_stored_marker_is_corrupt_data() -> None:
    with pytest.raises(CorruptRecordError):
        split_stored_key(b"\xff\x80\x80\x80\x80\x80", vb=3)


# -- GET_COLLECTION_ID, UNKNOWN_COLLECTION -----------------------------------------------------


def test_id_extras_and_unknown_body_round_trip() -> None:
    assert decode_id_extras(encode_id_extras(0x1F, 9)) == (0x1F, 9)
    body = unknown_collection_body(0x1F)
    assert json.loads(body) == {"manifest_uid": "1f"}  # kv_engine: hex, no 0x
    assert manifest_uid_of_error(body) == 0x1F
    assert manifest_uid_of_error(b"not json") is None
    with pytest.raises(ProtocolError):
        decode_id_extras(b"\x00" * 11)


# -- stream filter -----------------------------------------------------------------------------


@SETTINGS
@given(
    st.one_of(
        st.builds(StreamFilter),
        st.builds(
            StreamFilter,
            collections=st.frozensets(st.integers(0, 2**32 - 1), min_size=1, max_size=5),
        ),
        st.builds(StreamFilter, scope=st.integers(0, 2**32 - 1)),
    )
)
def test_stream_filter_round_trips(flt: StreamFilter) -> None:
    assert decode_stream_filter(flt.to_json()) == flt


def test_stream_filter_takes_kv_engine_json() -> None:
    assert decode_stream_filter(b'{"collections":["8","a"]}') == StreamFilter(
        collections=frozenset({8, 10})
    )
    assert decode_stream_filter(b'{"scope":"8","uid":"3","sid":4}') == StreamFilter(scope=8)
    assert decode_stream_filter(b'{"uid":"3"}').everything


@pytest.mark.parametrize(
    "value",
    [
        b"[1]",
        b"{",
        b'{"collections":[]}',
        b'{"collections":[8]}',
        b'{"collections":["zz"]}',
        b'{"collections":["8"],"scope":"8"}',
        b'{"scope":""}',
        b'{"scope":"123456789"}',
    ],
)
def test_bad_stream_filters_are_einval(value: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_stream_filter(value)


@SETTINGS
@given(st.binary(max_size=64))
def test_fuzz_stream_filter(value: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_stream_filter(value)


# -- system events -----------------------------------------------------------------------------

EVENTS = [
    SystemEventMessage(3, 7, 10, SystemEvent.BEGIN_COLLECTION, 2, 8, 9, b"orders"),
    SystemEventMessage(3, 7, 11, SystemEvent.BEGIN_COLLECTION, 2, 8, 9, b"orders", 3600),
    SystemEventMessage(3, 7, 12, SystemEvent.END_COLLECTION, 3, 8, 9),
    SystemEventMessage(3, 7, 13, SystemEvent.CREATE_SCOPE, 1, 8, None, b"inventory"),
    SystemEventMessage(3, 7, 14, SystemEvent.DROP_SCOPE, 4, 8),
]


@pytest.mark.parametrize("message", EVENTS)
@pytest.mark.parametrize("sid", [None, 5])
def test_system_events_round_trip(message: SystemEventMessage, sid: int | None) -> None:
    data = encode_system_event(message, stream_id=sid)
    frame = decode_frame(data, 0, len(data))
    assert frame.stream_id == sid
    assert decode_system_event(frame) == message


def test_begin_collection_v0_layout_is_uid_scope_collection() -> None:
    data = encode_system_event(EVENTS[0])
    # dcp-wire.md §7.12: extras by_seqno | event | version, value uid u64 | scope | collection.
    assert data[24:37] == bytes.fromhex("000000000000000a0000000000")
    assert data[37:43] == b"orders"
    assert data[43:] == bytes.fromhex("00000000000000020000000800000009")


def test_fuzz_system_event_decoder() -> None:
    rng = random.Random(2026)
    for _ in range(3000):
        message = rng.choice(EVENTS)
        data = bytearray(encode_system_event(message))
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(24, len(data))] = rng.randrange(256)
        frame = decode_frame(bytes(data), 0, len(data))
        try:
            decoded = decode_system_event(frame)
        except ProtocolError:
            continue
        assert isinstance(decoded.event, SystemEvent)


# -- manifest ----------------------------------------------------------------------------------


def test_manifest_edits_allocate_ids_from_the_uid_and_round_trip() -> None:
    m = Manifest.default().with_scope("inventory")
    m = m.with_collection("inventory", "orders", max_ttl=60)
    m = m.with_collection("_default", "users")
    assert m.uid == 3
    scope, coll = m.resolve("inventory.orders")
    assert scope is not None and coll is not None
    assert (scope.uid, coll.uid, coll.max_ttl) == (8, 9, 60)
    assert m.resolve(".users")[1] is not None and m.resolve(".")[1] is not None
    assert Manifest.decode(m.encode()) == m
    dropped = m.without_collection("inventory", "orders")
    again = dropped.with_collection("inventory", "orders")
    assert again.resolve("inventory.orders")[1].uid not in m.by_id()  # type: ignore[union-attr]
    m.check_successor(dropped)
    dropped.check_successor(again)


def test_manifest_refuses_reused_ids_and_old_uids() -> None:
    m = Manifest.default().with_scope("s").with_collection("s", "c")  # ids 8, 9; uid 2
    dropped = m.without_collection("s", "c")  # uid 3
    raw = dropped.to_json()
    raw["uid"] = "4"
    raw["scopes"][1]["collections"] = [{"name": "c", "uid": "9"}]  # id 9 again
    with pytest.raises(ManifestError, match="never reused"):
        dropped.check_successor(Manifest.decode(json.dumps(raw)))
    with pytest.raises(ManifestError, match="not above"):
        m.check_successor(Manifest.default())


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m.with_scope("_system"),
        lambda m: m.with_scope("a.b"),
        lambda m: m.with_scope("x" * 252),
        lambda m: m.with_collection("nope", "c"),
        lambda m: m.with_collection("_default", "c", max_ttl=-1),
        lambda m: m.without_collection("_default", "_default"),
        lambda m: m.without_scope("_default"),
        lambda m: m.with_scope("s").with_scope("s"),
    ],
)
def test_bad_edits_name_the_problem(edit: object) -> None:
    with pytest.raises(ManifestError):
        edit(Manifest.default())  # type: ignore[operator]


@pytest.mark.parametrize(
    "text",
    [
        "{",
        "[]",
        '{"uid":"1"}',
        '{"uid":"1","scopes":[]}',
        '{"uid":"1","scopes":[{"name":"_default","uid":"0","collections":[{"name":"a","uid":"3"}]}]}',
        '{"uid":"x","scopes":[{"name":"_default","uid":"0"}]}',
        '{"uid":"1","scopes":[{"name":"_default","uid":"0","collections":'
        '[{"name":"a","uid":"9","maxTTL":"1"}]}]}',
    ],
)
def test_bad_manifests_are_refused(text: str) -> None:
    with pytest.raises(ManifestError):
        Manifest.decode(text)


@SETTINGS
@given(st.binary(max_size=200))
def test_fuzz_manifest_decoder(data: bytes) -> None:
    with contextlib.suppress(ManifestError):
        Manifest.decode(data)


def test_deeply_nested_json_is_refused_not_a_crash() -> None:
    # Found by the codec fuzz test: json.loads raises RecursionError past ~1000 levels.
    deep = b"[" * 100_000
    with pytest.raises(ProtocolError):
        decode_stream_filter(deep)
    with pytest.raises(ManifestError):
        Manifest.decode(deep)
    assert manifest_uid_of_error(deep) is None


def test_resolve_refuses_bad_paths() -> None:
    for path in ("a", "a.b.c", "_x.y"):
        with pytest.raises(ManifestError):
            Manifest.default().resolve(path)
