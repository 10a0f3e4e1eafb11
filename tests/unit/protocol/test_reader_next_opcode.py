"""`FrameReader.next_opcode` lets the connection skip `take_set_run` before a frame that is no
SET. Twin readers fed the same bytes in the same pieces, one trying a run before every frame
(the connection before) and one only when `next_opcode` says SET, must hand out the same runs
and frames in the same order and fail at the same place with the same status."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import encode_frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader

from .test_set_run import other_frames, set_frames

FRAME_MAX = 1024
RUN_MAX = 5

durable_sets = st.builds(
    lambda key, info: encode_frame(
        Magic.ALT_REQUEST, Opcode.SET, key=key, value=b"v", extras=b"\0" * 8, framing_extras=info
    ),
    st.binary(min_size=1, max_size=8),
    st.sampled_from([b"\x11\x01", b"\x13\x02\x00\x10", b"\x11\x07", b""]),
)
oversized = st.builds(
    lambda opcode: encode_frame(Magic.REQUEST, opcode, value=b"x" * (FRAME_MAX + 1)),
    st.sampled_from([Opcode.SET, Opcode.GET]),
)
pieces = st.lists(
    set_frames | other_frames | durable_sets | oversized | st.binary(min_size=1, max_size=30),
    max_size=14,
)


def drain(reader: FrameReader, gated: bool, out: list[object]) -> bool:
    """Take what `reader` holds as the connection does; False once it raised."""
    try:
        while True:
            if not gated or reader.next_opcode() == Opcode.SET:
                run = reader.take_set_run(RUN_MAX)
                if run:
                    columns = (run.vbuckets, run.opaques, run.keys, run.values, run.flags)
                    out.append((columns, run.expiries, run.datatypes, run.framing_extras))
                    continue
            frame = reader.next_frame()
            if frame is NEED_DATA or frame is CLOSED:
                out.append(frame)
                return True
            out.append(frame)
    except ProtocolError as error:
        out.append(("error", error.status))
        return False


@settings(max_examples=600, deadline=None)
@given(pieces, st.lists(st.integers(1, 80), min_size=1, max_size=8), st.booleans(), st.booleans())
def test_the_gate_changes_nothing_but_the_attempts(
    frames: list[bytes], chunks: list[int], skip_oversized: bool, eof: bool
) -> None:
    data = b"".join(frames)
    results: list[list[object]] = []
    for gated in (False, True):
        reader = FrameReader(FRAME_MAX)
        reader.skip_oversized = skip_oversized
        out: list[object] = []
        at, turn, alive = 0, 0, True
        while at < len(data) and alive:
            size = chunks[turn % len(chunks)]
            reader.feed(data[at : at + size])
            at, turn = at + size, turn + 1
            alive = drain(reader, gated, out)
        if alive and eof:
            reader.feed(b"")
            drain(reader, gated, out)
        results.append(out)
    assert results[0] == results[1]


def test_next_opcode_reads_without_taking() -> None:
    reader = FrameReader(FRAME_MAX)
    assert reader.next_opcode() is None
    frame = encode_frame(Magic.REQUEST, Opcode.GET, key=b"k")
    reader.feed(frame[:1])
    assert reader.next_opcode() is None  # the magic alone
    reader.feed(frame[1:])
    assert reader.next_opcode() == Opcode.GET
    assert reader.next_opcode() == Opcode.GET  # nothing was taken
    taken = reader.next_frame()
    assert taken is not NEED_DATA and taken is not CLOSED
    assert reader.next_opcode() is None
