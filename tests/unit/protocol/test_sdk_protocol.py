"""The codecs of the Couchbase SDK's commands: the error map, GET_META / TOUCH / GET_LOCKED /
UNLOCK / counters / APPEND, the cluster map push, and the sub-document requests, responses and
path semantics (kv_engine's docs/SubDocument.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from changefeed import limits
from changefeed.protocol import error_map, kv_ops, subdoc, subdoc_paths
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import FrameReader
from changefeed.protocol.status import Status
from changefeed.protocol.subdoc import DocFlag, PathFlag, Spec
from changefeed.protocol.subdoc_paths import SubdocError


def decode(data: bytes) -> Frame:
    reader = FrameReader(limits.FRAME_SIZE_MAX)
    reader.feed(data)
    frame = reader.next_frame()
    assert isinstance(frame, Frame)
    return frame


def request(opcode: int, **fields: Any) -> Frame:
    return decode(encode_frame(Magic.REQUEST, opcode, **fields))


# -- error map --------------------------------------------------------------------------------


def test_the_error_map_describes_every_status_with_kv_engines_attributes() -> None:
    body = error_map.error_map_json(2)
    assert body is not None
    version, revision, entries = error_map.decode_error_map(body)
    assert (version, revision) == (2, error_map.REVISION)
    assert set(entries) == {int(s) for s in Status}
    assert entries[Status.LOCKED].attrs == ("item-locked", "item-only", "retry-now")
    assert (
        "temp" in entries[Status.ETMPFAIL].attrs and "retry-now" in entries[Status.ETMPFAIL].attrs
    )
    assert "fetch-config" in entries[Status.NOT_MY_VBUCKET].attrs
    assert "auth" in entries[Status.AUTH_ERROR].attrs
    assert entries[Status.SUBDOC_PATH_ENOENT].attrs == ("subdoc", "item-only")
    raw = json.loads(body)
    assert "cc" in raw["errors"] and "0" in raw["errors"]  # lowercase hex, no padding


def test_version_1_is_derived_as_kv_engine_derives_it() -> None:
    assert error_map.error_map_json(0) is None
    v1 = json.loads(error_map.error_map_json(1) or b"")
    v2 = json.loads(error_map.error_map_json(2) or b"")
    assert v1["version"] == 1 and v1["revision"] == 4 + v2["revision"]
    assert all(set(e["attrs"]) <= error_map.V1_ATTRIBUTES for e in v1["errors"].values())
    assert json.loads(error_map.error_map_json(7) or b"") == v2  # newer asks get version 2


def test_the_error_map_request() -> None:
    frame = decode(error_map.encode_get_error_map(9, 2))
    assert error_map.decode_get_error_map(frame) == 2
    for bad in (
        request(Opcode.GET_ERROR_MAP, value=b"\x00"),
        request(Opcode.GET_ERROR_MAP, value=b"\x00\x02", key=b"k"),
        request(Opcode.GET_ERROR_MAP, value=b"\x00\x02", vbucket=3),
    ):
        with pytest.raises(ProtocolError) as raised:
            error_map.decode_get_error_map(bad)
        assert raised.value.status == Status.EINVAL


@pytest.mark.parametrize(
    "value",
    [b"", b"[]", b'{"errors": []}', b'{"version": 2, "revision": 1, "errors": {"zz": {}}}',
     b'{"version": 2, "revision": 1, "errors": {"1": {"name": "x", "desc": "y"}}}'],
)  # fmt: skip
def test_a_malformed_error_map_is_a_protocol_error(value: bytes) -> None:
    with pytest.raises(ProtocolError):
        error_map.decode_error_map(value)


# -- KV commands ------------------------------------------------------------------------------


def test_get_meta() -> None:
    assert kv_ops.decode_get_meta(request(Opcode.GET_META, key=b"k", extras=b"\x02")) == (
        b"k",
        2,
    )
    assert kv_ops.decode_get_meta(request(Opcode.GET_META, key=b"k")) == (b"k", 1)
    with pytest.raises(ProtocolError):
        kv_ops.decode_get_meta(request(Opcode.GET_META, key=b"k", extras=b"\x03"))
    meta = kv_ops.DocumentMeta(True, 7, 1_700_000_000, 3, 1, 99)
    extras = kv_ops.encode_get_meta_extras(meta, 2)
    assert len(extras) == 21 and kv_ops.decode_get_meta_extras(extras, 99) == meta
    v1 = kv_ops.decode_get_meta_extras(kv_ops.encode_get_meta_extras(meta, 1), 99)
    assert v1 == kv_ops.DocumentMeta(True, 7, 1_700_000_000, 3, 0, 99)


def test_touch_lock_unlock() -> None:
    touch = decode(kv_ops.encode_touch(Opcode.GAT, b"k", 60, vbucket=3))
    assert kv_ops.decode_touch(touch) == kv_ops.Touch(b"k", 60)
    assert kv_ops.decode_get_locked(decode(kv_ops.encode_get_locked(b"k", 9))) == (b"k", 9)
    assert kv_ops.decode_get_locked(request(Opcode.GET_LOCKED, key=b"k")) == (b"k", 0)
    assert kv_ops.decode_unlock(request(Opcode.UNLOCK_KEY, key=b"k", cas=5)) == (b"k", 5)
    for bad, decoder in (
        (request(Opcode.TOUCH, key=b"k"), kv_ops.decode_touch),
        (request(Opcode.GET_LOCKED, key=b"k", extras=b"\x00"), kv_ops.decode_get_locked),
        (request(Opcode.UNLOCK_KEY, key=b"k"), kv_ops.decode_unlock),  # no CAS
        (request(0xEE, extras=b"\x00\x00\x00\x01"), kv_ops.decode_touch),  # no key
    ):
        with pytest.raises(ProtocolError):
            decoder(bad)


def test_counters_and_their_rules() -> None:
    command = kv_ops.Arithmetic(Opcode.INCREMENT, b"c", 5, 10, kv_ops.ARITHMETIC_NO_CREATE, 7)
    assert kv_ops.decode_arithmetic(decode(kv_ops.encode_arithmetic(command))) == command
    assert kv_ops.parse_counter(b"18446744073709551615") == 2**64 - 1
    for bad in (b"18446744073709551616", b"-1", b"1.0", b" 1", b"", b"\xd9\xa1"):
        assert kv_ops.parse_counter(bad) is None, bad
    assert kv_ops.apply_arithmetic(Opcode.INCREMENT, 2**64 - 1, 2) == 1  # wraps
    assert kv_ops.apply_arithmetic(Opcode.DECREMENT, 3, 10) == 0  # stops at 0
    assert kv_ops.decode_arithmetic_value(kv_ops.U64.pack(42)) == 42


def test_the_cluster_map_notification() -> None:
    full = kv_ops.ClusterMapNotification(1, 7, "default", b'{"rev":7}')
    frame = decode(kv_ops.encode_clustermap_notification(full))
    assert frame.magic == Magic.SERVER_REQUEST and frame.opcode == 0x01 and frame.datatype == 1
    assert kv_ops.decode_clustermap_notification(frame) == full
    brief = kv_ops.ClusterMapNotification(2, 9, "default", b"")
    frame = decode(kv_ops.encode_clustermap_notification(brief))
    assert frame.datatype == 0 and kv_ops.decode_clustermap_notification(frame) == brief


# -- sub-document requests and responses -----------------------------------------------------


def test_multi_lookup_round_trip() -> None:
    lookup = subdoc.MultiLookup(
        b"k",
        (
            Spec(Opcode.SUBDOC_GET, PathFlag.XATTR_PATH, b"$document.exptime"),
            Spec(Opcode.SUBDOC_EXISTS, PathFlag.NONE, b"a.b"),
            Spec(Opcode.GET, PathFlag.NONE, b""),
        ),
    )
    assert subdoc.decode_multi_lookup(decode(subdoc.encode_multi_lookup(lookup))) == lookup


def test_multi_mutation_round_trip_with_every_extras_form() -> None:
    specs = (Spec(Opcode.SUBDOC_DICT_UPSERT, PathFlag.MKDIR_P, b"a.b", b"1"),)
    for expiry, flags, doc_flags in [
        (None, None, DocFlag.NONE),
        (None, None, DocFlag.MKDOC),
        (60, None, DocFlag.NONE),
        (60, None, DocFlag.ADD),
        (60, 0x02000006, DocFlag.NONE),
        (0, 0x02000006, DocFlag.MKDOC),
    ]:
        mutation = subdoc.MultiMutation(b"k", specs, doc_flags, expiry, flags)
        frame = decode(subdoc.encode_multi_mutation(mutation))
        assert subdoc.decode_multi_mutation(frame) == mutation


def lookup_frame(*specs: tuple[int, int, bytes], extras: bytes = b"", cas: int = 0) -> Frame:
    body = b"".join(subdoc.LOOKUP_SPEC.pack(op, fl, len(p)) + p for op, fl, p in specs)
    return request(Opcode.SUBDOC_MULTI_LOOKUP, key=b"k", extras=extras, value=body, cas=cas)


def mutation_frame(
    *specs: tuple[int, int, bytes, bytes], extras: bytes = b"", cas: int = 0
) -> Frame:
    body = b"".join(
        subdoc.MUTATION_SPEC.pack(op, fl, len(p), len(v)) + p + v for op, fl, p, v in specs
    )
    return request(Opcode.SUBDOC_MULTI_MUTATION, key=b"k", extras=extras, value=body, cas=cas)


GET = Opcode.SUBDOC_GET
UPSERT = Opcode.SUBDOC_DICT_UPSERT
X = PathFlag.XATTR_PATH


@pytest.mark.parametrize(
    ("frame", "status"),
    [
        (lookup_frame(), Status.SUBDOC_INVALID_COMBO),  # no path
        (lookup_frame(*[(GET, 0, b"a")] * 17), Status.SUBDOC_INVALID_COMBO),  # 17 paths
        (lookup_frame((UPSERT, 0, b"a")), Status.SUBDOC_INVALID_COMBO),  # a mutation
        (lookup_frame((GET, 0, b"a"), extras=b"\x00\x00"), Status.EINVAL),
        (lookup_frame((GET, PathFlag.MKDIR_P, b"a")), Status.EINVAL),  # flag invalid for get
        (lookup_frame((GET, 0, b"")), Status.EINVAL),  # get needs a path
        (lookup_frame((Opcode.GET, 0, b"a")), Status.EINVAL),  # whole-doc get takes none
        (lookup_frame((GET, 0, b"a"), (GET, X, b"$document")), Status.SUBDOC_INVALID_XATTR_ORDER),
        (lookup_frame((GET, X, b"way-too-long-xattr-key")), Status.XATTR_EINVAL),
        (lookup_frame((GET, 0, b"a" * 1025)), Status.EINVAL),
        (lookup_frame((GET, PathFlag.EXPAND_MACROS, b"a")), Status.EINVAL),
        (mutation_frame((UPSERT, 0, b"a", b"")), Status.EINVAL),  # no value
        (mutation_frame((Opcode.SUBDOC_DELETE, 0, b"a", b"1")), Status.EINVAL),  # a value
        (mutation_frame((GET, 0, b"a", b"")), Status.SUBDOC_INVALID_COMBO),
        (mutation_frame((UPSERT, 0, b"a", b"1"), extras=b"\x00\x00"), Status.EINVAL),
        (mutation_frame((UPSERT, 0, b"a", b"1"), extras=b"\x03"), Status.EINVAL),  # add+mkdoc
        (mutation_frame((UPSERT, 0, b"a", b"1"), extras=b"\x02", cas=5), Status.EINVAL),
        (mutation_frame((Opcode.SUBDOC_REPLACE, 0, b"a", b"1"), extras=b"\x01"), Status.EINVAL),
        (mutation_frame((UPSERT, X, b"$document.x", b"1")), Status.SUBDOC_XATTR_CANT_MODIFY_VATTR),
        (
            mutation_frame((Opcode.DELETE, 0, b"", b""), (UPSERT, 0, b"a", b"1")),
            Status.SUBDOC_INVALID_COMBO,
        ),
        (mutation_frame((UPSERT, 0, b"a", b"1")), None),  # and a valid one passes
    ],
)
def test_requests_are_validated_as_kv_engine_validates_them(
    frame: Frame, status: Status | None
) -> None:
    decoder = (
        subdoc.decode_multi_lookup
        if frame.opcode == Opcode.SUBDOC_MULTI_LOOKUP
        else subdoc.decode_multi_mutation
    )
    if status is None:
        decoder(frame)
        return
    with pytest.raises(ProtocolError) as raised:
        decoder(frame)
    assert raised.value.status == status


def test_a_truncated_spec_is_einval() -> None:
    frame = lookup_frame((GET, 0, b"abc"))
    cut = Frame(frame.magic, frame.opcode, key=frame.key, value=frame.value[:-1])
    with pytest.raises(ProtocolError) as raised:
        subdoc.decode_multi_lookup(cut)
    assert raised.value.status == Status.EINVAL


def test_responses_round_trip() -> None:
    lookups = [
        subdoc.LookupResult(Status.SUCCESS, b'"x"'),
        subdoc.LookupResult(Status.SUBDOC_PATH_ENOENT),
    ]
    assert subdoc.decode_lookup_results(subdoc.encode_lookup_results(lookups)) == lookups
    mutations = [subdoc.MutationResult(2, Status.SUCCESS, b"5")]
    assert subdoc.decode_mutation_results(subdoc.encode_mutation_results(mutations)) == mutations
    failure = [subdoc.MutationResult(1, Status.SUBDOC_PATH_EEXISTS)]
    encoded = subdoc.encode_mutation_results(failure)
    assert encoded == b"\x01\x00\xc9" and subdoc.decode_mutation_results(encoded) == failure


# -- paths ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "components"),
    [
        (b"", []),
        (b"a", ["a"]),
        (b"a.b[0][-1].c", ["a", "b", 0, -1, "c"]),
        (b"[2]", [2]),
        (b"`a.b`.c", ["a.b", "c"]),
        (b"`back``tick`", ["back`tick"]),
        (b"x`[0]`", ["x[0]"]),
        (b'q\\"uote', ['q"uote']),
        (b"\xc3\xa9t\xc3\xa9", ["\u00e9t\u00e9"]),
    ],
)
def test_path_syntax(path: bytes, components: list[object]) -> None:
    assert subdoc_paths.parse_path(path) == components


@pytest.mark.parametrize(
    "path",
    [b".a", b"a.", b"a..b", b"a[", b"a[x]", b"a[-2]", b"a]", b"a.[0]", b"`a", b"a[0]b",
     b"a\\q", b"\xff"],
)  # fmt: skip
def test_bad_paths_are_einval(path: bytes) -> None:
    with pytest.raises(SubdocError) as raised:
        subdoc_paths.parse_path(path)
    assert raised.value.status == Status.SUBDOC_PATH_EINVAL


def test_too_many_components_are_e2big() -> None:
    subdoc_paths.parse_path(b".".join([b"a"] * 32))
    with pytest.raises(SubdocError) as raised:
        subdoc_paths.parse_path(b".".join([b"a"] * 33))
    assert raised.value.status == Status.SUBDOC_PATH_E2BIG


DOC = b'{"a": {"b": [1, 2.50, {"c": null}]}, "s": "x", "big": 123456789012345678901234567890}'


def run(doc: bytes, opcode: int, path: bytes, value: bytes = b"", mkdir: bool = False) -> Any:
    root = subdoc_paths.parse_document(doc)
    answer = subdoc_paths.mutate(root, opcode, path, value, mkdir=mkdir)
    return json.loads(subdoc_paths.dumps(root)), answer


def status_of(
    doc: bytes, opcode: int, path: bytes, value: bytes = b"", mkdir: bool = False
) -> Status:
    root = subdoc_paths.parse_document(doc)
    with pytest.raises(SubdocError) as raised:
        if opcode in (GET, Opcode.SUBDOC_EXISTS, Opcode.SUBDOC_GET_COUNT):
            subdoc_paths.lookup(root, opcode, path)
        else:
            subdoc_paths.mutate(root, opcode, path, value, mkdir=mkdir)
    return raised.value.status


def test_lookups_and_their_statuses() -> None:
    root = subdoc_paths.parse_document(DOC)
    assert subdoc_paths.lookup(root, GET, b"a.b[1]") == b"2.50"  # as written
    assert subdoc_paths.lookup(root, GET, b"a.b[-1]") == b'{"c":null}'
    assert subdoc_paths.lookup(root, GET, b"big") == b"123456789012345678901234567890"
    assert subdoc_paths.lookup(root, Opcode.SUBDOC_EXISTS, b"a.b[2].c") == b""
    assert subdoc_paths.lookup(root, Opcode.SUBDOC_GET_COUNT, b"a.b") == b"3"
    assert subdoc_paths.lookup(root, Opcode.SUBDOC_GET_COUNT, b"") == b"3"
    assert status_of(DOC, GET, b"a.x") == Status.SUBDOC_PATH_ENOENT
    assert status_of(DOC, GET, b"a.b[3]") == Status.SUBDOC_PATH_ENOENT
    assert status_of(DOC, GET, b"a.b.c") == Status.SUBDOC_PATH_MISMATCH
    assert status_of(DOC, GET, b"a[0]") == Status.SUBDOC_PATH_MISMATCH
    assert status_of(DOC, GET, b"s.t") == Status.SUBDOC_PATH_MISMATCH
    assert status_of(DOC, Opcode.SUBDOC_GET_COUNT, b"s") == Status.SUBDOC_PATH_MISMATCH


def test_documents_that_are_not_json_or_too_deep() -> None:
    for body in (b"not json", b"{", b'{"a": NaN}', b"\xff", b"[1] [2]"):
        with pytest.raises(SubdocError) as raised:
            subdoc_paths.parse_document(body)
        assert raised.value.status == Status.SUBDOC_DOC_NOTJSON, body
    subdoc_paths.parse_document(b"[" * 32 + b"]" * 32)
    for body in (b"[" * 33 + b"]" * 33, b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(SubdocError) as raised:
            subdoc_paths.parse_document(body)
        assert raised.value.status == Status.SUBDOC_DOC_E2DEEP


def test_dictionary_and_generic_mutations() -> None:
    doc, _ = run(DOC, Opcode.SUBDOC_DICT_ADD, b"a.new", b'{"k": [1]}')
    assert doc["a"]["new"] == {"k": [1]}
    doc, _ = run(DOC, Opcode.SUBDOC_DICT_UPSERT, b"x.y.z", b"true", mkdir=True)
    assert doc["x"] == {"y": {"z": True}}
    doc, _ = run(DOC, Opcode.SUBDOC_REPLACE, b"a.b[-1]", b'"last"')
    assert doc["a"]["b"] == [1, 2.5, "last"]
    doc, _ = run(DOC, Opcode.SUBDOC_DELETE, b"a.b[0]")
    assert doc["a"]["b"] == [2.5, {"c": None}]
    assert status_of(DOC, Opcode.SUBDOC_DICT_ADD, b"s", b"1") == Status.SUBDOC_PATH_EEXISTS
    assert status_of(DOC, Opcode.SUBDOC_DICT_ADD, b"a.b[0]", b"1") == Status.SUBDOC_PATH_EINVAL
    assert status_of(DOC, Opcode.SUBDOC_DICT_UPSERT, b"x.y", b"1") == Status.SUBDOC_PATH_ENOENT
    assert (
        status_of(DOC, Opcode.SUBDOC_DICT_UPSERT, b"s.y", b"1", True) == Status.SUBDOC_PATH_MISMATCH
    )
    assert (
        status_of(DOC, Opcode.SUBDOC_DICT_UPSERT, b"a.b[9].y", b"1", True)
        == Status.SUBDOC_PATH_ENOENT
    )
    assert status_of(DOC, Opcode.SUBDOC_DICT_UPSERT, b"n", b"1 2") == Status.SUBDOC_VALUE_CANTINSERT
    assert status_of(DOC, Opcode.SUBDOC_REPLACE, b"nope", b"1") == Status.SUBDOC_PATH_ENOENT
    assert status_of(DOC, Opcode.SUBDOC_DELETE, b"a.nope") == Status.SUBDOC_PATH_ENOENT


def test_array_mutations() -> None:
    doc, _ = run(DOC, Opcode.SUBDOC_ARRAY_PUSH_LAST, b"a.b", b'"x", 3')
    assert doc["a"]["b"][-2:] == ["x", 3]
    doc, _ = run(DOC, Opcode.SUBDOC_ARRAY_PUSH_FIRST, b"a.b", b"0")
    assert doc["a"]["b"][0] == 0
    doc, _ = run(DOC, Opcode.SUBDOC_ARRAY_PUSH_LAST, b"q.list", b"1", mkdir=True)
    assert doc["q"] == {"list": [1]}
    doc, _ = run(b"[]", Opcode.SUBDOC_ARRAY_PUSH_LAST, b"", b"1")
    assert doc == [1]
    doc, _ = run(DOC, Opcode.SUBDOC_ARRAY_INSERT, b"a.b[3]", b'"end"')
    assert doc["a"]["b"][3] == "end"
    doc, _ = run(DOC, Opcode.SUBDOC_ARRAY_INSERT, b"a.b[0]", b'"a", "b"')
    assert doc["a"]["b"][:3] == ["a", "b", 1]
    doc, _ = run(b'{"t": [1, "1"]}', Opcode.SUBDOC_ARRAY_ADD_UNIQUE, b"t", b"1.0")
    assert doc["t"] == [1, "1", 1.0]  # compared as JSON text: 1.0 is not 1
    assert status_of(DOC, Opcode.SUBDOC_ARRAY_PUSH_LAST, b"a", b"1") == Status.SUBDOC_PATH_MISMATCH
    assert status_of(DOC, Opcode.SUBDOC_ARRAY_PUSH_LAST, b"q", b"1") == Status.SUBDOC_PATH_ENOENT
    assert (
        status_of(DOC, Opcode.SUBDOC_ARRAY_PUSH_LAST, b"a.b", b"") == Status.SUBDOC_VALUE_CANTINSERT
    )
    assert status_of(DOC, Opcode.SUBDOC_ARRAY_INSERT, b"a.b[4]", b"1") == Status.SUBDOC_PATH_ENOENT
    assert status_of(DOC, Opcode.SUBDOC_ARRAY_INSERT, b"a.b[-1]", b"1") == Status.SUBDOC_PATH_EINVAL
    assert status_of(DOC, Opcode.SUBDOC_ARRAY_INSERT, b"a.b", b"1") == Status.SUBDOC_PATH_EINVAL
    assert status_of(DOC, Opcode.SUBDOC_ARRAY_INSERT, b"a[0]", b"1") == Status.SUBDOC_PATH_MISMATCH
    unique = Opcode.SUBDOC_ARRAY_ADD_UNIQUE
    assert status_of(b'{"t": [1]}', unique, b"t", b"1") == Status.SUBDOC_PATH_EEXISTS
    assert status_of(b'{"t": [1]}', unique, b"t", b"[1]") == Status.SUBDOC_VALUE_CANTINSERT
    assert status_of(b'{"t": [1]}', unique, b"t", b"1, 2") == Status.SUBDOC_VALUE_CANTINSERT
    assert status_of(b'{"t": [[1]]}', unique, b"t", b"2") == Status.SUBDOC_PATH_MISMATCH


def test_counters() -> None:
    doc, answer = run(DOC, Opcode.SUBDOC_COUNTER, b"n", b"5")
    assert doc["n"] == 5 and answer == b"5"
    doc, answer = run(b'{"n": -3}', Opcode.SUBDOC_COUNTER, b"n", b"-10")
    assert doc["n"] == -13 and answer == b"-13"
    doc, answer = run(b'{"n": [1, 2]}', Opcode.SUBDOC_COUNTER, b"n[-1]", b"1")
    assert doc["n"] == [1, 3]
    counter = Opcode.SUBDOC_COUNTER
    for delta in (b"0", b"1.5", b"x", b"9223372036854775808", b" 1"):
        assert status_of(DOC, counter, b"n", delta) == Status.SUBDOC_DELTA_EINVAL, delta
    assert status_of(DOC, counter, b"s", b"1") == Status.SUBDOC_PATH_MISMATCH
    assert status_of(DOC, counter, b"a.b[1]", b"1") == Status.SUBDOC_PATH_MISMATCH  # 2.50
    assert status_of(DOC, counter, b"a.b[2].c", b"1") == Status.SUBDOC_PATH_MISMATCH  # null
    assert status_of(DOC, counter, b"big", b"1") == Status.SUBDOC_NUM_ERANGE
    assert (
        status_of(b'{"n": 9223372036854775807}', counter, b"n", b"1")
        == Status.SUBDOC_VALUE_CANTINSERT
    )
    assert status_of(DOC, counter, b"x.y", b"1") == Status.SUBDOC_PATH_ENOENT


def test_untouched_numbers_keep_their_text_and_depth_is_bounded() -> None:
    root = subdoc_paths.parse_document(b'{"f": 1.50, "e": 1E5, "z": -0, "i": 7}')
    subdoc_paths.mutate(root, Opcode.SUBDOC_DICT_UPSERT, b"new", b"2.0", mkdir=False)
    assert subdoc_paths.dumps(root) == b'{"f":1.50,"e":1E5,"z":-0,"i":7,"new":2.0}'
    deep = b"[" * 30 + b"]" * 30
    run(b"{}", Opcode.SUBDOC_DICT_UPSERT, b"a.b", deep, mkdir=True)  # 2 + 30 levels
    too_deep = b"[" * 31 + b"]" * 31
    assert (
        status_of(b"{}", Opcode.SUBDOC_DICT_UPSERT, b"a.b", too_deep, mkdir=True)
        == Status.SUBDOC_VALUE_ETOODEEP
    )
