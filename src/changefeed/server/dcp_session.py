"""The DCP side of one server connection: stream requests, the pump task, noops, idle timeout.

Joins the sans-IO ``DcpProducer`` to the socket. The pump task writes frames while the transport
accepts them (``pause_writing`` stops it: backpressure) and the flow-control window has room,
then sleeps until something can change that: an item queued in a streamed vbucket (checkpoint
wakeup), a buffer ack, a new stream, or the noop timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream import ActiveStream
from changefeed.producer.stream_request import Accepted, Refused, RollbackTo, decide_stream_request
from changefeed.protocol.dcp import StreamEndReason, StreamRequest
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status

if TYPE_CHECKING:
    from changefeed.server.connection import ClientConnection

log = logging.getLogger("changefeed.dcp")

PUMP_BYTES_MAX = 1024 * 1024  # written per wake before yielding to the event loop
TICK_S = 0.1  # noop / idle checks (connection_manager_interval)


class DcpSession:
    def __init__(self, conn: ClientConnection, name: str, flags: int) -> None:
        self.conn = conn
        self.name = name
        self.producer = DcpProducer(name, flags)
        self._work = asyncio.Event()
        self._wakeups: dict[int, object] = {}
        self._task = asyncio.get_running_loop().create_task(self._pump_loop())

    def wake(self) -> None:
        self._work.set()

    def on_received(self) -> None:
        self.producer.on_received()

    def on_response(self, frame: Frame) -> None:
        self.producer.on_received()
        if frame.opcode == Opcode.DCP_NOOP:
            self.producer.on_noop_response(frame.opaque)

    def stream_request(
        self, request: StreamRequest
    ) -> int | list[tuple[int, int]] | tuple[Status, str]:
        """Returns a rollback seqno, the failover log (accepted) or ``(status, message)``."""
        bucket = self.conn.node.bucket
        view = bucket.vbucket_view(request.vbucket)
        outcome = decide_stream_request(
            request,
            view,
            stream_exists=self.producer.has_stream(request.vbucket),
            stream_ids_enabled=self.producer.stream_ids_enabled,
        )
        if isinstance(outcome, Refused):
            return outcome.status, outcome.message
        if isinstance(outcome, RollbackTo):
            log.info(
                "%s vb %d: rollback to %d (%s)",
                self.name,
                request.vbucket,
                outcome.seqno,
                outcome.reason,
            )
            return outcome.seqno
        assert isinstance(outcome, Accepted) and view is not None
        self._start_stream(request, outcome, view.purge_seqno)
        return view.failover_log.entries

    def _start_stream(self, request: StreamRequest, accepted: Accepted, purge_seqno: int) -> None:
        bucket = self.conn.node.bucket
        vb = request.vbucket
        reader = bucket.open_reader(
            vb,
            f"dcp:{self.name}:{vb}:{id(self)}",
            accepted.start_seqno,
            droppable=self.producer.cursor_dropping,
            end_seqno=accepted.end_seqno,
        )
        stream = ActiveStream(
            vb,
            request.opaque,
            start_seqno=accepted.start_seqno,
            end_seqno=accepted.end_seqno,
            reader=reader,
            options=self.producer.options,
            stream_id=request.stream_id,
            marker_version=self.producer.marker_version,
            purge_seqno=purge_seqno,
        )
        self.producer.add_stream(stream)
        if vb not in self._wakeups:
            wakeup = bucket.wakeup(vb)
            wakeup.add_callback(self.wake)
            self._wakeups[vb] = wakeup
        self.wake()

    def end_vbucket(self, vb: int, reason: StreamEndReason) -> None:
        """The vbucket changed state (or rolled back): end its stream with ``reason``."""
        self.producer.end_stream(vb, reason)
        self.wake()

    def close(self) -> None:
        self._task.cancel()
        for wakeup in self._wakeups.values():
            with contextlib.suppress(ValueError):
                wakeup.remove_callback(self.wake)  # type: ignore[attr-defined]
        self._wakeups.clear()
        self.producer.close()

    async def _pump_loop(self) -> None:
        try:
            while True:  # the connection's DCP loop; ends with the connection
                await self.conn.writable.wait()
                self._work.clear()
                out: list[bytes] = []
                self.producer.pump(out, PUMP_BYTES_MAX)
                noop = self.producer.due_noop()
                if noop is not None:
                    out.append(noop)
                if out and self.conn.transport is not None:
                    self.conn.transport.writelines(out)
                if self._idle_timed_out():
                    return
                if out and self.producer.ready:
                    await asyncio.sleep(0)  # let reads (acks) in between large writes
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._work.wait(), TICK_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("DCP pump of %s failed; closing the connection", self.name)
            self.conn.close()

    def _idle_timed_out(self) -> bool:
        limit = self.conn.node.config.noop_idle_timeout_s
        if self.producer.noop_enabled and self.producer.idle_for_s() > limit:
            log.warning("%s idle for %.0f s; disconnecting", self.name, limit)
            self.conn.close()
            return True
        return False
