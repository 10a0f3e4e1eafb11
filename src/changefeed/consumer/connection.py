"""One TCP (or TLS) connection to a node: a reader task, request/response matching by opaque.

The connection owns the socket and its receive buffer; it knows nothing about DCP streams.
Bytes read are decoded in batches (``decode_batch``); responses (magic 0x81/0x18) resolve the
future registered for their opaque, everything else (DCP requests a producer pushes) goes to
``on_push`` with the batch, in wire order. Every wait has a deadline, and the only buffer is the
receive buffer (what one read brought plus at most one unfinished frame).

Pipelined store windows (``expect_window``) skip the per-request future: the replies to a
window are decoded straight from the receive buffer into its ``StoreReplies`` (``kv_pipeline``),
and one future per window is resolved when the last reply is in.

TLS (a node's ``--tls-port``): ``Connection.open(..., tls=client_tls_context(ca_file))``. The
node's certificate must chain to the CA and name the host dialled; a certificate that does not
is refused with one ``TlsError`` line saying why (expired, not signed by that CA...).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path

from changefeed import limits
from changefeed.protocol.batch import Batch, decode_batch
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.frame import Frame, decode_frame
from changefeed.protocol.kv_pipeline import OPAQUE_MASK, StoreReplies, complete_frame_size
from changefeed.protocol.opcode import Magic

READ_CHUNK_BYTES = 256 * 1024
CLOSE_FLUSH_S = 2.0  # what close() waits for queued bytes to reach a peer that reads nothing
# Compact the receive buffer once this many consumed bytes sit in front of it (FrameReader's
# rule): parsing stays linear without a memmove per read.
COMPACT_THRESHOLD_BYTES = 64 * 1024
_RESPONSE_MAGICS = frozenset((int(Magic.RESPONSE), int(Magic.ALT_RESPONSE)))
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


class TlsError(ConnectionError):
    """The TLS handshake with a node failed: its certificate is not trusted (the message says
    why), or the port does not speak TLS."""


# OpenSSL's X509_V_ERR codes a user can act on, with what to check.
_VERIFY_HINTS = {
    10: "renew the node's certificate (changefeed certs create)",  # CERT_HAS_EXPIRED
    9: "the node's certificate is not valid yet: check the clocks",  # CERT_NOT_YET_VALID
    18: "the node presents a self-signed certificate, not one the CA signed",
    19: "the CA file does not hold the CA that signed the node's certificate",
    20: "the CA file does not hold the CA that signed the node's certificate",
    62: "the certificate does not name this host (changefeed certs create --hosts)",
}


def client_tls_context(
    ca_file: str | Path | None = None,
    *,
    cert_file: str | Path | None = None,
    key_file: str | Path | None = None,
) -> ssl.SSLContext:
    """A client's TLS settings: TLS 1.2 or newer, the node's certificate checked against the
    CA in ``ca_file`` (PEM; None: the system's CAs) and its names against the host dialled.

    Args:
        cert_file, key_file: a client certificate chain and its key (PEM) to present: a node
            certificate the node's ``--tls-ca`` signed authenticates the connection as that
            node, without SASL (``handshake`` with ``user=None``).

    Raises:
        OSError: a file cannot be read; ssl.SSLError: the CA file holds no certificate, or
            the key does not match the certificate.
    """
    assert (cert_file is None) == (key_file is None), (cert_file, key_file)
    context = ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_file is not None and key_file is not None:
        context.load_cert_chain(cert_file, key_file)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
    return context


def tls_failure(host: str, port: int, error: ssl.SSLError) -> TlsError:
    """One line for a failed handshake: whose certificate, what is wrong, what to do."""
    if isinstance(error, ssl.SSLCertVerificationError):
        hint = _VERIFY_HINTS.get(error.verify_code)
        reason = f"{error.verify_message}{f' ({hint})' if hint else ''}"
        return TlsError(f"TLS: {host}:{port} refused: its certificate is not trusted: {reason}")
    reason = error.reason or str(error)
    if reason == "WRONG_VERSION_NUMBER":
        reason = "the port does not speak TLS (the plain KV port?)"
    return TlsError(f"TLS: handshake with {host}:{port} failed: {reason}")


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
        assert 0 < frame_size_max < 2**32, frame_size_max
        self.frame_size_max = frame_size_max
        self._buffer = bytearray()
        self._start = 0  # offset of the first unconsumed byte of _buffer
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._collecting: dict[
            int, tuple[list[Frame], Callable[[Frame], bool], asyncio.Future[list[Frame]]]
        ] = {}
        self._windows: list[tuple[StoreReplies, asyncio.Future[StoreReplies]]] = []
        self._next_opaque = 1
        self.on_push: PushHandler | None = None
        self.on_close: Callable[[ConnectionClosedError], None] | None = None
        self.closed: ConnectionClosedError | None = None
        self._readable = asyncio.Event()
        self._readable.set()
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
    ) -> Connection:
        """Connect, with a deadline; with ``tls``, over TLS (``client_tls_context``).

        Raises:
            OSError, TimeoutError: the node cannot be reached.
            TlsError: the TLS handshake failed (one line saying why).
        """
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    host,
                    port,
                    limit=READ_CHUNK_BYTES,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                ),
                timeout_s,
            )
        except ssl.SSLError as error:
            raise tls_failure(host, port, error) from None
        except ConnectionResetError:
            if tls is None:
                raise
            raise TlsError(
                f"TLS: handshake with {host}:{port} failed: the node closed the connection "
                "(the port does not speak TLS: the plain KV port?)"
            ) from None
        return cls(reader, writer)

    def next_opaque(self) -> int:
        opaque = self._next_opaque
        self._next_opaque = opaque + 1
        return opaque & OPAQUE_MASK

    def reserve_opaques(self, count: int) -> int:
        """Take ``count`` consecutive opaques (mod 2**32) at once; returns the first."""
        assert count >= 0, count
        first = self._next_opaque
        self._next_opaque = first + count
        return first & OPAQUE_MASK

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

    def expect_window(
        self, first_opaque: int, count: int
    ) -> tuple[StoreReplies, asyncio.Future[StoreReplies]]:
        """Register for the replies to a window of ``count`` pipelined store requests with
        opaques ``first_opaque + index`` (from ``reserve_opaques``), before sending them.

        The replies are decoded into the returned ``StoreReplies``; the future is resolved with
        it once every request is answered, or fails with ``ConnectionClosedError`` if the
        connection goes first (the replies that came are kept). Call ``forget_window`` when
        giving up on a window before it is done.

        Raises:
            ConnectionClosedError: the connection is gone (nothing would ever answer).
        """
        self._check_open()
        replies = StoreReplies(first_opaque, count)
        future: asyncio.Future[StoreReplies] = asyncio.get_running_loop().create_future()
        if count == 0:
            future.set_result(replies)
        else:
            self._windows.append((replies, future))
        return replies, future

    def forget_window(self, replies: StoreReplies) -> None:
        """Stop routing replies to ``replies`` (a window given up on); later ones are unclaimed."""
        self._windows = [entry for entry in self._windows if entry[0] is not replies]

    async def request_many(
        self, data: bytes, opaque: int, last: Callable[[Frame], bool], *, timeout_s: float = 30.0
    ) -> list[Frame]:
        """Send a request answered by several responses (STAT); collect until ``last(frame)``."""
        future: asyncio.Future[list[Frame]] = asyncio.get_running_loop().create_future()
        assert opaque not in self._collecting, opaque
        self._collecting[opaque] = ([], last, future)
        try:
            self.send(data)
            async with asyncio.timeout(timeout_s):  # not wait_for: see request()
                return await future
        finally:
            self._collecting.pop(opaque, None)

    async def request_batch(
        self, data: bytes, opaques: Sequence[int], *, timeout_s: float = 30.0
    ) -> list[Frame]:
        """Send several requests written together (`data`, opaques `opaques`) and wait for
        every response (any status), in `opaques` order: one write and one wait instead of one
        per request.

        Raises:
            TimeoutError: not every response came within ``timeout_s``.
            ConnectionClosedError: the connection is gone.
        """
        futures = [self.expect(opaque) for opaque in opaques]
        try:
            self.send(data)
            async with asyncio.timeout(timeout_s):  # not wait_for: see request()
                return list(await asyncio.gather(*futures))
        finally:
            for opaque, future in zip(opaques, futures, strict=True):
                self._pending.pop(opaque, None)
                if not future.done():
                    future.cancel()  # nobody waits for it any more
                elif not future.cancelled():
                    future.exception()  # retrieved: a closed connection fails them all

    async def request(self, data: bytes, opaque: int, *, timeout_s: float = 30.0) -> Frame:
        """Send a request and wait for its response (any status) with a deadline."""
        future = self.expect(opaque)
        try:
            self.send(data)
            # Not asyncio.wait_for: on 3.11 it returns the result of a future that completed
            # as the caller was cancelled, and the cancel is lost (a loop of requests then
            # never stops; tests/integration/test_request_cancel.py).
            async with asyncio.timeout(timeout_s):
                return await future
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
        try:
            async with asyncio.timeout(CLOSE_FLUSH_S):
                await self._writer.wait_closed()
        except TimeoutError:
            # The peer reads nothing (a node holding back while its replies go unread): what
            # is still queued would never drain, and nobody waits for its answers any more.
            self._writer.transport.abort()
        except OSError:
            pass

    async def _read_loop(self) -> None:
        try:
            while True:  # the connection's event loop: ends on EOF or error
                await self._readable.wait()
                data = await self._reader.read(READ_CHUNK_BYTES)
                if not data:
                    self._fail(ConnectionClosedError(CloseReason.EOF))
                    return
                self._receive(data)
        except ProtocolError as error:
            self._fail(ConnectionClosedError(CloseReason.PROTOCOL_ERROR, str(error)))
            self._writer.close()
        except ssl.SSLError as error:
            # TLS 1.3: the node checks our client certificate after our side of the handshake
            # is done, so its refusal (an alert: unknown ca, certificate revoked...) comes here.
            reason = error.reason or str(error)
            detail = f"TLS: the node refused the connection: {reason.lower().replace('_', ' ')}"
            self._fail(ConnectionClosedError(CloseReason.IO_ERROR, detail))
        except OSError as error:
            self._fail(ConnectionClosedError(CloseReason.IO_ERROR, str(error)))

    def _receive(self, data: bytes) -> None:
        """Decode what has arrived: replies to store windows straight into their windows,
        everything else as a batch (``_dispatch``); keep an unfinished frame for the next read.

        Raises:
            ProtocolError: the peer's bytes break the protocol.
        """
        buffer = self._buffer
        start = self._start
        if start >= COMPACT_THRESHOLD_BYTES and start * 2 >= len(buffer):
            del buffer[:start]
            start = 0
        buffer += data
        try:
            while start < len(buffer):  # bounded: each turn consumes a frame or ends
                if self._windows:
                    start = self._take_window_replies(start)
                    if self._windows:  # what stopped them: an unfinished frame, or another's?
                        size = complete_frame_size(buffer, start, self.frame_size_max)
                        if size == 0:
                            break  # nothing more, or an unfinished frame
                        if buffer[start] in _RESPONSE_MAGICS:
                            # Another request's answer amid a window's: alone, then windows.
                            frame = decode_frame(buffer, start, size)
                            start += size
                            if not self._resolve(frame) and self.on_push is not None:
                                self.on_push(Batch(controls=[(0, frame)]))
                            continue
                    elif start >= len(buffer):
                        break
                batch = decode_batch(buffer, start, frame_size_max=self.frame_size_max)
                start += batch.consumed
                self._dispatch(batch)
                break
        finally:
            if start == len(buffer):
                buffer.clear()
                start = 0
            self._start = start

    def _take_window_replies(self, start: int) -> int:
        """Feed the buffer from ``start`` to the store windows (while any takes a reply);
        resolve the windows completed. Returns where the first reply no window took starts."""
        buffer = self._buffer
        while True:  # bounded: a turn that moves nothing ends it
            moved = False
            for replies, future in self._windows:
                stop = replies.feed(buffer, start, self.frame_size_max)
                if stop != start:
                    moved = True
                    start = stop
                if replies.remaining == 0 and not future.done():
                    future.set_result(replies)
            if any(replies.remaining == 0 for replies, _ in self._windows):
                self._windows = [entry for entry in self._windows if entry[0].remaining]
            if not moved or not self._windows or start >= len(buffer):
                return start

    def _dispatch(self, batch: Batch) -> None:
        """Resolve awaited responses; hand everything else, in order, to ``on_push``."""
        keep = [not self._resolve(frame) for _, frame in batch.controls]
        if not all(keep):
            batch.keep_controls(keep)
        if (batch.controls or len(batch.changes) or len(batch.syncs)) and self.on_push is not None:
            self.on_push(batch)

    def _resolve(self, frame: Frame) -> bool:
        """Hand a response to whoever waits for it: True if someone did."""
        if frame.magic not in _RESPONSE_MAGICS:
            return False
        if self._collect(frame):
            return True
        # Pop: a future left here would grow _pending by one entry per unanswered caller.
        future = self._pending.pop(frame.opaque, None)
        if future is not None and not future.done():
            future.set_result(frame)
            return True
        for replies, window in self._windows:
            if replies.take(frame):
                if replies.remaining == 0:
                    self._windows = [entry for entry in self._windows if entry[0].remaining]
                    if not window.done():
                        window.set_result(replies)
                return True
        return False

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
        waiting: list[
            asyncio.Future[Frame] | asyncio.Future[list[Frame]] | asyncio.Future[StoreReplies]
        ] = list(self._pending.values())
        waiting.extend(many for _, _, many in self._collecting.values())
        waiting.extend(window for _, window in self._windows)
        self._pending.clear()
        self._windows = []
        for future in waiting:
            if not future.done():
                future.set_exception(error)
                future.exception()  # marks it retrieved; an awaiting caller still gets it
