"""One TCP connection to a node: a reader task, request/response matching by opaque.

The connection owns the socket and a ``FrameReader``; it knows nothing about DCP streams. Bytes
read are decoded in batches; responses (magic 0x81/0x18) resolve the future registered for
their opaque, everything else (DCP requests a producer pushes) goes to ``on_push`` with the batch,
in wire order. Every wait has a deadline, and the only buffer is the reader's (one frame).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from enum import Enum

from changefeed import limits
from changefeed.protocol.batch import Batch
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic
from changefeed.protocol.reader import FrameReader

READ_CHUNK_BYTES = 256 * 1024
PushHandler = Callable[[Batch], None]


class CloseReason(Enum):
    LOCAL = "closed locally"
    EOF = "peer closed the connection"
    PROTOCOL_ERROR = "peer broke the protocol"
    IO_ERROR = "socket error"


class ConnectionClosedError(ConnectionError):
    """The connection is gone; ``reason`` says why."""

    def __init__(self, reason: CloseReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}{': ' + detail if detail else ''}")
        self.reason = reason


class Connection:
    """A client connection. Use ``await Connection.open(host, port)``."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        frame_size_max: int = limits.FRAME_SIZE_MAX,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._frames = FrameReader(frame_size_max)
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._collecting: dict[
            int, tuple[list[Frame], Callable[[Frame], bool], asyncio.Future[list[Frame]]]
        ] = {}
        self._opaques = itertools.count(1)
        self.on_push: PushHandler | None = None
        self.on_close: Callable[[ConnectionClosedError], None] | None = None
        self.closed: ConnectionClosedError | None = None
        self._readable = asyncio.Event()
        self._readable.set()
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(cls, host: str, port: int, *, timeout_s: float = 10.0) -> Connection:
        """Connect, with a deadline. Raises OSError / TimeoutError."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=READ_CHUNK_BYTES), timeout_s
        )
        return cls(reader, writer)

    def next_opaque(self) -> int:
        return next(self._opaques) & 0xFFFF_FFFF

    def send(self, data: bytes) -> None:
        """Queue bytes for the socket (no response expected).

        Raises:
            ConnectionClosedError: the connection is gone (the same error every time).
        """
        self._check_open()
        self._writer.write(data)

    async def drain(self) -> None:
        """Wait until the socket takes what was queued.

        Raises:
            ConnectionClosedError: the connection is gone (the same error every time).
        """
        self._check_open()
        try:
            await self._writer.drain()
        except OSError as error:  # asyncio says ConnectionResetError("Connection lost")
            self._fail(ConnectionClosedError(CloseReason.IO_ERROR, str(error)))
            self._check_open()

    def _check_open(self) -> None:
        """Raise the one ``ConnectionClosedError`` if the connection is gone or going.

        The transport closes (a reset seen by a write) before the reader task wakes up to the
        loss; writing to it then would only make asyncio log "socket.send() raised exception".
        """
        if self.closed is None and self._writer.transport.is_closing():
            self._fail(ConnectionClosedError(CloseReason.IO_ERROR, "connection lost"))
        if self.closed is not None:
            raise self.closed

    def expect(self, opaque: int) -> asyncio.Future[Frame]:
        """Register interest in the response with ``opaque`` before sending the request.

        Raises:
            ConnectionClosedError: the connection is gone (nothing would ever answer).
        """
        self._check_open()
        assert opaque not in self._pending, opaque
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        self._pending[opaque] = future
        return future

    async def request_many(
        self, data: bytes, opaque: int, last: Callable[[Frame], bool], *, timeout_s: float = 30.0
    ) -> list[Frame]:
        """Send a request answered by several responses (STAT); collect until ``last(frame)``."""
        future: asyncio.Future[list[Frame]] = asyncio.get_running_loop().create_future()
        assert opaque not in self._collecting, opaque
        self._collecting[opaque] = ([], last, future)
        try:
            self.send(data)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._collecting.pop(opaque, None)

    async def request(self, data: bytes, opaque: int, *, timeout_s: float = 30.0) -> Frame:
        """Send a request and wait for its response (any status) with a deadline."""
        future = self.expect(opaque)
        try:
            self.send(data)
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._pending.pop(opaque, None)

    def pause_reading(self) -> None:
        """Stop reading the socket; the peer's flow-control window then fills (backpressure)."""
        self._readable.clear()

    def resume_reading(self) -> None:
        self._readable.set()

    async def close(self) -> None:
        self._fail(ConnectionClosedError(CloseReason.LOCAL))
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def _read_loop(self) -> None:
        try:
            while True:  # the connection's event loop: ends on EOF or error
                await self._readable.wait()
                data = await self._reader.read(READ_CHUNK_BYTES)
                if not data:
                    self._fail(ConnectionClosedError(CloseReason.EOF))
                    return
                self._frames.feed(data)
                self._dispatch(self._frames.read_batch())
        except ProtocolError as error:
            self._fail(ConnectionClosedError(CloseReason.PROTOCOL_ERROR, str(error)))
            self._writer.close()
        except OSError as error:
            self._fail(ConnectionClosedError(CloseReason.IO_ERROR, str(error)))

    def _dispatch(self, batch: Batch) -> None:
        """Resolve awaited responses; hand everything else, in order, to ``on_push``."""
        unclaimed: list[tuple[int, Frame]] = []
        for position, frame in batch.controls:
            if frame.magic in (Magic.RESPONSE, Magic.ALT_RESPONSE):
                if self._collect(frame):
                    continue
                # Pop: upsert_many registers with expect() and never pops itself; leaving the
                # future here would grow _pending by one entry per pipelined request.
                future = self._pending.pop(frame.opaque, None)
                if future is not None and not future.done():
                    future.set_result(frame)
                    continue
            unclaimed.append((position, frame))
        batch.controls = unclaimed
        if (unclaimed or len(batch.changes)) and self.on_push is not None:
            self.on_push(batch)

    def _collect(self, frame: Frame) -> bool:
        entry = self._collecting.get(frame.opaque)
        if entry is None:
            return False
        frames, last, future = entry
        frames.append(frame)
        if last(frame) and not future.done():
            future.set_result(frames)
        return True

    def _fail(self, error: ConnectionClosedError) -> None:
        """Record why the connection is gone and fail every waiting request with it.

        A caller awaiting one of those requests gets the error; the others (the rest of a
        pipelined window, requests abandoned by a close) are marked retrieved, so the loop does
        not report each of them as "Future exception was never retrieved": one loss, one error.
        """
        if self.closed is None:
            self.closed = error
            if error.reason is not CloseReason.LOCAL and self.on_close is not None:
                self.on_close(error)
        error = self.closed
        waiting: list[asyncio.Future[Frame] | asyncio.Future[list[Frame]]] = list(
            self._pending.values()
        )
        waiting.extend(many for _, _, many in self._collecting.values())
        self._pending.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(error)
                future.exception()  # marks it retrieved; an awaiting caller still gets it
