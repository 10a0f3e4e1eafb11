"""Node ingest driven by clients we did not write, next to Redis 7 driven by the same shapes.

The node's own ``KvClient`` is tuned to the node; a user brings another client. Each row sends
the same workload shape to a changefeed node (memcached binary protocol) and to a redis-server
(RESP) in the same run, and reports items/s, the server's CPU per item (from ``/proc/<pid>/stat``
of the node and of redis-server, all threads) and the ratios. Rows:

* ``raw SET w=N xK``: a plain raw-socket MCBP client: classic magic, 8-byte extras (flags 0,
  expiry 0), no CAS, 15-byte keys, 100-byte values over 64 vbuckets (CRC32 as libcouchbase),
  windows of N requests, K windows in flight. It logs in with SASL PLAIN and SELECT_BUCKET,
  negotiates nothing with HELLO, builds every request before the clock starts and checks every
  reply's opaque (in order) and status. Peer: the same requests as raw RESP ``SET k v``.
* ``raw SET+flags+expiry``: as above with flags 0xdeadbeef and expiry 3600 (peer: ``SET k v EX
  3600``).
* ``raw mix``: SET / GET / DELETE, 2:1:1, GETs and DELETEs of keys set earlier in the run (a
  DELETE of a key already deleted answers KEY_ENOENT: counted, as Redis's ``:0``).
* ``raw mix +Collections``: the mix from a client that negotiated HELLO Collections (as every
  SDK does), its keys behind the default collection's id 0x00.
* ``SDK upsert_multi`` (the official Couchbase Python SDK, RawBinaryTranscoder) vs redis-py
  pipelined ``SET`` (``transaction=False``), both in chunks of the window.
* ``raw durable SET majority``: the raw SETs as flexible-magic requests whose framing extras
  are one durability frame info (level majority, no timeout: ``0x11 0x01``), as an SDK sends a
  durable write; each is answered once committed (one node: once persisted here). No Redis
  peer (a plain ``SET`` promises less): its peer is the plain ``raw SET`` row of the same
  window, from the same run. ``SDK upsert_multi durability=majority`` is the SDK's.

Both servers run without persistence waits: the node is a default (durable: fsync per flush
round) node unless ``--no-durable``; Redis has no RDB and no AOF. The clients run in this
process (a sender thread and a receiver thread for the raw ones, so K windows can be in
flight without either side blocking the other); their CPU is printed but is not the point.

Usage::

    .venv/bin/python bench/bench_raw_clients.py                  # 200,000 items a row
    .venv/bin/python bench/bench_raw_clients.py --quick          # 20,000, a smoke run
    .venv/bin/python bench/bench_raw_clients.py --only raw --profile   # py-spy of the node too
    .venv/bin/python bench/bench_raw_clients.py --streams        # + a raw DCP reader vs XREAD
    .venv/bin/python bench/bench_raw_clients.py --shape "GET,w=2000 x1"   # some rows only

``--streams`` loads more items, restarts the node cleanly (everything is then on disk) and
streams every vbucket with a raw DCP reader (headers only, no flow control); Redis gets the
same count as XADDs to one stream, read by a raw RESP ``XREAD COUNT 10000`` loop (hiredis's C
parser) and by redis-py. "writes" are each server's write system calls (``/proc/<pid>/io``):
socket writes, and the node's LMDB page writes.

Every process started here is stopped when its block exits; every wait has a deadline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_bench_procs import RedisProcess, SpySampler, node_process, stop_children, top_self_time

VBUCKETS = 64
KEY_FORMAT = b"rawkey-%08d"  # 15 bytes
VALUE_BYTES = 100
USER, PASSWORD, BUCKET = b"Administrator", b"password", b"default"
HEADER = struct.Struct(">BBHBBHIIQ")
SET_EXTRAS = struct.Struct(">II")
REQUEST, RESPONSE = 0x80, 0x81
OP_GET, OP_SET, OP_DELETE, OP_SASL_AUTH, OP_SELECT_BUCKET = 0x00, 0x01, 0x04, 0x21, 0x89
OP_HELLO, FEATURE_COLLECTIONS = 0x1F, 0x12
SUCCESS, KEY_ENOENT = 0x00, 0x01
ALT_REQUEST = 0x08
ALT_HEADER = struct.Struct(">BBBBBBHIIQ")  # framing extras length and key length one byte each
DURABILITY_MAJORITY = b"\x11\x01"  # frame info id 1, 1 byte: level 1 (majority)
DEADLINE_S = 600.0
FLAGS, EXPIRY = 0xDEADBEEF, 3600


def vbucket_of(key: bytes) -> int:
    """libcouchbase's key → vbucket: CRC32, bits 16..30, modulo the vbucket count."""
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % VBUCKETS


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far, all threads."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- workloads: (op, key) per request -------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    name: str
    window: int
    in_flight: int
    flags_expiry: bool = False
    mix: bool = False
    sdk: bool = False
    collections: bool = False  # HELLO Collections, keys behind their collection id (0x00)
    durable: bool = False  # durability majority (a frame info): no Redis peer


def operations(count: int, mix: bool) -> list[tuple[str, int]]:
    """("set"|"get"|"delete", key number) per request: all SETs, or SET/GET/DELETE 2:1:1 with
    every GET and DELETE on a key set at least a window earlier."""
    if not mix:
        return [("set", n) for n in range(count)]
    ops: list[tuple[str, int]] = []
    written = 0
    for n in range(count):
        phase = n % 4
        if phase in (0, 1) or written < 64:
            ops.append(("set", written))
            written += 1
        else:
            ops.append(("get" if phase == 2 else "delete", (n * 7919) % (written // 2)))
    return ops


def value_of(n: int) -> bytes:
    return b"%0100d" % n


def mcbp_requests(
    ops: list[tuple[str, int]], flags_expiry: bool, collections: bool = False, durable: bool = False
) -> list[bytes]:
    """One encoded request per operation, opaque = its index; with `collections` each key is
    sent behind the default collection's id (LEB128 0x00), as an SDK sends it; with `durable`
    each SET carries durability majority (an alt-magic request)."""
    extras = SET_EXTRAS.pack(FLAGS, EXPIRY) if flags_expiry else SET_EXTRAS.pack(0, 0)
    out = []
    for opaque, (op, n) in enumerate(ops):
        key = KEY_FORMAT % n
        vb = vbucket_of(key)
        key = b"\x00" + key if collections else key
        if op == "set" and durable:
            value = value_of(n)
            framing = DURABILITY_MAJORITY
            body = len(framing) + len(extras) + len(key) + len(value)
            head = ALT_HEADER.pack(ALT_REQUEST, OP_SET, len(framing), len(key), len(extras), 0,
                                   vb, body, opaque, 0)  # fmt: skip
            out.append(head + framing + extras + key + value)
        elif op == "set":
            value = value_of(n)
            body = len(extras) + len(key) + len(value)
            head = HEADER.pack(REQUEST, OP_SET, len(key), len(extras), 0, vb, body, opaque, 0)
            out.append(head + extras + key + value)
        else:
            code = OP_GET if op == "get" else OP_DELETE
            out.append(HEADER.pack(REQUEST, code, len(key), 0, 0, vb, len(key), opaque, 0) + key)
    return out


def resp(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def resp_requests(ops: list[tuple[str, int]], flags_expiry: bool) -> list[bytes]:
    out = []
    for op, n in ops:
        key = KEY_FORMAT % n
        if op == "set":
            extra = (b"EX", b"%d" % EXPIRY) if flags_expiry else ()
            out.append(resp(b"SET", key, value_of(n), *extra))
        else:
            out.append(resp(b"GET" if op == "get" else b"DEL", key))
    return out


# -- the raw clients ------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def mcbp_login(port: int, collections: bool = False) -> socket.socket:
    """A socket logged in with SASL PLAIN and on the bucket: nothing else negotiated, or only
    HELLO Collections (`collections`)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    plain = b"\0" + USER + b"\0" + PASSWORD
    steps = [(OP_SASL_AUTH, b"PLAIN", plain), (OP_SELECT_BUCKET, BUCKET, b"")]
    if collections:
        steps.insert(0, (OP_HELLO, b"bench", struct.pack(">H", FEATURE_COLLECTIONS)))
    for opcode, key, value in steps:
        head = HEADER.pack(REQUEST, opcode, len(key), 0, 0, 0, len(key) + len(value), 0, 0)
        sock.sendall(head + key + value)
        reply = HEADER.unpack(_recv_exact(sock, HEADER.size))
        body = _recv_exact(sock, reply[6])
        if reply[5] != SUCCESS:
            raise RuntimeError(f"opcode {opcode:#x} refused: status {reply[5]:#x} {body!r}")
    return sock


class Pipeline:
    """Windows of pre-encoded requests, ``in_flight`` windows unanswered at most: a sender
    thread writes a window once a slot is free; the receiver counts replies and frees a slot
    when a window's last reply arrives. ``parse`` takes (buffer, start) and returns the end of
    every whole reply it consumed and how many; it raises on a wrong reply."""

    def __init__(
        self,
        sock: socket.socket,
        windows: list[bytes],
        counts: list[int],
        in_flight: int,
        parse: Callable[[bytes, int, int], tuple[int, int]],
    ) -> None:
        self.sock, self.windows, self.counts, self.parse = sock, windows, counts, parse
        self.slots = threading.Semaphore(in_flight)
        self.error: BaseException | None = None

    def _send(self) -> None:
        try:
            for window in self.windows:
                if not self.slots.acquire(timeout=DEADLINE_S):
                    raise TimeoutError("no reply for a window")
                self.sock.sendall(window)
        except BaseException as error:  # reported by run()
            self.error = error

    def run(self) -> None:
        sender = threading.Thread(target=self._send, daemon=True)
        sender.start()
        buffer = b""
        pos = 0
        seen = 0  # replies so far (their index is the next opaque expected)
        target = 0
        for count in self.counts:
            target += count
            while seen < target:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise ConnectionError(f"closed after {seen} replies ({self.error!r})")
                buffer = buffer[pos:] + chunk
                pos, got = self.parse(buffer, 0, seen)
                seen += got
            self.slots.release()
        sender.join(DEADLINE_S)
        if self.error is not None:
            raise self.error
        if len(buffer) > pos:
            raise RuntimeError(f"{len(buffer) - pos} bytes past the last reply")


def mcbp_parser(
    ops: list[tuple[str, int]], any_order: bool = False
) -> Callable[[bytes, int, int], tuple[int, int]]:
    """Replies in request order (opaque = index), SUCCESS — or KEY_ENOENT for a GET/DELETE.
    `any_order`: durable writes are answered as they commit (each vbucket's in order), so a
    window's replies come in any order; each request is answered once."""
    unpack = HEADER.unpack_from
    size = HEADER.size
    answered = bytearray(len(ops))

    def parse(buffer: bytes, pos: int, seen: int) -> tuple[int, int]:
        got = 0
        end = len(buffer)
        while end - pos >= size:
            magic, _op, _kl, _el, _dt, status, body, opaque, _cas = unpack(buffer, pos)
            if end - pos < size + body:
                break
            index = seen + got
            if any_order and magic == RESPONSE and opaque < len(ops) and not answered[opaque]:
                answered[opaque] = 1
                index = opaque
            elif magic != RESPONSE or opaque != index:
                raise RuntimeError(f"reply {index}: magic {magic:#x}, opaque {opaque}")
            if status != SUCCESS and not (status == KEY_ENOENT and ops[index][0] != "set"):
                raise RuntimeError(f"reply {index} ({ops[index]}): status {status:#x}")
            pos += size + body
            got += 1
        return pos, got

    return parse


def resp_parser(ops: list[tuple[str, int]]) -> Callable[[bytes, int, int], tuple[int, int]]:
    """+OK, $N bulk or $-1, :N: one reply per request; an error reply raises."""

    def parse(buffer: bytes, pos: int, seen: int) -> tuple[int, int]:
        got = 0
        end = len(buffer)
        while pos < end:
            line_end = buffer.find(b"\r\n", pos)
            if line_end < 0:
                break
            kind = buffer[pos]
            if kind == 0x24:  # $
                size = int(buffer[pos + 1 : line_end])
                stop = line_end + 2 + (size + 2 if size >= 0 else 0)
                if stop > end:
                    break
            elif kind in (0x2B, 0x3A):  # + :
                stop = line_end + 2
            else:
                raise RuntimeError(f"reply {seen + got}: {buffer[pos:line_end]!r}")
            pos = stop
            got += 1
        return pos, got

    return parse


def raw_run(
    sock: socket.socket, requests: list[bytes], shape: Shape, parser: Callable[..., tuple[int, int]]
) -> None:
    windows, counts = [], []
    for first in range(0, len(requests), shape.window):
        chunk = requests[first : first + shape.window]
        windows.append(b"".join(chunk))
        counts.append(len(chunk))
    Pipeline(sock, windows, counts, shape.in_flight, parser).run()


# -- timing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    items: int
    seconds: float
    server_cpu_s: float
    client_cpu_s: float
    server_writes: int  # write system calls of the server (replies, fsyncs' data...)

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    @property
    def server_us(self) -> float:
        return 1e6 * self.server_cpu_s / self.items


def write_syscalls(pid: int) -> int:
    """Write system calls of ``pid`` so far, all threads (/proc/<pid>/io ``syscw``)."""
    with open(f"/proc/{pid}/io") as handle:
        fields = dict(line.split(": ") for line in handle.read().splitlines())
    return int(fields["syscw"])


def measure(pid: int, items: int, work: Callable[[], None]) -> Measured:
    writes = write_syscalls(pid)
    server, client, started = cpu_seconds(pid), time.process_time(), time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    return Measured(
        items,
        seconds,
        cpu_seconds(pid) - server,
        time.process_time() - client,
        write_syscalls(pid) - writes,
    )


def node_row(port: int, pid: int, shape: Shape, count: int, salt: int) -> Measured:
    ops = [(op, n + salt) for op, n in operations(count, shape.mix)]
    if shape.sdk:
        return sdk_upserts(port, pid, ops, shape.window, shape.durable)
    requests = mcbp_requests(ops, shape.flags_expiry, shape.collections, shape.durable)
    sock = mcbp_login(port, shape.collections)
    parser = mcbp_parser(ops, any_order=shape.durable)
    try:
        return measure(pid, count, lambda: raw_run(sock, requests, shape, parser))
    finally:
        sock.close()


def redis_row(port: int, pid: int, shape: Shape, count: int, salt: int) -> Measured:
    ops = [(op, n + salt) for op, n in operations(count, shape.mix)]
    if shape.sdk:
        return redis_py_sets(port, pid, ops, shape.window)
    requests = resp_requests(ops, shape.flags_expiry)
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        return measure(pid, count, lambda: raw_run(sock, requests, shape, resp_parser(ops)))
    finally:
        sock.close()


def sdk_upserts(
    port: int, pid: int, ops: list[tuple[str, int]], window: int, durable: bool = False
) -> Measured:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
    from couchbase.durability import DurabilityLevel, ServerDurability
    from couchbase.options import ClusterOptions, ClusterTimeoutOptions, UpsertMultiOptions
    from couchbase.transcoder import RawBinaryTranscoder

    options = ClusterOptions(
        PasswordAuthenticator(USER.decode(), PASSWORD.decode()),
        timeout_options=ClusterTimeoutOptions(
            connect_timeout=timedelta(seconds=20), kv_timeout=timedelta(seconds=60)
        ),
    )
    cluster = Cluster.connect(f"couchbase://127.0.0.1:{port}", options)
    try:
        cluster.wait_until_ready(timedelta(seconds=20))
        collection = cluster.bucket(BUCKET.decode()).default_collection()
        chunks = [
            {(KEY_FORMAT % n).decode(): value_of(n) for _op, n in ops[i : i + window]}
            for i in range(0, len(ops), window)
        ]
        upsert_options = UpsertMultiOptions(transcoder=RawBinaryTranscoder())
        if durable:
            upsert_options = UpsertMultiOptions(
                transcoder=RawBinaryTranscoder(),
                durability=ServerDurability(DurabilityLevel.MAJORITY),
            )

        def work() -> None:
            for chunk in chunks:
                result = collection.upsert_multi(chunk, upsert_options)
                if not result.all_ok:
                    raise RuntimeError(
                        f"upsert_multi failed: {list(result.exceptions.items())[:3]}"
                    )

        return measure(pid, len(ops), work)
    finally:
        cluster.close()


def redis_py_sets(port: int, pid: int, ops: list[tuple[str, int]], window: int) -> Measured:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    chunks = [
        [(KEY_FORMAT % n, value_of(n)) for _op, n in ops[i : i + window]]
        for i in range(0, len(ops), window)
    ]

    def work() -> None:
        for chunk in chunks:
            pipe = client.pipeline(transaction=False)
            for key, value in chunk:
                pipe.set(key, value)
            if not all(pipe.execute()):
                raise RuntimeError("a SET failed")

    try:
        return measure(pid, len(ops), work)
    finally:
        client.close()


# -- streams: a raw DCP reader vs raw RESP XREAD and redis-py XREAD --------------------------

OP_GET_ALL_VB_SEQNOS, OP_DCP_OPEN, OP_DCP_STREAM_REQ = 0x48, 0x50, 0x53
OP_DCP_STREAM_END, OP_DCP_MUTATION, OP_DCP_DELETION, OP_DCP_EXPIRATION = 0x55, 0x57, 0x58, 0x59
STREAM_REQ_EXTRAS = struct.Struct(">IIQQQQQ")  # flags, reserved, start, end, uuid, snap s/e
VB_SEQNO = struct.Struct(">HQ")
REDIS_STREAM = b"bench"
XREAD_COUNT = 10_000


def mcbp_call(sock: socket.socket, opcode: int, key: bytes, extras: bytes = b"") -> bytes:
    """One request, its reply's value (the reply must be SUCCESS)."""
    body = len(extras) + len(key)
    sock.sendall(
        HEADER.pack(REQUEST, opcode, len(key), len(extras), 0, 0, body, 0, 0) + extras + key
    )
    reply = HEADER.unpack(_recv_exact(sock, HEADER.size))
    data = _recv_exact(sock, reply[6])
    if reply[5] != SUCCESS:
        raise RuntimeError(f"opcode {opcode:#x}: status {reply[5]:#x} {data!r}")
    return data[reply[3] + reply[2] :]


def dcp_read_all(port: int) -> int:
    """Stream every vbucket from seqno 0 to its high seqno now: DCP_OPEN (producer, no flow
    control), one STREAM_REQ per vbucket in one write, count mutations, deletions and
    expirations until every stream has ended. Only headers are parsed (as a C client would)."""
    sock = mcbp_login(port)
    try:
        value = mcbp_call(sock, OP_GET_ALL_VB_SEQNOS, b"")
        highs = dict(VB_SEQNO.iter_unpack(value))
        mcbp_call(
            sock, OP_DCP_OPEN, b"raw-reader-%d" % time.monotonic_ns(), struct.pack(">II", 0, 1)
        )
        requests = []
        for vb, high in sorted(highs.items()):
            extras = STREAM_REQ_EXTRAS.pack(0, 0, 0, high, 0, 0, 0)
            requests.append(HEADER.pack(REQUEST, OP_DCP_STREAM_REQ, 0, len(extras), 0, vb,
                                        len(extras), vb, 0) + extras)  # fmt: skip
        sock.sendall(b"".join(requests))
        ended = items = 0
        buffer = b""
        pos = 0
        unpack = HEADER.unpack_from
        size = HEADER.size
        counted = (OP_DCP_MUTATION, OP_DCP_DELETION, OP_DCP_EXPIRATION)
        while ended < len(highs):
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError(f"closed after {items} items, {ended} streams ended")
            buffer = buffer[pos:] + chunk
            pos = 0
            end = len(buffer)
            while end - pos >= size:
                magic, opcode, _kl, _el, _dt, status, body, _op, _cas = unpack(buffer, pos)
                if end - pos < size + body:
                    break
                pos += size + body
                if opcode in counted:
                    items += 1
                elif opcode == OP_DCP_STREAM_END:
                    ended += 1
                elif magic == RESPONSE and opcode == OP_DCP_STREAM_REQ and status != SUCCESS:
                    raise RuntimeError(f"stream request refused: status {status:#x}")
        return items
    finally:
        sock.close()


def redis_xadd_all(port: int, count: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    try:
        requests = [
            resp(b"XADD", REDIS_STREAM, b"*", KEY_FORMAT % n, value_of(n)) for n in range(count)
        ]
        shape = Shape("xadd", 4096, 2)
        ops = [("set", n) for n in range(count)]
        raw_run(sock, requests, shape, resp_parser(ops))
    finally:
        sock.close()


def xread_raw(port: int, expected: int) -> int:
    """XREAD COUNT 10000 from the start until `expected` entries, over a raw socket with the
    hiredis C parser (what a C client does)."""
    import hiredis

    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    reader = hiredis.Reader()
    last = b"0-0"
    got = 0
    try:
        while got < expected:
            sock.sendall(
                resp(b"XREAD", b"COUNT", b"%d" % XREAD_COUNT, b"STREAMS", REDIS_STREAM, last)
            )
            reply = False
            while reply is False:
                data = sock.recv(1 << 20)
                if not data:
                    raise ConnectionError("redis closed")
                reader.feed(data)
                reply = reader.gets()
            entries = reply[0][1]
            got += len(entries)
            last = entries[-1][0]
        return got
    finally:
        sock.close()


def xread_redis_py(port: int, expected: int) -> int:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    last: bytes | str = "0-0"
    got = 0
    try:
        while got < expected:
            reply = client.xread({REDIS_STREAM: last}, count=XREAD_COUNT)
            entries = reply[0][1]
            got += len(entries)
            last = entries[-1][0]
        return got
    finally:
        client.close()


def stream_rows(
    node: object, redis_ctx: RedisProcess | None, count: int, spy: Path | None
) -> list[str]:
    """Load `count` more items, then stream the node from disk (after a clean restart) with
    the raw DCP reader, and Redis's stream with both XREAD readers."""
    from changefeed.cli.node_process import NodeProcess

    assert isinstance(node, NodeProcess)
    lines = []
    ops = [("set", n + 10**7) for n in range(count)]
    sock = mcbp_login(node.port)
    try:
        raw_run(sock, mcbp_requests(ops, False), Shape("load", 4096, 2), mcbp_parser(ops))
    finally:
        sock.close()
    node.restart()  # a clean stop persists everything: the stream is all backfill
    holder: list[int] = []
    if spy is not None:
        with SpySampler(node.pid, spy):
            ours = measure(node.pid, 1, lambda: holder.append(dcp_read_all(node.port)))
        lines += ["## profile of the node, DCP raw reader from disk", *top_self_time(spy, 25)]
    else:
        ours = measure(node.pid, 1, lambda: holder.append(dcp_read_all(node.port)))
    items = holder[0]
    ours = Measured(items, ours.seconds, ours.server_cpu_s, ours.client_cpu_s, ours.server_writes)
    lines.append(f"# DCP raw reader, from disk: {items:,} items, {ours.rate:,.0f}/s, node "
                 f"{ours.server_us:.2f} us/item; load {load_average()}")  # fmt: skip
    if redis_ctx is not None:
        redis_xadd_all(redis_ctx.port, items)
        for name, read in (("raw RESP XREAD", xread_raw), ("redis-py XREAD", xread_redis_py)):
            peer = measure(
                redis_ctx.pid, items, lambda read=read: holder.append(read(redis_ctx.port, items))
            )
            lines.append(
                f"# {name}: {peer.rate:,.0f}/s, redis {peer.server_us:.2f} us/item, client "
                f"{1e6 * peer.client_cpu_s / items:.2f} us/item; DCP/this "
                f"{ours.rate / peer.rate:.2f}x, CPU {ours.server_us / peer.server_us:.1f}x"
            )
    return lines


# -- the run --------------------------------------------------------------------------------


def shapes(only: str) -> Iterator[Shape]:
    every = [
        Shape("raw SET w=16 x1", 16, 1),
        Shape("raw SET w=16 x2", 16, 2),
        Shape("raw SET w=64 x1", 64, 1),
        Shape("raw SET w=64 x2", 64, 2),
        Shape("raw SET w=256 x1", 256, 1),
        Shape("raw SET w=2000 x1", 2000, 1),
        Shape("raw SET w=2000 x2", 2000, 2),
        Shape("raw SET w=4096 x1", 4096, 1),
        Shape("raw SET w=4096 x2", 4096, 2),
        Shape("raw SET+flags+expiry w=2000 x1", 2000, 1, flags_expiry=True),
        Shape("raw SET/GET/DELETE w=2000 x1", 2000, 1, mix=True),
        Shape("raw SET/GET/DELETE +Collections w=2000 x1", 2000, 1, mix=True, collections=True),
        Shape("SDK upsert_multi vs redis-py w=2000", 2000, 1, sdk=True),
        Shape("raw durable SET majority w=2000 x1", 2000, 1, durable=True),
        Shape("SDK upsert_multi durability=majority w=2000", 2000, 1, sdk=True, durable=True),
    ]
    for shape in every:
        if only == "all" or (only == "sdk") == shape.sdk:
            yield shape


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--quick", action="store_true", help="20,000 items a row")
    parser.add_argument("--no-durable", action="store_true", help="node without fsync")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--only", choices=["all", "raw", "sdk"], default="all")
    parser.add_argument("--shape", help="only shapes whose name contains one of these (a,b)")
    parser.add_argument("--profile", action="store_true", help="py-spy the node for each row")
    parser.add_argument(
        "--profile-dir", type=Path, help="keep each row's raw py-spy stacks here (with --profile)"
    )
    parser.add_argument("--streams", action="store_true", help="also the stream rows (at the end)")
    args = parser.parse_args()
    if args.profile_dir and not args.profile:
        parser.error("--profile-dir keeps --profile's stacks: give --profile too")
    count = 20_000 if args.quick else args.items
    work = Path(tempfile.mkdtemp(prefix="bench-raw-"))
    wanted = args.shape.split(",") if args.shape else [""]
    chosen = [s for s in shapes(args.only) if any(w in s.name for w in wanted)]
    print(f"# bench_raw_clients: {count:,} items a row, {VBUCKETS} vbuckets, 15-byte keys, "
          f"100-byte values; node {'--no-durable' if args.no_durable else 'durable'}")  # fmt: skip
    print(f"# load average at start: {load_average()}")
    rows: list[tuple[Shape, Measured, Measured | None, str]] = []
    try:
        extra = ["--no-durable"] if args.no_durable else []
        with node_process(work / "node", vbuckets=VBUCKETS, extra=extra) as node:
            redis_ctx = None if args.no_redis else RedisProcess(work / "redis")
            if redis_ctx is not None:
                redis_ctx.__enter__()
            try:
                for index, shape in enumerate(chosen):
                    salt = index * count * 2
                    before = load_average()
                    if args.profile:
                        raw = (args.profile_dir or work) / f"spy-{index}.txt"
                        with SpySampler(node.pid, raw):
                            ours = node_row(node.port, node.pid, shape, count, salt)
                        print(f"## profile of the node, {shape.name}")
                        print("\n".join(top_self_time(raw, 25)))
                    else:
                        ours = node_row(node.port, node.pid, shape, count, salt)
                    peer = None
                    if redis_ctx is not None and not shape.durable:
                        peer = redis_row(redis_ctx.port, redis_ctx.pid, shape, count, salt)
                    rows.append((shape, ours, peer, before))
                    print(describe(shape, ours, peer, before), flush=True)
                if args.streams:
                    spy = (args.profile_dir or work) / "spy-streams.txt" if args.profile else None
                    streams = stream_rows(node, redis_ctx, count, spy)
                    print("\n".join(streams), flush=True)
            finally:
                if redis_ctx is not None:
                    redis_ctx.__exit__(None, None, None)
    except BaseException:
        stop_children()
        print(f"# failed: work directory kept at {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    print()
    print(table(rows))
    print(f"# load average at end: {load_average()}")


def describe(shape: Shape, ours: Measured, peer: Measured | None, load: str) -> str:
    text = (f"# {shape.name}: node {ours.rate:,.0f}/s {ours.server_us:.2f} us/item "
            f"(client {1e6 * ours.client_cpu_s / ours.items:.2f} us)")  # fmt: skip
    if peer is not None:
        text += (f"; redis {peer.rate:,.0f}/s {peer.server_us:.2f} us/item "
                 f"(client {1e6 * peer.client_cpu_s / peer.items:.2f} us)")  # fmt: skip
    text += f"; node writes/item {ours.server_writes / ours.items:.3f}"
    if peer is not None:
        text += f", redis {peer.server_writes / peer.items:.3f}"
    return text + f"; load {load}"


def table(rows: list[tuple[Shape, Measured, Measured | None, str]]) -> str:
    lines = [
        "| shape | node items/s | Redis items/s | ratio | node CPU µs/item | Redis CPU µs/item "
        "| CPU ratio | load avg (1/5/15 min) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for shape, ours, peer, load in rows:
        if peer is None:
            lines.append(
                f"| {shape.name} | {ours.rate:,.0f} | – | – | {ours.server_us:.2f} | – | – "
                f"| {load} |"
            )
            continue
        lines.append(
            f"| {shape.name} | {ours.rate:,.0f} | {peer.rate:,.0f} | {ours.rate / peer.rate:.2f}× "
            f"| {ours.server_us:.2f} | {peer.server_us:.2f} "
            f"| {ours.server_us / peer.server_us:.1f}× | {load} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
