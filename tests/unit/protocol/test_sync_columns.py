"""``decode_batch`` with DCP_PREPARE / DCP_COMMIT as columns (protocol/sync_columns.py) against
the reference, ``sync_columns=False`` (each such frame a control ``Frame``, then the message
decoders): every row holds what ``decode_prepare`` / ``decode_commit`` give, in the frame's
place in wire order; a frame the decoders refuse stays a control frame; the same error at the
same frame. Hypothesis streams of every kind of item and control, in both decoders (numpy and
per frame), and a seeded fuzz of mutated streams (printed seed, ``CHANGEFEED_TEST_SEED``)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.batch import Batch, decode_batch
from changefeed.protocol.dcp_items import (
    ABORT_EXTRAS,
    Abort,
    Commit,
    Deletion,
    Mutation,
    Prepare,
    decode_commit,
    decode_prepare,
    encode_abort,
    encode_commit,
    encode_deletion,
    encode_mutation,
    encode_prepare,
)
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.snapshot_marker import MarkerFlag, SnapshotMarker, encode_snapshot_marker
from changefeed.protocol.sync_columns import FIELDS, SyncColumns

MODES = (None, True, False)  # decode_batch: by size, numpy, per frame
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
KEYS = st.binary(min_size=1, max_size=12)


def prepare_frame(draw: st.DrawFn) -> bytes:
    prepare = Prepare(
        draw(st.integers(0, 3)), draw(U32), draw(st.integers(1, 2**64 - 1)), draw(KEYS),
        draw(st.binary(max_size=30)), draw(st.integers(1, 2**64 - 1)), draw(U64), draw(U32),
        draw(U32), draw(st.booleans()), draw(st.integers(1, 3)), draw(st.integers(0, 7)),
        draw(U32),
    )  # fmt: skip
    return encode_prepare(prepare)


def bad_sync_frame(draw: st.DrawFn) -> bytes:
    """A DCP_PREPARE or DCP_COMMIT whose header is fine and whose decoder refuses it."""
    kind = draw(st.sampled_from(["level", "cas", "deleted", "extras", "ending", "no key"]))
    if kind in ("level", "cas", "deleted"):
        level = 0 if kind == "level" else 1
        extras = bytearray(31)
        extras[7] = 5  # seqno 5
        extras[29] = 2 if kind == "deleted" else 0
        extras[30] = level
        cas = 0 if kind == "cas" else 9
        return encode_frame(
            Magic.REQUEST, Opcode.DCP_PREPARE, cas=cas, extras=bytes(extras), key=b"k"
        )
    if kind == "extras":
        opcode = draw(st.sampled_from([Opcode.DCP_PREPARE, Opcode.DCP_COMMIT]))
        return encode_frame(Magic.REQUEST, opcode, cas=3, extras=b"\x01" * 20, key=b"k")
    if kind == "ending":  # a commit not after its prepare
        prepared = draw(st.integers(0, 9))
        extras = ABORT_EXTRAS.pack(prepared, draw(st.integers(0, prepared)))
        return encode_frame(Magic.REQUEST, Opcode.DCP_COMMIT, extras=extras, key=b"k")
    return encode_frame(Magic.REQUEST, Opcode.DCP_COMMIT, extras=ABORT_EXTRAS.pack(1, 2))


@st.composite
def frames(draw: st.DrawFn) -> list[bytes]:
    out: list[bytes] = []
    for _ in range(draw(st.integers(0, 60))):
        vb = draw(st.integers(0, 3))
        kind = draw(
            st.sampled_from(
                ["prepare", "prepare", "commit", "commit", "abort", "mutation", "deletion",
                 "marker", "noop", "bad"]
            )
        )  # fmt: skip
        seqno = draw(st.integers(1, 50))
        if kind == "prepare":
            out.append(prepare_frame(draw))
        elif kind == "commit":
            commit = Commit(vb, draw(U32), draw(KEYS), seqno, seqno + draw(st.integers(1, 5)))
            out.append(encode_commit(commit))
        elif kind == "abort":
            out.append(encode_abort(Abort(vb, 1, draw(KEYS), seqno, seqno + 1)))
        elif kind == "mutation":
            out.append(encode_mutation(Mutation(vb, 1, seqno, draw(KEYS), b"v", 5, 1, 2, 3)))
        elif kind == "deletion":
            out.append(encode_deletion(Deletion(vb, 1, seqno, draw(KEYS), 6, 1, 9)))
        elif kind == "marker":
            marker = SnapshotMarker(vb, 1, seqno, seqno + 9, MarkerFlag.MEMORY)
            out.append(encode_snapshot_marker(marker))
        elif kind == "noop":
            out.append(encode_frame(Magic.REQUEST, Opcode.DCP_NOOP, opaque=seqno))
        else:
            out.append(bad_sync_frame(draw))
    return out


def row(columns: SyncColumns, index: int) -> dict[str, Any]:
    return {name: getattr(columns, name)[index] for name in FIELDS}


def expected_row(frame: Frame) -> dict[str, Any] | None:
    """What a row must hold for `frame` (the message decoders), or None if they refuse it."""
    try:
        if frame.opcode == Opcode.DCP_PREPARE:
            p = decode_prepare(frame)
            return {
                "opcode": frame.opcode, "vbucket": p.vbucket, "opaque": p.opaque,
                "seqno": p.seqno, "prepared_seqno": 0, "cas": p.cas, "rev_seqno": p.rev_seqno,
                "flags": p.flags, "expiry": p.expiry, "delete_time": p.delete_time,
                "datatype": p.datatype, "deleted": p.deleted, "level": p.level, "key": p.key,
                "value": p.value, "wire_size": frame.wire_size,
            }  # fmt: skip
        c = decode_commit(frame)
    except ProtocolError:
        return None
    return {
        "opcode": frame.opcode, "vbucket": c.vbucket, "opaque": c.opaque,
        "seqno": c.commit_seqno, "prepared_seqno": c.prepared_seqno, "cas": 0,
        "rev_seqno": 0, "flags": 0, "expiry": 0, "delete_time": 0, "datatype": frame.datatype,
        "deleted": False, "level": 0, "key": c.key, "value": b"", "wire_size": frame.wire_size,
    }  # fmt: skip


def assert_same_wire_order(columns: Batch, reference: Batch) -> None:
    """`columns` holds the reference's changes, and its controls and syncs are the reference's
    controls: each sync frame the decoders take is a row in the frame's place, the others
    control frames in theirs."""
    assert columns.changes == reference.changes
    assert (columns.consumed, columns.item_bytes) == (reference.consumed, reference.item_bytes)
    syncs = columns.syncs
    syncs._check_invariants()
    taken = seen = 0  # rows and control frames of `columns` met so far
    for position, frame in reference.controls:
        sync = frame.magic == Magic.REQUEST and frame.opcode in (
            Opcode.DCP_PREPARE,
            Opcode.DCP_COMMIT,
        )
        wanted = expected_row(frame) if sync else None
        if wanted is None:
            assert columns.controls[seen] == (position, frame)
            seen += 1
            continue
        got = row(syncs, taken)
        assert (got.pop("position"), got.pop("control")) == (position, seen)
        assert got == wanted
        taken += 1
    assert seen == len(columns.controls)
    assert taken == len(syncs)


@settings(max_examples=100, deadline=None)
@given(frames())
def test_sync_frames_as_columns_equal_the_message_decoders(stream: list[bytes]) -> None:
    data = b"".join(stream)
    reference = decode_batch(data, sync_columns=False, vectorise=False)
    for vectorise in MODES:
        columns = decode_batch(data, vectorise=vectorise)
        assert_same_wire_order(columns, reference)
        assert columns == decode_batch(data, vectorise=not vectorise)


def test_a_commit_a_decoder_refuses_stays_a_frame_and_fails_where_it_did() -> None:
    good = encode_commit(Commit(1, 1, b"k", 2, 3))
    bad = encode_frame(Magic.REQUEST, Opcode.DCP_COMMIT, extras=ABORT_EXTRAS.pack(3, 3), key=b"k")
    batch = decode_batch(good + bad + good)
    assert len(batch.syncs) == 2
    assert (batch.syncs.position, batch.syncs.control) == ([0, 0], [0, 1])
    [(position, frame)] = batch.controls
    assert position == 0
    with pytest.raises(ProtocolError, match="DCP_COMMIT of prepare 3 at 3"):
        decode_commit(frame)


def test_fuzzed_streams_decode_the_same_or_fail_the_same() -> None:
    """Valid streams with bytes flipped, overwritten, cut or spliced: both ways raise the same
    error, or give the same changes, controls and (as rows) sync frames."""
    seed = int(os.environ.get("CHANGEFEED_TEST_SEED", random.randrange(1 << 32)))
    print(f"seed {seed}")
    rng = random.Random(seed)
    for case in range(600):
        parts = []
        for n in range(rng.randrange(1, 30)):
            if rng.random() < 0.5:
                extras = (n + 1, n, 1, 2, 0, 0, rng.randrange(2), rng.randrange(1, 4))
                prepare = Prepare(1, n, extras[0], b"key%d" % n, b"v" * n, 7, *extras[1:4],
                                  bool(extras[6]), extras[7])  # fmt: skip
                parts.append(encode_prepare(prepare))
            elif rng.random() < 0.7:
                parts.append(encode_commit(Commit(1, n, b"key%d" % n, n + 1, n + 2)))
            else:
                parts.append(encode_mutation(Mutation(1, 1, n + 1, b"m%d" % n, b"v", 5, 1, 2, 3)))
        data = bytearray(b"".join(parts))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data))
            action = rng.randrange(3)
            if action == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif action == 1:
                data[at] = rng.randrange(256)
            else:
                del data[at:]
                if not data:
                    data += parts[0]
        outcomes = []
        for sync_columns, vectorise in ((False, False), (True, False), (True, True)):
            try:
                outcomes.append(decode_batch(bytes(data), vectorise=vectorise,
                                             sync_columns=sync_columns))  # fmt: skip
            except ProtocolError as error:
                outcomes.append((error.status, str(error)))
        reference, *others = outcomes
        for other in others:
            if isinstance(reference, Batch):
                assert isinstance(other, Batch), (case, other)
                assert_same_wire_order(other, reference)
            else:
                assert other == reference, case


@settings(max_examples=60, deadline=None)
@given(frames(), st.data())
def test_controls_a_connection_takes_leave_the_batch_as_if_never_sent(
    stream: list[bytes], data: st.DataObject
) -> None:
    """`Batch.keep_controls` (consumer/connection.py drops the responses it resolves): the
    batch equals the decode of the stream without those frames, sync rows' places included."""
    taken: set[int] = set()
    for opaque in range(1, 5):  # responses anywhere, some taken by the connection
        answer = encode_frame(Magic.RESPONSE, Opcode.DCP_CONTROL, opaque=opaque)
        stream.insert(data.draw(st.integers(0, len(stream))), answer)
        if data.draw(st.booleans()):
            taken.add(opaque)
    # Only the answers are responses here: the others are requests (magic 0x80).
    kept_stream = [f for f in stream if f[0] != Magic.RESPONSE or _opaque(f) not in taken]
    batch = decode_batch(b"".join(stream))
    keep = [not (frame.magic == Magic.RESPONSE and frame.opaque in taken)
            for _, frame in batch.controls]  # fmt: skip
    batch.keep_controls(keep)
    batch.syncs._check_invariants()
    remaining = decode_batch(b"".join(kept_stream))
    assert batch.changes == remaining.changes
    assert batch.controls == remaining.controls
    assert batch.syncs == remaining.syncs


def _opaque(frame: bytes) -> int:
    return int.from_bytes(frame[12:16], "big")
