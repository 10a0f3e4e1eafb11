"""One client connection on a node: framing, authentication gate, command dispatch.

An asyncio ``Protocol``: ``data_received`` feeds a ``FrameReader`` and dispatches each frame
through a table of handlers. Unauthenticated connections may only HELLO, list mechanisms and
authenticate (and NOOP). Bad frames get an error status when the connection can still be
trusted to stay in sync (a decodable frame with bad contents), else the connection is closed
(broken framing) — never a crash (invariant 5). After DCP_OPEN the connection also runs a
`DcpPump` that writes stream frames while the transport is not paused (backpressure). Handlers
reach the node's state only through the `ServerContext` the connection was built with; an
operating error is a `StatusError` whose status is the reply (one hierarchy, protocol/errors.py).

On the TLS listener the connection runs its own handshake; with the cluster CA (``--tls-ca``)
a client certificate the CA signed authenticates the connection as the node it names
(``authenticator.node_identity``), without SASL, and a refused one is logged in one line.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from changefeed import limits
from changefeed.producer.producer import DcpProducer
from changefeed.producer.stream_request import Accepted, Refused, RollbackTo
from changefeed.protocol.collections import split_key
from changefeed.protocol.dcp import (
    OpenFlag,
    StreamRole,
    decode_buffer_ack,
    decode_dcp_control,
    decode_dcp_open,
    decode_seqno_acknowledged,
    decode_stream_request,
    encode_failover_log,
    encode_rollback_seqno,
)
from changefeed.protocol.errors import (
    InternalError,
    NotMyVbucketError,
    ProtocolError,
    StatusError,
    TemporaryFailureError,
)
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.kv import (
    GET_RESPONSE_EXTRAS,
    decode_hello,
    decode_key_only,
    decode_observe_seqno_request,
    decode_seqno_persistence,
    decode_store,
    decode_vb_state_filter,
    encode_hello_features,
    encode_mutation_token,
    encode_observe_seqno_result,
    encode_vb_seqnos,
)
from changefeed.protocol.opcode import Datatype, Feature, Magic, Opcode
from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader, OversizedFrame
from changefeed.protocol.set_run import (
    SetRun,
    SetRunAnswers,
    durability_framing,
    pack_set_success,
    pack_set_success_with_token,
    pack_set_successes,
    run_frames,
)
from changefeed.protocol.status import Status
from changefeed.server import (
    collection_commands,
    collection_seqnos,
    durable_run,
    kv_commands,
    subdoc,
)
from changefeed.server.admission import Admission, Member
from changefeed.server.authenticator import SaslAuthenticator, node_identity
from changefeed.server.compactor import answer_compact_db
from changefeed.server.context import ServerContext
from changefeed.server.dcp_pump import DcpPump
from changefeed.server.privileges import Privilege, required_privilege
from changefeed.server.request_window import RequestWindow, window_counters
from changefeed.server.settled_answers import SettledAnswers
from changefeed.server.stats import stat_group
from changefeed.storage.keys import collection_of, stored_key

T = TypeVar("T")
_REQUEST: Final = int(Magic.REQUEST)
_SET: Final = int(Opcode.SET)
_GET: Final = int(Opcode.GET)
# A window's GET of a document whose expiry is this close is applied in order, as a write (it
# may queue the expiration): the window's requests are served within a loop step, far less.
_EXPIRY_HORIZON_S: Final = 2.0
_DELETE: Final = int(Opcode.DELETE)
log = logging.getLogger("changefeed.server")

SUPPORTED_FEATURES = frozenset(
    {
        Feature.TCP_NODELAY,
        Feature.MUTATION_SEQNO,
        Feature.XERROR,
        Feature.SELECT_BUCKET,
        Feature.JSON,
        Feature.ALT_REQUEST_SUPPORT,
        # What the Couchbase SDKs ask for (server/kv_commands.py negotiates the dependencies).
        Feature.DUPLEX,
        Feature.CLUSTERMAP_CHANGE_NOTIFICATION,
        Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF,
        Feature.XATTR,  # xattr paths of sub-document lookups: the virtual $document
        Feature.VATTR,
        Feature.SYNC_REPLICATION,  # durability frames: SyncWrites (server/sync_writes.py)
        Feature.PRESERVE_TTL,
        Feature.SUBDOC_REPLICA_READ,  # lookups on a replica copy (server/subdoc.py)
        Feature.COLLECTIONS,  # keys carry a collection id (server/collection_commands.py)
    }
)
UNAUTHENTICATED_OPCODES = frozenset(
    {Opcode.HELLO, Opcode.SASL_LIST_MECHS, Opcode.SASL_AUTH, Opcode.SASL_STEP, Opcode.NOOP}
)
Handler = Callable[["ClientConnection", Frame], None]
_TLS_HANDSHAKE_RECORD = b"\x16"  # the first byte a TLS client sends (a handshake record)


def _ssl_protocol_class(loop: asyncio.AbstractEventLoop) -> Any:
    """The SSLProtocol of ``loop``'s implementation (``_begin_tls`` says why it is needed)."""
    if type(loop).__module__.startswith("uvloop"):
        from uvloop.loop import SSLProtocol  # type: ignore[attr-defined]

        return SSLProtocol
    from asyncio.sslproto import SSLProtocol as AsyncioSSLProtocol

    return AsyncioSSLProtocol


# What to do about a client certificate the TLS listener refused (OpenSSL X509_V_ERR codes).
_CLIENT_CERT_HINTS = {
    23: " (changefeed certs revoke listed it; issue the node a new one: certs create)",
    10: " (renew the node's certificate: changefeed certs create)",
    20: " (not signed by this node's --tls-ca: a certificate of another cluster?)",
    19: " (not signed by this node's --tls-ca: a certificate of another cluster?)",
    18: " (self-signed, not signed by this node's --tls-ca)",
    12: " (the --tls-crl is out of date: run changefeed certs revoke again)",
}
_REFUSAL_LOG_INTERVAL_S = 10.0  # a connection flood logs one line per interval, not per socket
_last_refusal_log_s = float("-inf")


_last_budget_log_s: dict[str, float] = {}


def _log_refusal(peer: str, connections_max: int) -> None:
    global _last_refusal_log_s
    now = time.monotonic()
    if now - _last_refusal_log_s >= _REFUSAL_LOG_INTERVAL_S:
        _last_refusal_log_s = now
        log.warning(
            "refusing connection from %s: max_connections %d reached", peer, connections_max
        )


def _log_budget(rule: str, message: str, *args: object) -> None:
    """One line per rule and interval: a flood that trips a budget thousands of times a second
    must not flood the log too (admission.py counts every time)."""
    now = time.monotonic()
    if now - _last_budget_log_s.get(rule, float("-inf")) >= _REFUSAL_LOG_INTERVAL_S:
        _last_budget_log_s[rule] = now
        log.warning(message, *args)


class ClientConnection(asyncio.Protocol):
    """One client's connection; also the `FrameSink` its DCP pump writes to.

    Args:
        context: what the node's connections share.
        admission: the node's connection budgets (admission.py); None: only max_connections.
        tls: for a connection of the TLS listener: the TLS settings its handshake runs with.
            The listener accepts plain TCP and the connection runs the handshake itself
            (``loop.start_tls``), so that while it does, the connection is one of those still
            authenticating: counted, bounded and closed oldest first like them (asyncio's own
            TLS server keeps a socket in its handshake out of every count for up to 60 s).
    """

    def __init__(
        self,
        context: ServerContext,
        admission: Admission | None = None,
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.context = context
        self.admission = admission
        self.tls = tls is not None
        self._tls_context = tls
        self._handshake: asyncio.Task[None] | None = None  # the TLS handshake, while it runs
        self._secure: Any = None  # the TLS protocol until this connection serves through it
        self._lost = False  # connection_lost ran (a failed TLS handshake may run it twice)
        self._answers_pending = 0  # requests answered later (durable writes, waits)
        # Until SASL succeeds a peer may only send small frames (limits.py explains why).
        self.reader = FrameReader(limits.UNAUTHENTICATED_FRAME_SIZE_MAX)
        self.transport: asyncio.Transport | None = None
        self.sasl = SaslAuthenticator(
            context.users, secret=context.node_secret, throttle=context.auth_throttle
        )
        # While a SASL exchange hashes off the loop, later frames wait (their order matters).
        self._sasl_task: asyncio.Task[None] | None = None
        self.peer_host = ""
        self.features: set[int] = set()
        self.collections = False  # HELLO Collections: keys carry a collection id
        self._window_counters = window_counters(context.stat_providers)  # STAT kv_window
        self.bucket_selected = False
        self.map_version_seen = (0, 0)  # newest cluster map (epoch, rev) fetched or pushed
        self.dcp: DcpPump | None = None
        self.peer_node: str | None = None  # the node whose certificate authenticated the peer
        self.peer_serial: int | None = None  # that certificate's serial (revocation)
        self.peer = "?"
        self.writable = asyncio.Event()
        self.writable.set()
        now = context.monotonic()
        self.connected_s = now
        self.last_request_s = now
        self.frame_started_s: float | None = None  # when the unfinished request began
        self._paused_for_replies = False  # reading stopped: replies are backed up
        self._paused_for_budget = False  # reading stopped: node-wide partial bytes are full
        self._refused = False
        self._out: list[bytes] | None = None  # replies of the batch being dispatched
        self.permitted: frozenset[int] = UNAUTHENTICATED_OPCODES  # see update_permitted
        self._out_bytes = 0
        self._capturing = False  # replies collect for a later place in order (_captured)
        # A window's replies and GETs not yet sent, and what arrived after them (_emit_held).
        self._held: deque[bytes | Frame | OversizedFrame | RequestWindow | _WindowGet] = deque()
        self.persistence_waits: set[asyncio.Future[None]] = set()  # SEQNO_PERSISTENCE pending
        self.settled_answers = SettledAnswers(self)  # durable writes' outcomes, to send
        self.durable_run_writes = 0  # durable SETs applied as runs (durable_run.py), ever

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport is not an asyncio.Transport subclass; it has the same methods.
        self.transport = transport  # type: ignore[assignment]
        peername = transport.get_extra_info("peername")
        self.peer = str(peername)
        if isinstance(peername, tuple) and peername:
            self.peer_host = str(peername[0])
        connections_max = self.context.config.max_connections
        if len(self.context.connections) >= connections_max:
            self._refused = True
            _log_refusal(self.peer, connections_max)
            transport.close()
            return
        assert self.transport is not None
        self.transport.set_write_buffer_limits(high=limits.WRITE_BUFFER_HIGH_BYTES)
        self.context.connections.add(self)
        if self.admission is not None:
            _close_oldest_unauthenticated(self.admission, self.admission.arrived(self))
        if self._tls_context is not None:
            self._begin_tls(transport, self._tls_context)

    def _begin_tls(self, raw: asyncio.BaseTransport, tls: ssl.SSLContext) -> None:
        """Put a TLS protocol between the accepted socket and this connection, now.

        What ``loop.start_tls`` does, but before ``connection_made`` returns: start_tls runs a
        loop iteration later, and uvloop starts reading the socket as soon as connection_made
        returns (undoing a pause), so the client's first TLS bytes would reach this connection
        instead. The event loop's own SSLProtocol class is used (uvloop's compiled one on uvloop).
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        secure = _ssl_protocol_class(loop)(
            loop,
            self,
            tls,
            waiter,
            server_side=True,
            call_connection_made=False,
            ssl_handshake_timeout=limits.TLS_HANDSHAKE_DEADLINE_S,
        )
        raw.set_protocol(secure)
        self._secure = secure
        secure.connection_made(raw)
        self._handshake = loop.create_task(self._secured(raw, secure, waiter))

    async def _secured(
        self, raw: asyncio.BaseTransport, secure: Any, waiter: asyncio.Future[None]
    ) -> None:
        """Once the handshake is done, serve over the TLS transport; a handshake that fails or
        overstays TLS_HANDSHAKE_DEADLINE_S closes the connection."""
        try:
            await waiter
        except (OSError, TimeoutError) as error:  # ssl.SSLError and ConnectionError are OSErrors
            if isinstance(error, ssl.SSLCertVerificationError):  # its client certificate
                reason = error.verify_message
                _log_budget(
                    f"client certificate: {reason}",
                    "refusing %s: its client certificate is not accepted: %s%s",
                    self.peer,
                    reason,
                    _CLIENT_CERT_HINTS.get(error.verify_code, ""),
                )
            else:
                log.debug("TLS handshake with %s failed: %r", self.peer, error)
            self._handshake = None
            raw.close()
            self.connection_lost(None)
            return
        self._handshake = None
        if self._lost:
            secure._get_app_transport().close()
            return
        self._use_secured()

    def _use_secured(self) -> None:
        """Serve over the TLS transport from now on, as the peer its certificate names if it
        presented one. Once, from whichever runs first: the handshake's task, or the first
        request's bytes (the SSL protocol may hand them over before that task resumes)."""
        secure, self._secure = self._secure, None
        if secure is None:
            return
        secured = secure._get_app_transport()
        self.transport = secured
        secured.set_write_buffer_limits(high=limits.WRITE_BUFFER_HIGH_BYTES)
        self._authenticate_certificate(secured.get_extra_info("peercert"))

    def _authenticate_certificate(self, peercert: Any) -> None:
        """A client certificate the handshake verified against the cluster CA (``--tls-ca``)
        names a node: the connection is authenticated as it, no SASL (Couchbase's client
        certificate auth). Without one (SDK clients) the connection authenticates with SASL."""
        if not peercert:
            return
        subject = dict(pair for rdn in peercert.get("subject", ()) for pair in rdn)
        node = str(subject.get("commonName", ""))
        if not node or not node.isprintable():
            log.warning("closing %s: its client certificate names no node (CN)", self.peer)
            self.close()
            return
        self.peer_node = node
        serial = peercert.get("serialNumber")
        self.peer_serial = int(serial, 16) if isinstance(serial, str) else None
        self.sasl.authenticate_node(node)
        refusal = _after_sasl(self)
        if refusal is not None:
            _log_budget("authenticated", "refusing node %s at %s: %s", node, self.peer, refusal)
            self.close()
            return
        log.info("%s authenticated as node %s by its certificate", self.peer, node)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        if self._handshake is not None:
            self._handshake.cancel()
            self._handshake = None
        if self.admission is not None:
            self.admission.left(self)
        for waiting in list(self.persistence_waits):
            waiting.cancel()  # nobody is left to answer: the node forgets the wait
        self.context.connections.discard(self)
        self.context.map_subscribers.discard(self)
        self.context.partial.release(self)
        if self._sasl_task is not None:
            self._sasl_task.cancel()
            self._sasl_task = None
        if self.dcp is not None:
            self.dcp.close()
            self.context.dcp.unregister(self.dcp)
            self.dcp = None
        self.writable.set()

    def pause_writing(self) -> None:
        """Replies are backed up: stop reading requests until the peer reads (bounded replies)."""
        self.writable.clear()
        self._paused_for_replies = True
        self._update_reading()

    def resume_writing(self) -> None:
        self.writable.set()
        self._paused_for_replies = False
        self._update_reading()
        asyncio.get_running_loop().call_soon(self._process)  # requests held while paused

    def data_received(self, data: bytes) -> None:
        if self._secure is not None:  # TLS application data: the handshake is done
            self._use_secured()
            if self.transport is None or self.transport.is_closing():
                return  # its certificate was refused a slot (_authenticate_certificate)
        if self._refused:
            return
        try:
            self.reader.feed(data)
        except ProtocolError as error:
            if data[:1] == _TLS_HANDSHAKE_RECORD and not self.tls:
                tls_port = getattr(self.context, "tls_port", 0)
                where = f"TLS is on port {tls_port}" if tls_port else "this node serves no TLS"
                log.warning(
                    "closing %s: a TLS handshake on the plain KV port (%s)", self.peer, where
                )
                self.close()
                return
            self._close_for(error)
            return
        self._process()

    def _process(self) -> None:
        """Dispatch every complete request, unless replies are backed up (then later); the
        replies of one received batch are written together."""
        if self._refused:
            return  # refused at authentication: nothing it sent after that is served
        if self.context.fence_check is not None:
            self.context.fence_check()  # after a pause: fenced before anything is served
        if self._out is None:  # else replies deferred by send() are waiting: keep their place
            self._out = []
        dispatched = 0
        reader = self.reader
        next_frame = reader.next_frame
        runs = self._takes_set_runs()
        # Plain SETs, GETs and DELETEs gather in a window (request_window.py); a collections
        # connection's keys are qualified as they join (their collection's stored keys).
        window: RequestWindow | None = None
        window_max = limits.SET_RUN_ITEMS_MAX
        # After a SET with framing extras that no run took (a CAS, PreserveTTL, levels that
        # change from one SET to the next) the next request is most likely another: it goes
        # straight to the per-frame path, which serves a plain SET too (only not batched),
        # instead of an attempt at a run per frame.
        after_framed_set = False
        try:
            if self._held:
                self._emit_held()  # a window's replies that backpressure stopped
            while self.writable.is_set() and self._sasl_task is None and not self._held:
                # SETs next: take them as a run (bounded by the bytes); anything else is a frame
                if runs and not after_framed_set and reader.next_opcode() == _SET:
                    run = reader.take_set_run(window_max - (0 if window is None else len(window)))
                    if run:
                        dispatched += len(run)
                        if run.framing_extras:  # durable SETs: after the window, as a run
                            if window is not None:
                                self._settle(window)
                                window = None
                            self._durable_run(run)
                            continue
                        if self.collections and not self._qualify_run(run):
                            if window is not None:  # the run is served after it, frame by frame
                                self._settle(window)
                                window = None
                            self._serve_frames(run_frames(run))
                            continue
                        if window is None:
                            window = RequestWindow()
                        rest = window.add_run(run)
                        if rest is not None:  # a write to a key the window's GETs read
                            self._settle(window)
                            window = RequestWindow()
                            window.add_run(rest)
                        if len(window) >= window_max:
                            self._settle(window)
                            window = None
                        continue
                frame = next_frame()
                if frame is NEED_DATA or frame is CLOSED:
                    break
                dispatched += 1
                after_framed_set = (
                    type(frame) is Frame
                    and frame.opcode == _SET
                    and frame.magic != _REQUEST
                    and not durability_framing(frame.framing_extras)  # a run may take the next
                )
                key = self._window_key(frame) if runs and isinstance(frame, Frame) else None
                if key is not None:
                    assert isinstance(frame, Frame), frame
                    if window is None:
                        window = RequestWindow()
                    if window.joins(frame, key):
                        window.add_frame(frame, key)
                        if len(window) >= window_max:
                            self._settle(window)
                            window = None
                        continue
                if window is not None:
                    if len(window):
                        self._settle(window)
                    window = None
                if self._held:  # the window's replies backed up: this request waits its turn
                    assert isinstance(frame, (Frame, OversizedFrame)), frame
                    self._held.append(frame)
                    continue
                if isinstance(frame, OversizedFrame):
                    self._reply_oversized(frame)
                    continue
                assert isinstance(frame, Frame), frame
                self._dispatch(frame)
                runs = self._takes_set_runs()  # the frame may have been SELECT_BUCKET, SASL...
            if window is not None:
                self._settle(window)
        except ProtocolError as error:
            if window is not None:
                self._settle(window)  # the requests before the broken frame
            self._flush_replies()
            self._out = None
            self._close_for(error)
            return
        self._flush_replies()
        self._out = None
        if dispatched:
            self.last_request_s = self.context.monotonic()
            if self.admission is not None and self.sasl.user is None:
                self.admission.spoke(self)  # closed for room after silent sockets now
        self._account_partial()

    def _account_partial(self) -> None:
        """Track the unfinished request: its start (deadline) and its bytes (node budget)."""
        if not self.reader.in_frame:
            self.frame_started_s = None
        elif self.frame_started_s is None:
            self.frame_started_s = self.context.monotonic()
        held = self.reader.buffered_bytes
        self._paused_for_budget = self.context.partial.update(self, held, self._budget_resumed)
        self._update_reading()

    def _budget_resumed(self) -> None:
        self._paused_for_budget = False
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._paused_for_replies or self._paused_for_budget or self._sasl_task is not None:
            transport.pause_reading()
        else:
            transport.resume_reading()

    def run_sasl(self, request: Frame, exchange: Coroutine[Any, Any, tuple[Status, bytes]]) -> None:
        """Run a SASL step whose hashing happens off the loop; hold later frames until it
        answers (a client may pipeline a request right behind its SASL_AUTH)."""
        assert self._sasl_task is None, self.peer

        async def answer() -> None:
            try:
                status, value = await exchange
                refusal = _after_sasl(self)
                if refusal is not None:  # the budgets cannot take this identity now
                    self._refuse_after_auth(request, refusal)
                    return
                self.reply(request, status, value=value)
            finally:
                self._sasl_task = None
                self._update_reading()
                asyncio.get_running_loop().call_soon(self._process)

        self._sasl_task = asyncio.get_running_loop().create_task(answer())
        self._update_reading()

    def _refuse_after_auth(self, request: Frame, message: str) -> None:
        """Answer a valid authentication the connection budgets refused (retriable), serve
        nothing more and close."""
        _log_budget("authenticated", "refusing %s: %s", self.peer, message)
        self.permitted = UNAUTHENTICATED_OPCODES
        self._refused = True
        self.reply(request, Status.ETMPFAIL, value=message.encode())
        self.close()

    def idle_evictable(self) -> bool:
        """True if closing this connection loses nothing the node owes it: a KV connection
        with no stream, no request half received and no answer pending (admission.py)."""
        return (
            self.dcp is None
            and self._answers_pending == 0
            and not self.persistence_waits
            and self._sasl_task is None
            and not self.reader.in_frame
        )

    def _reply_oversized(self, frame: OversizedFrame) -> None:
        request = Frame(Magic.REQUEST, frame.opcode, opaque=frame.opaque)
        message = f"body of {frame.body_bytes} bytes exceeds {self.reader.frame_size_max}"
        self.reply(request, Status.E2BIG, value=message.encode())

    def _close_for(self, error: ProtocolError) -> None:
        log.warning("closing %s: %s", self.peer, error)
        self.close()

    def check_deadlines(self, now: float) -> None:
        """Close a connection that did not authenticate in time, sat idle, or left a request
        unfinished for too long (limits.py gives the figures)."""
        reason = None
        if self.sasl.user is None and now - self.connected_s > limits.AUTH_DEADLINE_S:
            reason = f"not authenticated within {limits.AUTH_DEADLINE_S:.0f} s"
        elif (
            self.frame_started_s is not None
            and now - self.frame_started_s > limits.PARTIAL_FRAME_DEADLINE_S
        ):
            reason = f"a request unfinished for {limits.PARTIAL_FRAME_DEADLINE_S:.0f} s"
        elif self.dcp is None and self.sasl.user is not None:
            idle_s = self.context.config.idle_timeout_s
            if idle_s and now - self.last_request_s > idle_s:
                reason = f"idle for {idle_s:.0f} s"
        if reason is not None:
            log.info("closing %s: %s", self.peer, reason)
            self.close()

    def eof_received(self) -> bool | None:
        return None

    # -- dispatch -------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        """Write a reply; while a received batch is dispatched, replies collect and go out in
        one write (one syscall per batch, not per request) — or sooner once they reach
        REPLY_BATCH_BYTES_MAX, so backpressure still sees large replies. A reply sent outside
        a batch (a persistence wait or a durable write answered by a flush round, which ends
        many at once) collects with the others sent in the same loop iteration."""
        out = self._out
        if out is None:
            if self.transport is None or self.transport.is_closing():
                return
            try:
                asyncio.get_running_loop().call_soon(self._flush_deferred)
            except RuntimeError:  # no loop runs (a caller outside the server): write now
                self.transport.write(data)
                return
            self._out = out = []
            self._out_bytes = 0
        out.append(data)
        self._out_bytes += len(data)
        if self._out_bytes >= limits.REPLY_BATCH_BYTES_MAX and not self._capturing:
            self._flush_replies()

    def _flush_deferred(self) -> None:
        """Write the replies `send` collected outside a batch (unless a batch took them)."""
        if self._out is not None:
            self._flush_replies()
            self._out = None

    def _flush_replies(self) -> None:
        out = self._out
        if out:
            self._out = []
            self._out_bytes = 0
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(b"".join(out))

    def write_frames(self, frames: list[bytes]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self._flush_replies()  # replies sent before these frames go before them
            self.transport.writelines(frames)

    def reply(
        self,
        request: Frame,
        status: int = Status.SUCCESS,
        *,
        extras: bytes = b"",
        key: bytes = b"",
        value: bytes = b"",
        cas: int = 0,
        datatype: int = 0,
    ) -> None:
        self.send(
            encode_response(
                request, status, extras=extras, key=key, value=value, cas=cas, datatype=datatype
            )
        )

    def close(self) -> None:
        """Close the connection; it stops counting against max_connections and the budgets at
        once (a burst that closes hundreds of connections per loop iteration must not be
        refused for slots that are already being given back)."""
        if self.transport is not None:
            if not self._capturing:
                self._flush_replies()  # the replies collected so far go before the FIN
            self.transport.close()
        self.context.connections.discard(self)
        if self.admission is not None:
            self.admission.left(self)

    def _dispatch(self, frame: Frame) -> None:
        if not frame.is_request:
            if self.dcp is not None:
                self.dcp.on_response(frame)
            return  # a stray response is ignored, as memcached does
        if self.dcp is not None:
            self.dcp.on_received()
        handler = HANDLERS.get(frame.opcode)
        if handler is None:
            self.reply(frame, Status.UNKNOWN_COMMAND)
            return
        if frame.opcode not in self.permitted:  # one set lookup on the hot path
            self._refuse_unpermitted(frame)
            return
        try:
            if frame.opcode in collection_commands.KEYED_OPCODES:
                if self.collections:
                    context = self.context
                    now = context.bucket.now()
                    frame = collection_commands.qualify(context.manifests, frame, now)
                elif frame.key[:1] == b"\xff":  # never UTF-8: see collection_commands.py
                    frame = collection_commands.escape_default_key(frame)
            handler(self, frame)
        except (ProtocolError, StatusError) as error:
            self._reply_error(frame, error)

    def answer_when_done(
        self, request: Frame, outcome: asyncio.Future[T], answer: Callable[[T], None]
    ) -> None:
        """Answer `request` when `outcome` is done (a durable write answers once its copies
        hold it): `answer(result)`, or its error as `_dispatch` answers one. Nothing is sent
        once the connection is closed. A callback, not a task: one per write is cheaper."""

        self._answers_pending += 1

        def done(future: asyncio.Future[T]) -> None:
            self._answers_pending -= 1
            assert self._answers_pending >= 0, self._answers_pending
            if self.transport is None or self.transport.is_closing() or future.cancelled():
                return
            error = future.exception()
            if error is None:
                answer(future.result())
            elif isinstance(error, (ProtocolError, StatusError)):
                self._reply_error(request, error)
            else:
                log.error("answering %s: %r", self.peer, error)
                self._reply_error(request, InternalError(str(error)))

        outcome.add_done_callback(done)

    def _reply_error(self, frame: Frame, error: ProtocolError | StatusError) -> None:
        self.send(self._error_response(frame, error))

    def _error_response(self, frame: Frame, error: ProtocolError | StatusError) -> bytes:
        """The response that answers `frame` with `error`."""
        if isinstance(error, ProtocolError):
            return encode_response(frame, error.status, value=str(error).encode())
        if isinstance(error, NotMyVbucketError):
            # Couchbase answers with the current map, so a client can re-route at once.
            body = self.context.cluster_config_json()
            return encode_response(frame, Status.NOT_MY_VBUCKET, value=body, datatype=Datatype.JSON)
        status = kv_commands.wire_status(self, error.code)
        return encode_response(frame, status, value=str(error).encode())

    def _takes_set_runs(self) -> bool:
        """Plain SETs may be taken as runs (`set_run.py`): a KV connection, a bucket selected
        and SET permitted. Anything else about a SET (CAS, framing extras) ends a run."""
        return self.dcp is None and self.bucket_selected and Opcode.SET in self.permitted

    def _qualify_run(self, run: SetRun) -> bool:
        """A collections connection's run of SETs under its stored keys and maxTTLs, in place;
        False (the run untouched) if a key is malformed or in an unknown collection."""
        context = self.context
        return collection_commands.qualify_set_run(run, context.manifests, context.bucket.now())

    def _window_key(self, frame: Frame) -> bytes | None:
        """The key as stored of a GET or DELETE that may join a window, None if it is served
        alone: a collections connection's key qualified (a malformed id or an unknown
        collection is answered by the per-frame path), another's 0xff key escaped there
        (collection_commands.py)."""
        if frame.opcode != _GET and frame.opcode != _DELETE:
            return None
        if not self.collections:
            return None if frame.key[:1] == b"\xff" else frame.key
        try:  # GET and DELETE have no expiry: only the key changes (as `qualify` does it)
            cid, key = split_key(frame.key)
        except ProtocolError:
            return None
        if cid not in self.context.manifests.collection_ids():
            return None
        return stored_key(cid, key)

    def _serve_frames(self, frames: list[Frame]) -> None:
        """Dispatch `frames` in order, behind held replies if there are any."""
        for frame in frames:
            if self._held:
                self._held.append(frame)
            else:
                self._dispatch(frame)

    def _durable_run(self, run: SetRun) -> None:
        """Apply a run of durable SETs (durable_run.py) behind held replies, if any (then one
        frame at a time, in their turn); a collections connection's keys are qualified first,
        and a run with a key that cannot be is served frame by frame (each its own answer)."""
        if self._held or (self.collections and not self._qualify_run(run)):
            self._serve_frames(run_frames(run))
            return
        self.durable_run_writes += len(run)
        durable_run.store_durable_run(self, run)

    @property
    def closing(self) -> bool:
        """No reply can be sent any more (a durable run's answers check it)."""
        return self.transport is None or self.transport.is_closing()

    def reply_error(self, request: Frame, error: ProtocolError | StatusError) -> None:
        """Answer `request` with `error`, as `_dispatch` answers a handler's."""
        self._reply_error(request, error)

    def answers_expected(self, count: int) -> None:
        """`count` requests are answered later (a durable run's): not idle until then."""
        assert count > 0, count
        self._answers_pending += count

    def answered(self, count: int) -> None:
        """`count` requests counted by `answers_expected` were answered (replies written)."""
        self._answers_pending -= count
        assert self._answers_pending >= 0, self._answers_pending

    def _store_run(self, run: SetRun) -> None:
        """Apply a run of plain SETs (a collections connection's qualified, `_qualify_run`) and
        queue their replies in order: successes packed together (column by column when the
        whole run succeeded), a refused write answered as `_dispatch` would answer it."""
        answers = self.context.bucket.set_run(run)
        token = Feature.MUTATION_SEQNO in self.features
        if not answers.errors:
            if token:
                self.send(pack_set_successes(run.opaques, answers.cases, answers.vb_uuids,
                                             answers.seqnos))  # fmt: skip
            else:
                self.send(pack_set_successes(run.opaques, answers.cases))
            return
        errors = answers.errors
        out: list[bytes] = []
        for index, opaque in enumerate(run.opaques):
            error = errors.get(index)
            if error is None:
                cas = answers.cases[index]
                if token:
                    uuid, seqno = answers.vb_uuids[index], answers.seqnos[index]
                    out.append(pack_set_success_with_token(opaque, cas, uuid, seqno))
                else:
                    out.append(pack_set_success(opaque, cas))
                continue
            if out:
                self.send(b"".join(out))
                out = []
            vb = run.vbuckets[index]
            self._reply_error(Frame(Magic.REQUEST, Opcode.SET, vbucket=vb, opaque=opaque), error)
        if out:
            self.send(b"".join(out))

    def _run_window(self, window: RequestWindow) -> None:
        """Apply a window of plain SETs, GETs and DELETEs in its layers (request_window.py) and
        answer every request in order: SETs packed as `_store_run` packs them, each DELETE's
        reply as it was made, each GET after every write of the window, in its place.

        (Applying each vbucket's SETs and DELETEs in one pass instead, a `set_many` taking
        DELETEs, was built and measured in round 7: 10-20 % more node CPU on the raw mix, as
        its windows touch most vbuckets with a few writes each and the per-vbucket costs
        stay; removed, docs/benchmarks.md.)"""
        self._window_counters.count(window)
        if window.manifest_uid not in (None, self.context.manifests.uid) and window.only_sets:
            gone = self._dropped_since(window)
            if gone:
                self._emit_held(self._hold_replies(window, self._answer_kept(window, gone), {}))
                self._emit_held()
                return
        if window.only_sets:
            self._store_run(window.run)
            return
        # The GETs' and DELETEs' keys memory has none of, read from the store in one pass for
        # the window's writes and its replies below (same loop step: `stored_read_ahead`).
        # Only the window's own replies and GETs run under it; what arrived after it (a state
        # change, a flush) goes after, as it always read the store itself.
        bucket = self.context.bucket
        with bucket.stored_read_ahead(window.frame_keys, _EXPIRY_HORIZON_S) as expiring:
            self._emit_held(self._apply_layers(window, self._expiring_gets(window, expiring)))
        self._emit_held()

    def _dropped_since(self, window: RequestWindow) -> list[int]:
        """The SETs of a held `window` (indexes into its run) whose collection was dropped
        after their keys were qualified. (A window with GETs or DELETEs is applied in the loop
        step that forms it; only a SET-only window waits behind held replies.)"""
        ids = self.context.manifests.collection_ids()
        return [i for i, key in enumerate(window.run.keys) if collection_of(key) not in ids]

    def _answer_kept(self, window: RequestWindow, gone: list[int]) -> SetRunAnswers:
        """Apply the SETs of `window` not in `gone`; those in `gone` are refused as the
        per-frame handler refuses a SET of an unknown collection."""
        run, count = window.run, len(window.run)
        answers = SetRunAnswers([0] * count, [0] * count, [0] * count, {})
        refused = collection_commands.UnknownCollectionAnswer(self.context.manifests.uid)
        answers.errors.update(dict.fromkeys(gone, refused))
        kept = sorted(set(range(count)).difference(gone))
        if kept:
            got = self.context.bucket.set_run(run.select(kept))
            for at, index in enumerate(kept):
                answers.cases[index] = got.cases[at]
                answers.seqnos[index] = got.seqnos[at]
                answers.vb_uuids[index] = got.vb_uuids[at]
            for at, error in got.errors.items():
                answers.errors[kept[at]] = error
        return answers

    def _apply_layers(self, window: RequestWindow, barriers: set[int]) -> int:
        """`_run_window` in layers: apply the writes and put the replies and GETs first in
        `_held`; return how many items that put there."""
        run, frames = window.run, window.frames
        count = len(run)
        cases, seqnos, vb_uuids = [0] * count, [0] * count, [0] * count
        errors: dict[int, StatusError] = {}
        deleted: dict[int, bytes] = {}
        bucket = self.context.bucket
        direct = Opcode.DELETE in self.permitted  # else `_dispatch` refuses each
        # Memory may run short: then one write at a time in request order, as alone.
        keys = [*run.keys, *map(window.frame_key, range(len(frames)))]
        in_order = bucket.might_pass_upper_mark(keys, run.values)
        for layer in window.layers(barriers, in_order=in_order):
            if layer.sets:
                part = run if len(layer.sets) == count else run.select(layer.sets)
                answers = bucket.set_run(part)
                for at, index in enumerate(layer.sets):
                    cases[index] = answers.cases[at]
                    seqnos[index] = answers.seqnos[at]
                    vb_uuids[index] = answers.vb_uuids[at]
                for at, refused in answers.errors.items():
                    errors[layer.sets[at]] = refused
            for index in layer.deletes:
                frame = frames[index]
                key = window.frame_key(index)
                if direct and frame.opcode == _DELETE and _plain_key_only(frame, key):
                    deleted[index] = self._delete_response(frame, key)
                else:  # a GET applied as a write, or a DELETE the handler refuses
                    deleted[index] = self._captured(self._dispatch, frame)
        return self._hold_replies(window, SetRunAnswers(cases, seqnos, vb_uuids, errors), deleted)

    def _delete_response(self, frame: Frame, key: bytes) -> bytes:
        """A window's plain DELETE (`_plain_key_only`, `key` as stored) applied and answered
        as the per-frame handler would (`_delete`: a write answered with its mutation),
        without the dispatch and capture around it."""
        try:
            result = self.context.bucket.delete(frame.vbucket, key, cas=frame.cas)
        except StatusError as error:
            return self._error_response(frame, error)
        extras = b""
        if Feature.MUTATION_SEQNO in self.features:  # as `kv_commands.reply_mutation`
            extras = encode_mutation_token(result.vb_uuid, result.seqno)
        return encode_response(frame, extras=extras, cas=result.cas)

    def _hold_replies(
        self, window: RequestWindow, answers: SetRunAnswers, deleted: dict[int, bytes]
    ) -> int:
        """Put the window's replies (`answers` of its SETs by index in its run, `deleted`
        of its DELETEs and of the GETs applied as writes, by frame) and its other GETs, in
        request order, first in `_held`; return how many items that put there."""
        run, frames = window.run, window.frames
        cases, seqnos, vb_uuids, errors = (
            answers.cases, answers.seqnos, answers.vb_uuids, answers.errors
        )  # fmt: skip
        manifest_uid = self.context.manifests.uid  # the GETs' keys were qualified under it
        token = Feature.MUTATION_SEQNO in self.features
        held: list[bytes | _WindowGet] = []
        packed: list[int] = []  # successes not yet packed, in order

        def pack() -> None:
            if not packed:
                return
            opaques = [run.opaques[i] for i in packed]
            run_cases = [cases[i] for i in packed]
            if token:
                uuids, numbers = [vb_uuids[i] for i in packed], [seqnos[i] for i in packed]
                held.append(pack_set_successes(opaques, run_cases, uuids, numbers))
            else:
                held.append(pack_set_successes(opaques, run_cases))
            packed.clear()

        for op in window.order:
            if op >= 0:
                error = errors.get(op)
                if error is None:
                    packed.append(op)
                    continue
                pack()
                request = Frame(Magic.REQUEST, Opcode.SET, vbucket=run.vbuckets[op],
                                opaque=run.opaques[op])  # fmt: skip
                held.append(self._error_response(request, error))
                continue
            pack()
            if ~op in deleted:
                held.append(deleted[~op])
            else:  # a GET: answered in its turn
                held.append(_WindowGet(frames[~op], window.frame_key(~op), manifest_uid))
        pack()
        self._held.extendleft(reversed(held))  # before what arrived after the window
        return len(held)

    def _expiring_gets(self, window: RequestWindow, expiring: set[tuple[int, bytes]]) -> set[int]:
        """The window's GETs (frame indexes) that may find their document expired and queue
        its expiration: its version before the window expires within `_EXPIRY_HORIZON_S`
        (`expiring`, from `stored_read_ahead`), or a SET of the window with an expiry wrote
        it. They are applied in order, as writes (`RequestWindow.layers`)."""
        run = window.run
        timed = set(expiring)
        if any(run.expiries):
            columns = zip(run.vbuckets, run.keys, run.expiries, strict=True)
            timed.update((vb, key) for vb, key, expiry in columns if expiry)
        if not timed:
            return set()
        return {
            index
            for index, frame in enumerate(window.frames)
            if frame.opcode == _GET and (frame.vbucket, window.frame_key(index)) in timed
        }

    def _settle(self, window: RequestWindow) -> None:
        """Apply `window` now, or after the held replies before it (its GETs must not see a
        later window's writes)."""
        if self._held:
            if self.collections:
                window.manifest_uid = self.context.manifests.uid
            self._held.append(window)
        else:
            self._run_window(window)

    def _emit_held(self, items: int | None = None) -> None:
        """Send a window's replies in order and answer its GETs in their turn, then what
        arrived after them, until replies back up (`resume_writing` processes the rest
        before any later request); with `items`, at most that many first held items."""
        held = self._held
        while held and self.writable.is_set():
            if items is not None:
                if not items:
                    return
                items -= 1
            item = held.popleft()
            if isinstance(item, bytes):
                self.send(item)
            elif isinstance(item, RequestWindow):
                self._run_window(item)  # its replies go first, then what followed it
            elif isinstance(item, OversizedFrame):
                self._reply_oversized(item)
            elif isinstance(item, _WindowGet):
                self._answer_get(item)
            else:
                self._dispatch(item)

    def _answer_get(self, get: _WindowGet) -> None:
        """A window's GET (its key as stored) answered as the per-frame handler (`_get`)
        would, without the dispatch around it; one the handler refuses goes through it, and
        so does one whose key was qualified under another collections manifest (held while
        replies backed up, its collection may have been dropped meanwhile)."""
        frame, key = get.frame, get.key
        if (
            Opcode.GET not in self.permitted
            or not _plain_key_only(frame, key)
            or get.manifest_uid != self.context.manifests.uid
        ):
            self._dispatch(frame)
            return
        try:
            document = self.context.bucket.get(frame.vbucket, key)
        except StatusError as error:
            self.send(self._error_response(frame, error))
            return
        self.send(
            encode_response(
                frame,
                extras=GET_RESPONSE_EXTRAS.pack(document.flags),
                value=document.value,
                cas=document.cas,
                datatype=document.datatype,
            )
        )

    def _captured(self, answer: Callable[..., None], *args: Any) -> bytes:
        """The replies `answer(*args)` sends, collected to be sent later in their place."""
        out, out_bytes = self._out, self._out_bytes
        self._out, self._capturing = [], True
        try:
            answer(*args)
            return b"".join(self._out)
        finally:
            self._out, self._out_bytes, self._capturing = out, out_bytes, False

    def _refuse_unpermitted(self, frame: Frame) -> None:
        if self.sasl.user is None:
            self.reply(frame, Status.EACCESS, value=b"authenticate first")
            return
        needed = required_privilege(frame.opcode)
        assert needed is not None, frame.opcode  # else it would be permitted
        message = f"user {self.sasl.user!r} lacks the {needed.name.lower()} privilege"
        self.reply(frame, Status.EACCESS, value=message.encode())

    def update_permitted(self) -> None:
        """Recompute which opcodes this connection's identity may send (after each SASL step):
        the unauthenticated ones, or those whose privilege the user holds."""
        if self.sasl.user is None:
            self.permitted = UNAUTHENTICATED_OPCODES
            return
        privileges = self.sasl.privileges
        self.permitted = frozenset(
            opcode
            for opcode in HANDLERS
            if (needed := required_privilege(opcode)) is None or needed in privileges
        )

    def push_cluster_map(self, version: tuple[int, int], config: bytes) -> bool:
        """A `MapSubscriber`: send the map unless this connection has seen this version."""
        return kv_commands.push_cluster_map(self, version, config)

    def require_bucket(self) -> None:
        if not self.bucket_selected:
            raise StatusError("no bucket selected", status=Status.NO_BUCKET)


# -- KV handlers -------------------------------------------------------------------------------


def _hello(c: ClientConnection, f: Frame) -> None:
    requested = decode_hello(f).features
    enabled = kv_commands.negotiate(requested, SUPPORTED_FEATURES)
    c.features = set(enabled)
    c.collections = Feature.COLLECTIONS in c.features
    if c.features & kv_commands.MAP_NOTIFICATIONS:
        c.context.map_subscribers.add(c)
    else:
        c.context.map_subscribers.discard(c)
    c.reply(f, value=encode_hello_features(enabled))


def _noop(c: ClientConnection, f: Frame) -> None:
    c.reply(f)


def _list_mechs(c: ClientConnection, f: Frame) -> None:
    c.reply(f, value=c.sasl.mechanisms())


def _sasl_auth(c: ClientConnection, f: Frame) -> None:
    mechanism = f.key.decode(errors="replace")
    c.run_sasl(f, c.sasl.sasl_auth(mechanism, f.value, c.peer_host))


def _sasl_step(c: ClientConnection, f: Frame) -> None:
    mechanism = f.key.decode(errors="replace")
    c.run_sasl(f, c.sasl.sasl_step(mechanism, f.value, c.peer_host))


def _after_sasl(c: ClientConnection) -> str | None:
    """An authenticated peer may send full-size frames (values up to VALUE_SIZE_MAX), and a
    larger one is answered E2BIG and skipped instead of closing the connection. A failed
    re-authentication drops the identity and with it what the identity allowed.

    Returns:
        why the connection budgets refuse the new identity (admission.py), or None.
    """
    user = c.sasl.user
    if c.admission is not None and user is not None:
        admin = Privilege.ADMIN in c.sasl.privileges
        refusal, idle = c.admission.authenticated_as(c, user, admin=admin)
        for victim in idle:
            _log_budget(
                "idle",
                "closing an idle authenticated connection for %s (user %r): %d closed so far",
                c.peer,
                user,
                c.admission.closed_idle,
            )
            victim.close()
        if refusal is not None:
            return refusal.message
    elif c.admission is not None:
        _close_oldest_unauthenticated(c.admission, c.admission.unauthenticated_again(c))
    c.update_permitted()
    if user is not None:
        c.reader.frame_size_max = limits.FRAME_SIZE_MAX
        c.reader.skip_oversized = True
        return None
    c.reader.frame_size_max = limits.UNAUTHENTICATED_FRAME_SIZE_MAX
    c.reader.skip_oversized = False
    if c.dcp is not None:  # a stream must not outlive the identity that opened it
        c.close()
    return None


def _close_oldest_unauthenticated(admission: Admission, oldest: Member | None) -> None:
    """Close the connection the unauthenticated budget pushed out, if any (logged)."""
    if oldest is not None:
        _log_budget(
            "unauthenticated",
            "closing the oldest unauthenticated connection: %d are authenticating "
            "(max_unauthenticated_connections); %d closed so far",
            admission.shares.unauthenticated_max,
            admission.closed_unauthenticated,
        )
        oldest.close()


def _select_bucket(c: ClientConnection, f: Frame) -> None:
    if f.key.decode(errors="replace") != c.context.bucket.name:
        # As Couchbase: no access to a bucket that does not exist (the SDKs raise
        # BucketNotFound; KEY_ENOENT would mean "not ready yet, retry").
        c.reply(f, Status.EACCESS, value=b"no such bucket")
        return
    c.bucket_selected = True
    c.reply(f)


def _store(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    command = decode_store(f)
    if kv_commands.preserve_ttl_of(f.framing_extras):
        command = kv_commands.keep_expiry(c, command)
    kv_commands.write_then_reply(
        c, f, command.key, lambda level: c.context.bucket.store_command(command, level=level)
    )


def _delete(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    key = decode_key_only(f)
    kv_commands.write_then_reply(
        c, f, key, lambda level: c.context.bucket.delete(f.vbucket, key, cas=f.cas, level=level)
    )


def _get(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    key = decode_key_only(f)
    item = c.context.bucket.get(f.vbucket, key)
    c.reply(
        f,
        extras=GET_RESPONSE_EXTRAS.pack(item.flags),
        value=item.value,
        cas=item.cas,
        datatype=item.datatype,
    )


def _stat(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    for name, value in stat_group(c.context, f.key.decode(errors="replace")):
        c.reply(f, key=name.encode(), value=value.encode())
    c.reply(f)  # an empty key and value end the stat list


def _all_vb_seqnos(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    if len(f.extras) == 8:  # a state filter and a collection id
        collection_seqnos.all_vb_seqnos_of_collection(c, f)
        return
    state = decode_vb_state_filter(f)
    c.reply(f, value=encode_vb_seqnos(c.context.bucket.vb_seqnos(state)))


def _observe_seqno(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    uuid = decode_observe_seqno_request(f)
    c.reply(f, value=encode_observe_seqno_result(c.context.bucket.observe_seqno(f.vbucket, uuid)))


def _seqno_persistence(c: ClientConnection, f: Frame) -> None:
    """SEQNO_PERSISTENCE: answered when the vbucket has persisted the seqno (or TMPFAIL); the
    connection's waits end when it closes."""
    c.require_bucket()
    seqno = decode_seqno_persistence(f)
    pending = c.persistence_waits
    if len(pending) >= limits.PERSISTENCE_WAITS_PER_CONNECTION_MAX:
        raise TemporaryFailureError(
            f"{len(pending)} persistence waits pending on this connection (at most "
            f"{limits.PERSISTENCE_WAITS_PER_CONNECTION_MAX}): retry"
        )
    waiting = c.context.bucket.persistence_waits.wait(f.vbucket, seqno)
    if not waiting.done():
        pending.add(waiting)
        waiting.add_done_callback(pending.discard)
    c.answer_when_done(f, waiting, lambda _: c.reply(f))


def _failover_log(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    if f.opcode == Opcode.DCP_GET_FAILOVER_LOG and c.dcp is None:
        c.reply(f, Status.EINVAL, value=b"not a DCP connection")
        return
    c.reply(f, value=encode_failover_log(c.context.bucket.failover_log(f.vbucket)))


def _compact_db(c: ClientConnection, f: Frame) -> None:
    """COMPACT_DB: answered when the vbucket's compaction is done (compactor.py)."""
    c.require_bucket()

    def reply(status: int, value: bytes, datatype: int) -> None:
        c.reply(f, status, value=value, datatype=datatype)

    answer_compact_db(c.context.compactor, f, reply)


def _cluster_config(c: ClientConnection, f: Frame) -> None:
    c.map_version_seen = max(c.map_version_seen, c.context.cluster_map_version())
    c.reply(f, value=c.context.cluster_config_json(), datatype=Datatype.JSON)


# -- DCP handlers ------------------------------------------------------------------------------


def _dcp_open(c: ClientConnection, f: Frame) -> None:
    c.require_bucket()
    if c.dcp is not None:
        c.reply(f, Status.EINVAL, value=b"DCP_OPEN already sent on this connection")
        return
    message = decode_dcp_open(f)
    if not message.flags & OpenFlag.PRODUCER:
        c.reply(f, Status.NOT_SUPPORTED, value=b"consumer connections are not supported")
        return
    certified = c.peer_node is not None and c.sasl.user == node_identity(c.peer_node)
    if certified and message.role is StreamRole.REPLICA and message.consumer_name != c.peer_node:
        # A node's certificate replicates (and acknowledges seqnos) for that node only.
        text = f"node {c.peer_node}'s certificate cannot replicate for {message.consumer_name}"
        c.reply(f, Status.EACCESS, value=text.encode())
        return
    context = c.context
    producer = DcpProducer(
        message.name,
        message.flags,
        source=context.bucket,
        role=message.role,
        consumer_name=message.consumer_name,
        clock=context.monotonic,
        backfill_slots=context.backfill_slots,
        collections=c.collections,
        manifest=context.manifests,
    )
    replica = None  # the node whose replica vbuckets this feeds, and who tracks it
    if message.role is StreamRole.REPLICA and message.consumer_name and context.replication:
        replica = (message.consumer_name, context.replication)
    c.dcp = DcpPump(
        producer,
        sink=c,
        wakeup_of=context.bucket.wakeup,
        idle_timeout_s=context.config.noop_idle_timeout_s,
        disk_rate=context.catchup_rate if message.role is StreamRole.REPLICA else None,
        replica=replica,
    )
    context.dcp.register(c.dcp)
    c.reply(f)


def _dcp_only(f: Frame, c: ClientConnection) -> DcpPump:
    if c.dcp is None:
        raise ProtocolError(f"{Opcode(f.opcode).name} on a non-DCP connection", Status.EINVAL)
    return c.dcp


def _dcp_control(c: ClientConnection, f: Frame) -> None:
    dcp = _dcp_only(f, c)
    message = decode_dcp_control(f)
    status, text = dcp.producer.control(message.key, message.value)
    c.reply(f, status, value=text.encode())


def _dcp_stream_req(c: ClientConnection, f: Frame) -> None:
    dcp = _dcp_only(f, c)
    match dcp.stream_request(decode_stream_request(f)):
        case Accepted(failover_log=entries):
            c.reply(f, value=encode_failover_log(list(entries)))
        case RollbackTo(seqno=seqno):
            c.reply(f, Status.ROLLBACK, value=encode_rollback_seqno(seqno))
        case Refused(status=Status.NOT_MY_VBUCKET):
            # As for KV commands: the current map, so the consumer re-routes at once.
            value = c.context.cluster_config_json()
            c.reply(f, Status.NOT_MY_VBUCKET, value=value, datatype=Datatype.JSON)
        case Refused(status=status, message=message):
            c.reply(f, status, value=message.encode())


def _dcp_close_stream(c: ClientConnection, f: Frame) -> None:
    dcp = _dcp_only(f, c)
    c.reply(f, dcp.producer.close_stream(f.vbucket))
    dcp.wake()


def _dcp_buffer_ack(c: ClientConnection, f: Frame) -> None:
    dcp = _dcp_only(f, c)
    dcp.producer.on_buffer_ack(decode_buffer_ack(f))
    dcp.wake()  # no response on success (dcp-wire.md §7.10)


def _dcp_noop_request(c: ClientConnection, f: Frame) -> None:
    c.reply(f)


def _dcp_seqno_acknowledged(c: ClientConnection, f: Frame) -> None:
    """A replica's progress (no response on success, dcp-wire.md §2.1)."""
    dcp = _dcp_only(f, c)
    ack = decode_seqno_acknowledged(f)
    persisted = ack.persisted if ack.persisted is not None else 0
    if not dcp.acknowledged(f.vbucket, ack.received, persisted):
        c.reply(f, Status.EINVAL, value=b"DCP_SEQNO_ACKNOWLEDGED needs a replica connection")


def _get_replica(c: ClientConnection, f: Frame) -> None:
    """GET_REPLICA: a read of this node's replica copy; NOT_MY_VBUCKET unless it holds one."""
    c.require_bucket()
    key = decode_key_only(f)
    item = c.context.bucket.get_replica(f.vbucket, key)
    c.reply(
        f,
        extras=GET_RESPONSE_EXTRAS.pack(item.flags),
        value=item.value,
        cas=item.cas,
        datatype=item.datatype,
    )


HANDLERS: dict[int, Handler] = {
    Opcode.HELLO: _hello,
    Opcode.NOOP: _noop,
    Opcode.SASL_LIST_MECHS: _list_mechs,
    Opcode.SASL_AUTH: _sasl_auth,
    Opcode.SASL_STEP: _sasl_step,
    Opcode.SELECT_BUCKET: _select_bucket,
    Opcode.SET: _store,
    Opcode.ADD: _store,
    Opcode.REPLACE: _store,
    Opcode.DELETE: _delete,
    Opcode.GET: _get,
    Opcode.STAT: _stat,
    Opcode.GET_ALL_VB_SEQNOS: _all_vb_seqnos,
    Opcode.OBSERVE_SEQNO: _observe_seqno,
    Opcode.SEQNO_PERSISTENCE: _seqno_persistence,
    Opcode.GET_FAILOVER_LOG: _failover_log,
    Opcode.DCP_GET_FAILOVER_LOG: _failover_log,
    Opcode.GET_CLUSTER_CONFIG: _cluster_config,
    Opcode.COMPACT_DB: _compact_db,
    Opcode.DCP_OPEN: _dcp_open,
    Opcode.DCP_CONTROL: _dcp_control,
    Opcode.DCP_STREAM_REQ: _dcp_stream_req,
    Opcode.DCP_CLOSE_STREAM: _dcp_close_stream,
    Opcode.DCP_BUFFER_ACKNOWLEDGEMENT: _dcp_buffer_ack,
    Opcode.DCP_NOOP: _dcp_noop_request,
    Opcode.DCP_SEQNO_ACKNOWLEDGED: _dcp_seqno_acknowledged,
    Opcode.GET_REPLICA: _get_replica,
    # The Couchbase SDKs' bootstrap and KV surface (server/kv_commands.py, server/subdoc.py).
    Opcode.GET_ERROR_MAP: kv_commands.get_error_map,
    Opcode.GET_META: kv_commands.get_meta,
    Opcode.GET_LOCKED: kv_commands.get_locked,
    Opcode.UNLOCK_KEY: kv_commands.unlock,
    Opcode.TOUCH: kv_commands.touch,
    Opcode.GAT: kv_commands.touch,
    Opcode.INCREMENT: kv_commands.arithmetic,
    Opcode.DECREMENT: kv_commands.arithmetic,
    Opcode.APPEND: kv_commands.concat,
    Opcode.PREPEND: kv_commands.concat,
    Opcode.SUBDOC_MULTI_LOOKUP: subdoc.multi_lookup,
    Opcode.SUBDOC_MULTI_MUTATION: subdoc.multi_mutation,
    Opcode.GET_COLLECTIONS_MANIFEST: collection_commands.get_collections_manifest,
    Opcode.GET_COLLECTION_ID: collection_commands.get_collection_id,
    Opcode.GET_SCOPE_ID: collection_commands.get_scope_id,
    Opcode.SET_COLLECTIONS_MANIFEST: collection_commands.set_collections_manifest,
}


@dataclass(frozen=True, slots=True)
class _WindowGet:
    """A window's GET held for its turn, with its key as stored (`RequestWindow.frame_key`)
    and the collections manifest it was qualified under."""

    frame: Frame
    key: bytes
    manifest_uid: int


def _plain_key_only(frame: Frame, key: bytes) -> bool:
    """A GET or DELETE `decode_key_only` takes (no extras, no value, a key within limits;
    `key` as stored): the only kind a window answers without the per-frame handler."""
    return not frame.extras and not frame.value and 0 < len(key) <= limits.KEY_SIZE_MAX
