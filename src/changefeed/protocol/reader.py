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
* after a ``ProtocolError`` it is poisoned: every later call raises the same error.
"""

from __future__ import annotations

from typing import Final, final

from changefeed import limits
from changefeed.protocol.batch import Batch, decode_batch
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, check_header, decode_frame

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

    @property
    def buffered_bytes(self) -> int:
        """Bytes received but not yet returned as frames (never exceeds one frame + a chunk)."""
        return len(self._buffer) - self._start

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

    def next_frame(self) -> Frame | type[NEED_DATA] | type[CLOSED]:
        """Return the next complete frame, ``NEED_DATA`` or ``CLOSED``.

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
            assert isinstance(frame, Frame)
            out.append(frame)

    def read_batch(self, items_max: int = 1 << 20) -> Batch:
        """Decode every complete buffered frame at once: changes as columns, the rest as frames.

        The hot path for consumers (see ``batch.py``). At EOF with a partial frame left, raises
        like ``next_frame``.

        Raises:
            ProtocolError: the peer's bytes break the protocol (then the reader is poisoned).
        """
        self._raise_if_poisoned()
        try:
            batch = decode_batch(
                self._buffer, self._start, frame_size_max=self.frame_size_max, items_max=items_max
            )
            self._start += batch.consumed
            if self._eof and self.buffered_bytes and batch.consumed == 0:
                self._need_more(self.buffered_bytes)
        except ProtocolError as error:
            self._error = error
            raise
        return batch

    def _raise_if_poisoned(self) -> None:
        if self._error is not None:
            raise ProtocolError(f"reader failed earlier: {self._error}", self._error.status)

    def _next_frame(self) -> Frame | type[NEED_DATA] | type[CLOSED]:
        buffer = self._buffer
        start = self._start
        available = len(buffer) - start
        if available < _HEADER_SIZE:
            return self._need_more(available)
        total = _HEADER_SIZE + check_header(buffer, start, self.frame_size_max)
        if available < total:
            return self._need_more(available)
        frame = decode_frame(buffer, start, total)
        self._start = start + total
        return frame

    def _need_more(self, available: int) -> type[NEED_DATA] | type[CLOSED]:
        if not self._eof:
            return NEED_DATA
        if available:
            raise ProtocolError(f"connection closed inside a frame ({available} bytes)")
        return CLOSED
