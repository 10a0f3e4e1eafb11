"""``FrameReader``: an incremental, bounded splitter of bytes into frames. No I/O.

Usage::

    reader = FrameReader(frame_size_max=limits.FRAME_SIZE_MAX)
    reader.feed(chunk)                       # stores only; b"" marks EOF
    while (frame := reader.next_frame()) is not NEED_DATA and frame is not CLOSED:
        handle(frame)

Rules it keeps (STYLE.md §1):
* a declared body length is checked against ``frame_size_max`` from the header alone, *before*
  any body byte is awaited, and too large a frame is ``ProtocolError(E2BIG)``;
* it never consumes part of an unfinished frame;
* after a ``ProtocolError`` it is poisoned: every later call raises the same error;
* with ``skip_oversized`` on, a well-formed request header that declares too large a body is
  not an error: it comes out as an ``OversizedFrame`` (so a server can answer E2BIG) and its
  body is discarded as it arrives, never buffered, keeping the stream in sync.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final, final

from changefeed import limits
from changefeed.protocol.batch import Batch, decode_batch
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, check_header, decode_frame
from changefeed.protocol.opcode import Magic
from changefeed.protocol.set_run import SetRun, take_set_run
from changefeed.protocol.status import Status

_HEADER_SIZE: Final = limits.HEADER_SIZE
# Compact the buffer once this many consumed bytes sit in front of it; keeps parsing linear
# without a memmove per frame.
_COMPACT_THRESHOLD_BYTES: Final = 64 * 1024


@final
class _Sentinel(type):
    def __repr__(cls) -> str:
        return cls.__name__


class NEED_DATA(metaclass=_Sentinel):
    """Returned when the buffer holds no complete frame yet."""


class CLOSED(metaclass=_Sentinel):
    """Returned after EOF once every buffered frame has been taken."""


@dataclass(frozen=True, slots=True)
class OversizedFrame:
    """A request whose declared body is over the limit; its body is being discarded.

    Attributes:
        magic, opcode, opaque: from the header, to address the E2BIG reply.
        body_bytes: the declared body length.
    """

    magic: int
    opcode: int
    opaque: int
    body_bytes: int


_OVERSIZED_FIELDS = struct.Struct(">BB6xII")  # magic @0, opcode @1, bodylen @8, opaque @12
assert _OVERSIZED_FIELDS.size == 16
_REQUEST_MAGICS: Final = frozenset({int(Magic.REQUEST), int(Magic.ALT_REQUEST)})


class FrameReader:
    """Split a byte stream into ``Frame`` values, validating headers.

    Args:
        frame_size_max: the largest body length accepted; larger declarations are E2BIG.
    """

    def __init__(self, frame_size_max: int = limits.FRAME_SIZE_MAX) -> None:
        assert 0 < frame_size_max < 2**32, frame_size_max
        self.frame_size_max = frame_size_max
        self._buffer = bytearray()
        self._start = 0  # offset of the first unconsumed byte
        self._eof = False
        self._error: ProtocolError | None = None
        self.skip_oversized = False
        self._skip_bytes = 0  # body bytes of an oversized frame still to discard

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as frames (never exceeds one frame + a chunk)."""
        return len(self._buffer) - self._start

    @property
    def in_frame(self) -> bool:
        """True while part of a frame has arrived and the rest has not (deadlines use it)."""
        return self._skip_bytes > 0 or self.buffered_bytes > 0

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes. Empty ``data`` marks EOF."""
        self._raise_if_poisoned()
        if not data:
            self._eof = True
            return
        if self._eof:
            raise ValueError("feed() after EOF")
        if self._start >= _COMPACT_THRESHOLD_BYTES and self._start * 2 >= len(self._buffer):
            del self._buffer[: self._start]
            self._start = 0
        self._buffer += data

    def next_frame(self) -> Frame | OversizedFrame | type[NEED_DATA] | type[CLOSED]:
        """Return the next complete frame, ``NEED_DATA`` or ``CLOSED`` (or, with
        ``skip_oversized``, an ``OversizedFrame``).

        Raises:
            ProtocolError: the peer's bytes break the protocol (then the reader is poisoned).
        """
        self._raise_if_poisoned()
        try:
            return self._next_frame()
        except ProtocolError as error:
            self._error = error
            raise

    def frames(self) -> list[Frame]:
        """Every complete frame buffered now (possibly none)."""
        out: list[Frame] = []
        while True:  # bounded by the buffered bytes: each frame consumes >= 24
            frame = self.next_frame()
            if frame is NEED_DATA or frame is CLOSED:
                return out
            assert isinstance(frame, Frame), frame  # frames() is for readers without skipping
            out.append(frame)

    def read_batch(self, items_max: int = 1 << 20, *, vectorise: bool | None = None) -> Batch:
        """Decode every complete buffered frame at once: changes as columns, the rest as frames.

        The hot path for consumers (see ``batch.py``). The buffer is read in place: the bytes
        of the changes decoded are copied once, into the columns, and an unfinished frame is
        not copied at all. At EOF with a partial frame left, raises like ``next_frame``.

        Args:
            items_max: at most this many changes.
            vectorise: as ``decode_batch``'s (None: by the number of frames).

        Raises:
            ProtocolError: the peer's bytes break the protocol (then the reader is poisoned).
        """
        self._raise_if_poisoned()
        try:
            batch = decode_batch(
                self._buffer,
                self._start,
                frame_size_max=self.frame_size_max,
                items_max=items_max,
                vectorise=vectorise,
            )
            self._start += batch.consumed
            if self._eof and self.buffered_bytes and batch.consumed == 0:
                self._need_more(self.buffered_bytes)
        except ProtocolError as error:
            self._error = error
            raise
        return batch

    def next_opcode(self) -> int | None:
        """The opcode byte of the next frame, taking nothing; None until it is here (or while
        an oversized frame is skipped). A caller reads it to skip `take_set_run` before a
        frame that is no SET: a failed attempt builds an empty run (~1.4 µs), and a pipeline
        mixing GETs and DELETEs into its SETs made one before most of them."""
        start = self._start
        if self._skip_bytes or len(self._buffer) - start < 2:
            return None
        return self._buffer[start + 1]  # after the magic, in both request magics

    def take_set_run(self, items_max: int) -> SetRun:
        """The plain SETs at the front of the buffer as columns (see ``set_run.py``); empty
        when the next frame is anything else, so ``next_frame`` takes it."""
        self._raise_if_poisoned()
        if self._skip_bytes:
            return SetRun()
        run = take_set_run(self._buffer, self._start, self.frame_size_max, items_max)
        self._start += run.consumed
        return run

    def _raise_if_poisoned(self) -> None:
        if self._error is not None:
            raise ProtocolError(f"reader failed earlier: {self._error}", self._error.status)

    def _next_frame(self) -> Frame | OversizedFrame | type[NEED_DATA] | type[CLOSED]:
        if self._skip_bytes:
            self._discard()
            if self._skip_bytes:
                return self._need_more(0)
        buffer = self._buffer
        start = self._start
        available = len(buffer) - start
        if available < _HEADER_SIZE:
            return self._need_more(available)
        try:
            total = _HEADER_SIZE + check_header(buffer, start, self.frame_size_max)
        except ProtocolError as error:
            if not (self.skip_oversized and error.status == Status.E2BIG):
                raise
            return self._oversized(buffer, start)
        if available < total:
            return self._need_more(available)
        frame = decode_frame(buffer, start, total)
        self._start = start + total
        return frame

    def _oversized(self, buffer: bytearray, start: int) -> OversizedFrame:
        magic, opcode, body_bytes, opaque = _OVERSIZED_FIELDS.unpack_from(buffer, start)
        if magic not in _REQUEST_MAGICS:
            raise ProtocolError(
                f"body of {body_bytes} bytes exceeds {self.frame_size_max}", Status.E2BIG
            )
        self._start = start + _HEADER_SIZE
        self._skip_bytes = body_bytes
        self._discard()
        return OversizedFrame(magic, opcode, opaque, body_bytes)

    def _discard(self) -> None:
        """Drop buffered body bytes of an oversized frame (what has arrived of them)."""
        dropped = min(self._skip_bytes, len(self._buffer) - self._start)
        self._start += dropped
        self._skip_bytes -= dropped
        assert self._skip_bytes >= 0, self._skip_bytes

    def _need_more(self, available: int) -> type[NEED_DATA] | type[CLOSED]:
        if not self._eof:
            return NEED_DATA
        if available:
            raise ProtocolError(f"connection closed inside a frame ({available} bytes)")
        return CLOSED
