"""Hypothesis fuzzing of every decoder the Couchbase SDK's commands added, with the codec's one
invariant (tests/unit/protocol/test_fuzz.py): for any input a decoder returns a value or
raises the error of its layer (`ProtocolError` for the wire, `SubdocError` for paths, the
`ScramError` kind of ProtocolError for SCRAM) — never IndexError, struct.error, ValueError,
RecursionError, UnicodeDecodeError. A decoded request encodes back to a request that decodes
the same. And the path engine keeps its promises on any document: a mutation that succeeds
leaves JSON no deeper than the limit, a failed one is reported with a SUBDOC status.

Inputs: random frames of the new opcodes, valid requests with random byte damage, random
paths over the path syntax's alphabet, random JSON documents with random operations.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from changefeed import limits
from changefeed.protocol import error_map, kv_ops, scram, subdoc, subdoc_paths
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.status import Status
from changefeed.protocol.subdoc import TRAITS, DocFlag, PathFlag, Spec
from changefeed.protocol.subdoc_paths import SubdocError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NEW_OPCODES = [
    Opcode.GET_META, Opcode.TOUCH, Opcode.GAT, Opcode.GET_LOCKED, Opcode.UNLOCK_KEY,
    Opcode.INCREMENT, Opcode.DECREMENT, Opcode.APPEND, Opcode.PREPEND,
    Opcode.SUBDOC_MULTI_LOOKUP, Opcode.SUBDOC_MULTI_MUTATION, Opcode.GET_ERROR_MAP, 0x01, 0xEE,
]  # fmt: skip
FRAME_DECODERS = [
    kv_ops.decode_get_meta, kv_ops.decode_touch, kv_ops.decode_get_locked, kv_ops.decode_unlock,
    kv_ops.decode_arithmetic, kv_ops.decode_concat, kv_ops.decode_clustermap_notification,
    subdoc.decode_multi_lookup, subdoc.decode_multi_mutation, error_map.decode_get_error_map,
]  # fmt: skip
BYTES_DECODERS = [
    kv_ops.decode_get_meta_extras, kv_ops.decode_arithmetic_value,
    subdoc.decode_lookup_results, subdoc.decode_mutation_results, error_map.decode_error_map,
    scram.parse_client_first, scram.parse_client_final,
]  # fmt: skip

small_bytes = st.binary(max_size=64)
frames = st.builds(
    Frame,
    magic=st.sampled_from([Magic.REQUEST, Magic.ALT_REQUEST, Magic.SERVER_REQUEST]),
    opcode=st.sampled_from(NEW_OPCODES),
    datatype=st.integers(0, 7),
    vbucket=st.integers(0, 0xFFFF),
    opaque=st.integers(0, 0xFFFF_FFFF),
    cas=st.sampled_from([0, 1, 2**64 - 1]),
    extras=st.one_of(small_bytes, st.binary(min_size=1, max_size=21)),
    key=st.one_of(small_bytes, st.binary(min_size=251, max_size=260)),
    value=st.binary(max_size=256),
)


def _decode_or_refuse(decoder: Any, data: Any) -> Any:
    try:
        return decoder(data)
    except ProtocolError as error:
        assert isinstance(error.status, int)
        return None


@FUZZ
@given(frames)
def test_every_frame_decoder_returns_or_raises_protocol_error(frame: Frame) -> None:
    for decoder in FRAME_DECODERS:
        _decode_or_refuse(decoder, frame)


NASTY = [
    b"9" * 5000,  # Python refuses to parse an int of more than 4300 digits (a ValueError)
    b'{"version": 2, "revision": ' + b"1" * 5000 + b', "errors": {}}',
    b"[" * 100_000,  # deeper than the JSON parser recurses
    b"1e400",
    b"n,,n=a,r=\xff",
    b"c=biws,r=x,p=" + b"A" * 4001,
]


@FUZZ
@given(st.binary(max_size=512) | st.sampled_from(NASTY))
def test_every_bytes_decoder_returns_or_raises_protocol_error(data: bytes) -> None:
    for decoder in BYTES_DECODERS:
        _decode_or_refuse(decoder, data)


json_text = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(json_text, st.binary(max_size=16))
def test_the_error_map_decoder_takes_any_json(document: Any, noise: bytes) -> None:
    _decode_or_refuse(error_map.decode_error_map, json.dumps(document).encode() + noise)
    wrapped = {"version": 2, "revision": 1, "errors": {"1": document, "x": document}}
    _decode_or_refuse(error_map.decode_error_map, json.dumps(wrapped).encode())


# -- sub-document requests: valid ones, then damaged -----------------------------------------

path_text = st.text(alphabet='ab.[]`-019\\"$', max_size=24).map(str.encode)
LOOKUP_OPS = [op for op, t in TRAITS.items() if not t.mutator]
MUTATION_OPS = [op for op, t in TRAITS.items() if t.mutator]


@st.composite
def specs(draw: st.DrawFn, *, mutator: bool) -> Spec:
    opcode = draw(st.sampled_from(MUTATION_OPS if mutator else LOOKUP_OPS))
    flags = PathFlag(draw(st.sampled_from([0, 1, 4, 0x10, 0x20, 5])))
    path = draw(st.one_of(path_text, st.just(b"$document.CAS"), st.just(b"")))
    value = draw(st.binary(max_size=12)) if mutator else b""
    return Spec(opcode, flags, path, value)


def _damage(data: bytes, positions: list[int], byte: int, cut: int) -> bytes:
    out = bytearray(data)
    for position in positions:
        if out:
            out[position % len(out)] ^= byte
    return bytes(out[: max(24, len(out) - cut)])


@FUZZ
@given(
    st.lists(specs(mutator=False), min_size=1, max_size=17),
    st.lists(specs(mutator=True), min_size=1, max_size=17),
    st.integers(0, 0x3F),
    st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    st.lists(st.integers(0, 4096), max_size=3),
    st.integers(1, 255),
    st.integers(0, 8),
)
def test_subdoc_requests_decode_to_what_was_sent_or_are_refused(
    lookups: list[Spec],
    mutations: list[Spec],
    doc_flags: int,
    expiry: int | None,
    positions: list[int],
    byte: int,
    cut: int,
) -> None:
    lookup = subdoc.MultiLookup(b"key", tuple(lookups), DocFlag(doc_flags))
    mutation = subdoc.MultiMutation(b"key", tuple(mutations), DocFlag(doc_flags), expiry)
    damage = (positions, byte, cut)
    _round_trip(lookup, subdoc.encode_multi_lookup, subdoc.decode_multi_lookup, damage)
    _round_trip(mutation, subdoc.encode_multi_mutation, subdoc.decode_multi_mutation, damage)


def _round_trip(
    request: Any,
    encode: Callable[[Any], bytes],
    decode: Callable[[Frame], Any],
    damage: tuple[list[int], int, int],
) -> None:
    data = encode(request)
    decoded = _decode_or_refuse(decode, _frame(data))
    if decoded is not None:
        assert decoded == request
        assert encode(decoded) == data
    _decode_or_refuse(decode, _frame(_damage(data, *damage), lenient=True))


def _frame(data: bytes, *, lenient: bool = False) -> Frame:
    """The request as a Frame, split by the header's lengths (damage may break them: then the
    parts are cut where the lengths say, as far as the bytes go)."""
    keylen = int.from_bytes(data[2:4], "big")
    extlen = data[4]
    body = data[24:]
    extras = body[:extlen]
    key = body[extlen : extlen + keylen]
    value = body[extlen + keylen :]
    if not lenient:
        assert len(data) == 24 + int.from_bytes(data[8:12], "big")
    return Frame(data[0], data[1], data[5], int.from_bytes(data[6:8], "big"), 0,
                 int.from_bytes(data[16:24], "big"), extras, key, value)  # fmt: skip


@FUZZ
@given(
    st.lists(
        st.builds(
            subdoc.LookupResult,
            st.sampled_from([int(s) for s in Status]),
            st.binary(max_size=20),
        ),
        max_size=16,
    )
)
def test_lookup_results_round_trip(results: list[subdoc.LookupResult]) -> None:
    assert subdoc.decode_lookup_results(subdoc.encode_lookup_results(results)) == results


@FUZZ
@given(st.lists(st.tuples(st.integers(0, 15), st.booleans(), st.binary(max_size=20)), max_size=16))
def test_mutation_results_round_trip(entries: list[tuple[int, bool, bytes]]) -> None:
    results = [
        subdoc.MutationResult(i, Status.SUCCESS, v) if ok else subdoc.MutationResult(i, 0xC0)
        for i, ok, v in entries
    ]
    assert subdoc.decode_mutation_results(subdoc.encode_mutation_results(results)) == results


# -- paths over documents ---------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=48) | path_text)
def test_any_path_parses_or_is_refused_with_a_subdoc_status(path: bytes) -> None:
    try:
        components = subdoc_paths.parse_path(path)
    except SubdocError as error:
        assert error.status in (Status.SUBDOC_PATH_EINVAL, Status.SUBDOC_PATH_E2BIG)
        return
    assert len(components) <= limits.SUBDOC_PATH_COMPONENTS_MAX
    assert all((isinstance(c, str) and c) or (isinstance(c, int) and c >= -1) for c in components)


value_text = st.one_of(
    json_text.map(lambda v: json.dumps(v).encode()),
    st.sampled_from([b"1, 2", b"", b"{", b"1.50", b"-0", b"1e400", b'"\\ud800"', b"[" * 40]),
    st.binary(max_size=8),
)


@FUZZ
@given(
    json_text | st.sampled_from([b"[" * 40 + b"]" * 40, b"not json", b"1.50"]),
    st.lists(
        st.tuples(st.sampled_from(LOOKUP_OPS + MUTATION_OPS), path_text, value_text, st.booleans()),
        min_size=1,
        max_size=6,
    ),
)
def test_operations_on_any_document_keep_it_json_and_bounded(
    document: Any, operations: list[tuple[int, bytes, bytes, bool]]
) -> None:
    body = document if isinstance(document, bytes) else json.dumps(document).encode()
    try:
        root = subdoc_paths.parse_document(body)
    except SubdocError as error:
        assert error.status in (Status.SUBDOC_DOC_NOTJSON, Status.SUBDOC_DOC_E2DEEP)
        return
    for opcode, path, value, mkdir in operations:
        if opcode in (Opcode.GET, Opcode.SET, Opcode.DELETE):
            continue  # whole-document operations never reach the path engine
        try:
            if TRAITS[opcode].mutator:
                subdoc_paths.mutate(root, opcode, path, value, mkdir=mkdir)
            else:
                subdoc_paths.lookup(root, opcode, path)
        except SubdocError as error:
            assert 0xC0 <= error.status <= 0xCA, error
            # A failed mutation may have created parents: the caller drops the working copy.
            root = subdoc_paths.parse_document(body)
    written = subdoc_paths.dumps(root)
    again = subdoc_paths.parse_document(written)  # valid JSON, within the depth limit
    assert subdoc_paths.dumps(again) == written
