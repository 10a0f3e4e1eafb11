"""Seeded fuzzing of the codec. The one invariant (h11's fuzz/afl-server.py habit):

    For ANY input bytes, fed in ANY chunking, ``FrameReader.next_frame`` / ``read_batch`` and
    every message decoder applied to whatever frames come out either return a value (a frame,
    ``NEED_DATA``, ``CLOSED``, a message) or raise ``ProtocolError``. Nothing else: no
    IndexError, struct.error, ValueError, RecursionError, UnicodeDecodeError.

Alongside it, checked on every case: the reader never holds more than one unfinished frame plus
the chunk just fed (``HEADER_SIZE + frame_size_max + chunk``); after a ``ProtocolError`` it is
poisoned; after EOF it reaches ``CLOSED`` with nothing buffered or raises; and the batch path
agrees with the per-frame path (same error status, or the same rows and control frames), taking
turns between its numpy and its per-frame decoder.

Inputs are random bytes, random bytes behind a plausible header, and valid frames of every
message type mutated by bit flips, byte overwrites, truncation, length-field corruption, magic
swaps, insertion, deletion, duplication and splicing of two streams.

The seed is printed; ``CHANGEFEED_TEST_SEED=<seed>`` replays a run, and a failure message names
the case index too.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Callable

import pytest

from changefeed import limits
from changefeed.protocol import dcp, dcp_items, kv, sasl
from changefeed.protocol.dcp import (
    DcpControl,
    DcpOpen,
    StreamEnd,
    StreamEndReason,
    StreamRequest,
    WireVbucketState,
)
from changefeed.protocol.dcp_items import Deletion, Expiration, Mutation, SeqnoAdvanced
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame, encode_response
from changefeed.protocol.frame_info import encode_frame_info
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader
from changefeed.protocol.snapshot_marker import (
    MarkerVersion,
    SnapshotMarker,
    encode_snapshot_marker,
)
from changefeed.protocol.status import Status

from .helpers import apply_every_decoder, decode_message, is_batch_item, row_of, rows_of

SEED_ENV = "CHANGEFEED_TEST_SEED"
HEADER = limits.HEADER_SIZE
COMPACT_SLACK_BYTES = 64 * 1024  # reader.py compacts once this many consumed bytes sit in front
VECTORISE_MODES = (None, True, False)  # decode_batch: by size, numpy, per frame


def run_seed(name: str) -> int:
    raw = os.environ.get(SEED_ENV)
    seed = int(raw, 0) if raw else random.SystemRandom().randrange(2**32)
    print(f"{name}: {SEED_ENV}={seed}")
    return seed


# -- a corpus of valid frames of every message type ------------------------------------------------


def _u(rng: random.Random, bits: int) -> int:
    # Bias towards edges: 0, 1, max, and small numbers show up far more than uniform draws give.
    pick = rng.random()
    if pick < 0.1:
        return 0
    if pick < 0.2:
        return (1 << bits) - 1
    if pick < 0.5:
        return rng.randint(0, 300)
    return rng.getrandbits(bits)


def _key(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice([1, 2, 16, rng.randint(1, 40), 250]))


def _value(rng: random.Random) -> bytes:
    return rng.randbytes(rng.choice([0, 1, 10, 100, rng.randint(0, 400)]))


def _sid(rng: random.Random) -> int | None:
    return None if rng.random() < 0.6 else rng.randint(1, 0xFFFF)


def _seqno(rng: random.Random) -> int:
    return max(1, _u(rng, 64))


def _json_value(rng: random.Random) -> dict[str, object]:
    value: dict[str, object] = {}
    if rng.random() < 0.5:
        value["sid"] = rng.randint(1, 0xFFFF)
    if rng.random() < 0.5:
        value["purge_seqno"] = str(_u(rng, 64))
    if rng.random() < 0.3:
        value["collections"] = [format(rng.getrandbits(32), "x")]
    return value


def _marker(rng: random.Random) -> bytes:
    version = rng.choice(list(MarkerVersion))
    start, end = sorted((_u(rng, 64), _u(rng, 64)))
    v2 = version is not MarkerVersion.V1
    v22 = version is MarkerVersion.V2_2
    return encode_snapshot_marker(
        SnapshotMarker(
            _u(rng, 16),
            _u(rng, 32),
            start,
            end,
            rng.getrandbits(6),
            _u(rng, 64) if v2 else 0,
            _u(rng, 64) if v2 else 0,
            _u(rng, 64) if v22 else 0,
            _u(rng, 64) if v22 else 0,
            version,
            _sid(rng),
        )
    )


# JSON a peer may send in a DCP_OPEN or DCP_STREAM_REQ value: well-formed at the frame level,
# hostile to the JSON layer (nesting past the recursion limit, non-ASCII digits, huge numbers,
# wrong types, NaN). Random bit flips almost never produce these, so they are built directly.
JSON_PIECES = [
    b"[" * 5000,
    b'{"a":' * 3000,
    '{"purge_seqno": "\u00b2"}'.encode(),
    '{"purge_seqno": "\u0661\u0662"}'.encode(),
    b'{"purge_seqno": "' + b"9" * 5000 + b'"}',
    b'{"purge_seqno": "18446744073709551616"}',
    b'{"purge_seqno": 7}',
    b'{"sid": ' + b"9" * 5000 + b"}",
    b'{"sid": 0}',
    b'{"sid": 1e3}',
    b'{"sid": true}',
    b'{"sid": NaN}',
    b'{"sid": -Infinity}',
    b'{"consumer_name": null}',
    b'{"consumer_name": ["x"]}',
    b"\xef\xbb\xbf{}",
    b"\xff\xfe{\x00}\x00",
    b"NaN",
    b'"\\ud800"',
]


def _hostile_json(rng: random.Random) -> bytes:
    value = rng.choice(JSON_PIECES)
    if rng.random() < 0.3:
        value = json.dumps(_json_value(rng)).encode()[:-1] + b", " + value[1:]
    if rng.random() < 0.5:
        return kv.encode_request(
            Opcode.DCP_STREAM_REQ, extras=bytes(48), value=value, datatype=1, opaque=_u(rng, 32)
        )
    return kv.encode_request(Opcode.DCP_OPEN, extras=bytes(8), key=b"n", value=value, datatype=1)


def _request(rng: random.Random) -> Frame:
    return Frame(Magic.REQUEST, rng.choice(list(Opcode)), opaque=_u(rng, 32), vbucket=_u(rng, 16))


BUILDERS: list[Callable[[random.Random], bytes]] = [
    lambda r: dcp_items.encode_mutation(
        Mutation(
            _u(r, 16),
            _u(r, 32),
            _seqno(r),
            _key(r),
            _value(r),
            _u(r, 64),
            _u(r, 64),
            _u(r, 32),
            _u(r, 32),
            _u(r, 32),
            r.randint(0, 7),
            _sid(r),
        )
    ),
    lambda r: dcp_items.encode_deletion(
        Deletion(
            _u(r, 16),
            _u(r, 32),
            _seqno(r),
            _key(r),
            _u(r, 64),
            _u(r, 64),
            r.choice([None, _u(r, 32)]),
            r.choice([b"", _value(r)]),
            r.randint(0, 7),
            _sid(r),
        )
    ),
    lambda r: dcp_items.encode_expiration(
        Expiration(
            _u(r, 16),
            _u(r, 32),
            _seqno(r),
            _key(r),
            _u(r, 64),
            _u(r, 64),
            _u(r, 32),
            b"",
            r.randint(0, 7),
            _sid(r),
        )
    ),
    lambda r: dcp_items.encode_seqno_advanced(
        SeqnoAdvanced(_u(r, 16), _u(r, 32), _u(r, 64), _sid(r))
    ),
    lambda r: b"".join(
        dcp_items.encode_item_body(
            Opcode.DCP_MUTATION,
            vbucket=_u(r, 16),
            opaque=_u(r, 32),
            cas=_u(r, 64),
            datatype=r.randint(0, 7),
            extras_len=31,
            key_len=3,
            body=struct.pack(">QQIIIHB", _seqno(r), 1, 0, 0, 0, 0, 0) + b"key" + _value(r),
            stream_id=_sid(r),
        )
    ),
    _marker,
    _marker,
    lambda r: dcp.encode_stream_end(
        StreamEnd(_u(r, 16), _u(r, 32), r.choice(list(StreamEndReason)), _sid(r))
    ),
    lambda r: dcp.encode_close_stream(_u(r, 16), _u(r, 32), _sid(r)),
    lambda r: dcp.encode_dcp_noop(_u(r, 32)),
    lambda r: dcp.encode_buffer_ack(r.randint(1, 2**32 - 1)),
    lambda r: dcp.encode_set_vbucket_state(_u(r, 16), _u(r, 32), r.choice(list(WireVbucketState))),
    lambda r: dcp.encode_get_failover_log(_u(r, 16), _u(r, 32), dcp=r.random() < 0.5),
    lambda r: dcp.encode_dcp_open(
        DcpOpen(
            _u(r, 32),
            "cf:" + str(r.random()),
            r.choice([1, 0x25, 0x125, 0x201]),
            r.choice([None, "replica"]),
        )
    ),
    lambda r: dcp.encode_dcp_control(
        DcpControl(_u(r, 32), r.choice(["enable_noop", "set_noop_interval"]), str(r.random()))
    ),
    lambda r: dcp.encode_stream_request(
        StreamRequest(
            _u(r, 16),
            _u(r, 32),
            r.getrandbits(9) & dcp.STREAM_FLAGS_VALID,
            _u(r, 64),
            _u(r, 64),
            _u(r, 64),
            _u(r, 64),
            _u(r, 64),
            _json_value(r),
        )
    ),
    lambda r: encode_response(
        _request(r),
        value=dcp.encode_failover_log([(_u(r, 64), _u(r, 64)) for _ in range(r.randint(1, 25))]),
    ),
    lambda r: encode_response(
        _request(r), Status.ROLLBACK, value=dcp.encode_rollback_seqno(_u(r, 64))
    ),
    lambda r: kv.encode_hello(
        _u(r, 32), "agent", [r.getrandbits(16) for _ in range(r.randint(0, 9))]
    ),
    lambda r: kv.encode_store(
        kv.StoreCommand(
            r.choice(sorted(kv.STORE_OPCODES)),
            _u(r, 16),
            _u(r, 32),
            _key(r),
            _value(r),
            _u(r, 32),
            _u(r, 32),
            _u(r, 64),
            r.randint(0, 7),
        )
    ),
    lambda r: kv.encode_request(r.choice([Opcode.GET, Opcode.DELETE]), key=_key(r), cas=_u(r, 64)),
    lambda r: encode_response(
        _request(r), extras=kv.encode_mutation_token(_u(r, 64), _u(r, 64)), cas=_u(r, 64)
    ),
    lambda r: kv.encode_request(
        Opcode.GET_ALL_VB_SEQNOS, extras=r.choice([b"", struct.pack(">I", r.randint(0, 4))])
    ),
    lambda r: encode_response(
        _request(r),
        value=kv.encode_vb_seqnos([(_u(r, 16), _u(r, 64)) for _ in range(r.randint(0, 8))]),
    ),
    lambda r: kv.encode_request(Opcode.OBSERVE_SEQNO, value=struct.pack(">Q", _u(r, 64))),
    lambda r: encode_response(
        _request(r),
        value=kv.encode_observe_seqno_result(
            kv.ObserveSeqnoResult(
                _u(r, 16),
                _u(r, 64),
                _u(r, 64),
                _u(r, 64),
                *((_u(r, 64), _u(r, 64)) if r.random() < 0.5 else (None, None)),
            )
        ),
    ),
    _hostile_json,
    lambda r: kv.encode_request(
        Opcode.SASL_AUTH, key=b"PLAIN", value=sasl.encode_plain("user", str(r.random()))
    ),
    lambda r: encode_response(_request(r), value=" ".join(sasl.MECHANISMS).encode()),
    lambda r: encode_frame(
        r.choice([Magic.ALT_REQUEST, Magic.ALT_RESPONSE]),
        r.getrandbits(8),
        framing_extras=b"".join(
            encode_frame_info(r.randint(0, 270), r.randbytes(r.choice([0, 1, 2, 15, 20])))
            for _ in range(r.randint(1, 3))
        ),
        extras=r.randbytes(r.randint(0, 40)),
        key=r.randbytes(r.randint(0, 20)),
        value=json.dumps(_json_value(r)).encode() if r.random() < 0.3 else _value(r),
    ),
]


def valid_stream(rng: random.Random) -> tuple[bytearray, list[int]]:
    """A few valid frames back to back, and where each frame starts."""
    data = bytearray()
    starts = []
    for _ in range(rng.choice([1, 1, 2, 3, rng.randint(1, 8)])):
        starts.append(len(data))
        data += rng.choice(BUILDERS)(rng)
    return data, starts


# -- mutations ------------------------------------------------------------------------------------


def _flip(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    for _ in range(rng.randint(1, 8)):
        if data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)


def _overwrite(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    if data:
        # Header bytes are where the interesting decisions are: hit them more often.
        at = (
            rng.choice(starts) + rng.randrange(HEADER)
            if rng.random() < 0.6
            else rng.randrange(len(data))
        )
        if at < len(data):
            data[at] = rng.getrandbits(8)


def _truncate(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    del data[rng.randint(0, len(data)) :]


def _length_field(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    start = rng.choice(starts)
    if start + HEADER > len(data):
        return
    offset, fmt = rng.choice([(8, ">I"), (8, ">I"), (2, ">H"), (4, ">B"), (2, ">B"), (3, ">B")])
    (old,) = struct.unpack_from(fmt, data, start + offset)
    top = (1 << (8 * struct.calcsize(fmt))) - 1
    new = rng.choice(
        [
            0,
            1,
            old - 1,
            old + 1,
            top,
            top - 1,
            limits.FRAME_SIZE_MAX,
            limits.FRAME_SIZE_MAX + 1,
            rng.randint(0, top),
        ]
    )
    struct.pack_into(fmt, data, start + offset, min(max(new, 0), top))


def _magic(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    start = rng.choice(starts)
    if start < len(data):
        data[start] = rng.choice([0x80, 0x81, 0x08, 0x18, 0x82, 0x83, rng.getrandbits(8)])


def _insert(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    at = rng.randint(0, len(data))
    data[at:at] = rng.randbytes(rng.randint(1, 30))


def _delete(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    if data:
        at = rng.randrange(len(data))
        del data[at : at + rng.randint(1, 30)]


def _duplicate(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    if data:
        at = rng.randrange(len(data))
        piece = data[at : at + rng.randint(1, 80)]
        where = rng.randint(0, len(data))
        data[where:where] = piece


def _splice(rng: random.Random, data: bytearray, starts: list[int]) -> None:
    other, _ = valid_stream(rng)
    cut = rng.randint(0, len(data))
    data[cut:] = other[rng.randint(0, len(other)) :]


MUTATORS = [
    _flip,
    _overwrite,
    _truncate,
    _length_field,
    _length_field,
    _magic,
    _insert,
    _delete,
    _duplicate,
    _splice,
]


def fuzz_input(rng: random.Random) -> bytes:
    pick = rng.random()
    if pick < 0.08:
        return rng.randbytes(rng.randint(0, 200))  # pure noise
    if pick < 0.2:
        # Noise behind a plausible header: known magic, DCP-ish opcode, small random lengths.
        magic = rng.choice([0x80, 0x81, 0x08, 0x18])
        body = rng.randbytes(rng.randint(0, 120))
        if magic in (0x08, 0x18):
            lengths = (rng.randint(0, 8), rng.randint(0, 8))
            header = struct.pack(">BBBB", magic, rng.randint(0x50, 0x65), *lengths)
        else:
            header = struct.pack(">BBH", magic, rng.randint(0x50, 0x65), rng.randint(0, 8))
        header += struct.pack(">BBHI", rng.randint(0, 48), rng.randint(0, 7), 0, len(body))
        return header + bytes(8) + body
    data, starts = valid_stream(rng)
    if pick < 0.3:
        return bytes(data)  # valid input must come through too
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        rng.choice(MUTATORS)(rng, data, starts)
    return bytes(data)


# -- running one case -----------------------------------------------------------------------------


def _chunks(rng: random.Random, data: bytes) -> tuple[list[bytes], int]:
    chunk_max = rng.choice([1, 3, 24, 100, 1000, 1 << 16])
    out = []
    pos = 0
    while pos < len(data):  # bounded: every chunk is >= 1 byte
        size = rng.randint(1, chunk_max)
        out.append(data[pos : pos + size])
        pos += size
    return out, chunk_max


def _assert_poisoned(reader: FrameReader, error: ProtocolError) -> None:
    for call in (reader.next_frame, reader.read_batch, lambda: reader.feed(b"x")):
        with pytest.raises(ProtocolError) as again:
            call()
        assert again.value.status == error.status


def _memory_bound(reader: FrameReader, frame_size_max: int, chunk_max: int) -> None:
    bound = HEADER + frame_size_max + chunk_max
    assert reader.buffered_bytes <= bound, (reader.buffered_bytes, bound)
    # White-box: the backing bytearray also holds consumed bytes until it compacts.
    backing = len(reader._buffer)
    assert backing <= 2 * bound + COMPACT_SLACK_BYTES, (backing, bound)


def per_frame_path(
    data_chunks: list[bytes], frame_size_max: int, chunk_max: int
) -> tuple[Status | None, list[object], list[tuple[int, Frame]]]:
    """next_frame on every chunk; every decoder on every frame. Returns the batch oracle: the
    first error the batch path must also hit (a reader error, or a bad classic-magic item), and
    the rows and controls up to it."""
    reader = FrameReader(frame_size_max)
    oracle_error: Status | None = None
    rows: list[object] = []
    controls: list[tuple[int, Frame]] = []
    try:
        for chunk in [*data_chunks, b""]:
            reader.feed(chunk)
            _memory_bound(reader, frame_size_max, chunk_max)
            while True:  # bounded: each frame consumes >= 24 buffered bytes
                frame = reader.next_frame()
                if frame is NEED_DATA:
                    assert chunk, "NEED_DATA after EOF"
                    assert reader.buffered_bytes < HEADER + frame_size_max
                    break
                if frame is CLOSED:
                    assert not chunk, "CLOSED before EOF"
                    assert reader.buffered_bytes == 0
                    assert reader.next_frame() is CLOSED
                    break
                assert isinstance(frame, Frame), frame
                assert len(frame.encode()) == frame.wire_size
                apply_every_decoder(frame)
                if oracle_error is not None:
                    continue
                if is_batch_item(frame):
                    try:
                        item = decode_message(frame)
                    except ProtocolError as error:
                        oracle_error = error.status
                        continue
                    assert isinstance(item, Mutation | Deletion | Expiration)
                    rows.append(row_of(item))
                else:
                    controls.append((len(rows), frame))
    except ProtocolError as error:
        _assert_poisoned(reader, error)
        if oracle_error is None:
            oracle_error = error.status
    return oracle_error, rows, controls


def batch_path(
    rng: random.Random,
    data_chunks: list[bytes],
    frame_size_max: int,
    chunk_max: int,
    vectorise: bool | None = None,
) -> tuple[Status | None, list[object], list[tuple[int, Frame]]]:
    reader = FrameReader(frame_size_max)
    rows: list[object] = []
    controls: list[tuple[int, Frame]] = []
    items_max = rng.choice([1, 2, 1 << 20])
    try:
        for chunk in [*data_chunks, b""]:
            reader.feed(chunk)
            _memory_bound(reader, frame_size_max, chunk_max)
            while True:  # bounded: stops when a call consumes nothing
                batch = reader.read_batch(items_max, vectorise=vectorise)
                assert len(batch.changes) <= items_max
                batch.changes._check_invariants()
                base = len(rows)
                rows += rows_of(batch.changes)
                controls += [(base + at, frame) for at, frame in batch.controls]
                if batch.consumed == 0:
                    break
        assert reader.buffered_bytes == 0
    except ProtocolError as error:
        _assert_poisoned(reader, error)
        return error.status, rows, controls
    return None, rows, controls


def run_case(seed: int, index: int) -> None:
    rng = random.Random(f"{seed}:{index}")
    data = fuzz_input(rng)
    frame_size_max = rng.choice([limits.FRAME_SIZE_MAX] * 6 + [40, 64, 300, 4096])
    data_chunks, chunk_max = _chunks(rng, data)
    try:
        expected = per_frame_path(data_chunks, frame_size_max, chunk_max)
        # The batch decoder's two ways (numpy, per frame) and its choice by size take turns.
        vectorise = VECTORISE_MODES[index % len(VECTORISE_MODES)]
        got = batch_path(rng, data_chunks, frame_size_max, chunk_max, vectorise)
        assert got[0] == expected[0], ("error status", got[0], expected[0])
        if expected[0] is None:
            assert got[1:] == expected[1:]
    except BaseException as failure:
        failure.add_note(f"{SEED_ENV}={seed} case {index}: input {data.hex()}")
        raise


def run_cases(name: str, count: int) -> None:
    seed = run_seed(name)
    for index in range(count):
        run_case(seed, index)


def test_fuzz_codec() -> None:
    run_cases("test_fuzz_codec", 5_000)


@pytest.mark.slow
def test_fuzz_codec_long() -> None:
    run_cases("test_fuzz_codec_long", 100_000)


def test_fuzz_inputs_cover_every_builder_and_error_kind() -> None:
    # The corpus must actually exercise the paths the invariant talks about; a generator that
    # only produced noise would pass vacuously.
    rng = random.Random(1)
    for builder in BUILDERS:
        data = builder(rng)
        reader = FrameReader()
        reader.feed(data)
        frame = reader.next_frame()
        assert isinstance(frame, Frame)
        assert reader.buffered_bytes == 0
    statuses: set[int] = set()
    frames = 0
    for index in range(2_000):
        case_rng = random.Random(f"cover:{index}")
        data = fuzz_input(case_rng)
        reader = FrameReader(case_rng.choice([limits.FRAME_SIZE_MAX, 64]))
        reader.feed(data)
        reader.feed(b"")
        try:
            while isinstance(reader.next_frame(), Frame):  # bounded by len(data)
                frames += 1
        except ProtocolError as error:
            statuses.add(error.status)
    assert {Status.EINVAL, Status.E2BIG} <= statuses
    assert frames > 1_000
