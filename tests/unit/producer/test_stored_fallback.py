"""A disk run that leaves the stored fast path (a tombstone rewritten for the stream: deletion
V1 without IncludeDeleteTimes, DCP_EXPIRATION with the expiry opcode) frames its records one
by one, and there only the rewritten records are decoded: the others keep the fast path's
frame. Either way the frames equal a simple model: every record decoded (`decode_record`) and
framed by `ItemFramer.frame`, from the front until the budget is reached (at least one).
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from changefeed.producer import item_encoding
from changefeed.producer.item_encoding import ItemFramer, ItemOptions
from changefeed.storage import Op
from changefeed.storage.record import decode_record, encode_record, stored_seqno

VB, OPAQUE = 6, 41

options_st = st.builds(
    ItemOptions, delete_times=st.booleans(), expiry_opcode=st.booleans(), no_value=st.booleans()
)
record_st = st.tuples(
    st.sampled_from([Op.MUTATION, Op.MUTATION, Op.MUTATION, Op.DELETION, Op.EXPIRATION]),
    st.binary(min_size=1, max_size=41),
    st.integers(0, 90),
    st.integers(0, 7),
)
Spec = list[tuple[Op, bytes, int, int]]


def records_of(spec: Spec) -> list[bytes]:
    out = []
    for seqno, (op, key, size, datatype) in enumerate(spec, start=1):
        tombstone = op is not Op.MUTATION
        value = b"x" * (size % 5) if tombstone else b"v" * size  # a tombstone's: xattrs
        flags, delete_time = (0, 1_700_000_000 + seqno) if tombstone else (size, 0)
        out.append(
            encode_record(op, seqno, key, value, cas=seqno * 3, datatype=datatype, flags=flags,
                          delete_time=delete_time)
        )  # fmt: skip
    return out


def model(framer: ItemFramer, records: list[bytes], bytes_max: int) -> tuple[bytes, int, int]:
    frames: list[bytes] = []
    written = 0
    for data in records:  # bounded by the run
        record = decode_record(VB, stored_seqno(data), data)
        frame = b"".join(
            framer.frame(record.op, len(record.key), record.datatype, record.cas, record.body)
        )
        frames.append(frame)
        written += len(frame)
        if written >= bytes_max:
            break
    return b"".join(frames), len(frames), written


@settings(deadline=None, max_examples=150, derandomize=True)
@given(
    spec=st.lists(record_st, min_size=1, max_size=40),
    budgets=st.lists(st.integers(1, 900), min_size=1, max_size=5),
    options=options_st,
    stream_id=st.sampled_from([None, None, 2]),
)
@example(
    spec=[(Op.MUTATION, b"a", 3, 0), (Op.DELETION, b"b", 0, 0), (Op.MUTATION, b"c", 9, 1)],
    budgets=[1 << 20],
    options=ItemOptions(),
    stream_id=None,
)
def test_stored_runs_frame_as_each_record_decoded_and_framed(
    spec: Spec, budgets: list[int], options: ItemOptions, stream_id: int | None
) -> None:
    framer = ItemFramer(VB, OPAQUE, options, stream_id)
    reference = ItemFramer(VB, OPAQUE, options, stream_id)
    records = records_of(spec)
    at = call = 0
    while at < len(records):  # bounded: every call frames at least one record
        budget = budgets[call % len(budgets)]
        got = framer.stored(records[at:], budget)
        assert got == model(reference, records[at:], budget), (at, budget)
        at += got[1]
        call += 1


@pytest.mark.parametrize(
    "options", [ItemOptions(), ItemOptions(delete_times=True, expiry_opcode=True)]
)
def test_only_the_rewritten_records_of_a_run_are_decoded(
    options: ItemOptions, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One tombstone the stream rewrites, among mutations: one record decoded, not the run."""
    spec = [(Op.MUTATION, b"k%d" % n, n, 0) for n in range(20)]
    spec[9] = (Op.EXPIRATION if options.expiry_opcode else Op.DELETION, b"gone", 0, 0)
    records = records_of(spec)
    expected = model(ItemFramer(VB, OPAQUE, options), records, 1 << 30)
    decoded: list[int] = []

    def counting_decode(vb: int, seqno: int, data: bytes) -> object:
        decoded.append(seqno)
        return decode_record(vb, seqno, data)

    monkeypatch.setattr(item_encoding, "decode_record", counting_decode)
    assert ItemFramer(VB, OPAQUE, options).stored(records, 1 << 30) == expected
    assert decoded == [10]
