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
* ``SDK upsert_multi`` (the official Couchbase Python SDK, RawBinaryTranscoder) vs redis-py
  pipelined ``SET`` (``transaction=False``), both in chunks of the window.

Both servers run without persistence waits: the node is a default (durable: fsync per flush
round) node unless ``--no-durable``; Redis has no RDB and no AOF. The clients run in this
process (a sender thread and a receiver thread for the raw ones, so K windows can be in
flight without either side blocking the other); their CPU is printed but is not the point.

Usage::

    .venv/bin/python bench/bench_raw_clients.py                  # 200,000 items a row
    .venv/bin/python bench/bench_raw_clients.py --quick          # 20,000, a smoke run
    .venv/bin/python bench/bench_raw_clients.py --only raw --profile   # py-spy of the node too

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
SUCCESS, KEY_ENOENT = 0x00, 0x01
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


def mcbp_requests(ops: list[tuple[str, int]], flags_expiry: bool) -> list[bytes]:
    """One encoded request per operation, opaque = its index."""
    extras = SET_EXTRAS.pack(FLAGS, EXPIRY) if flags_expiry else SET_EXTRAS.pack(0, 0)
    out = []
    for opaque, (op, n) in enumerate(ops):
        key = KEY_FORMAT % n
        vb = vbucket_of(key)
        if op == "set":
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


def mcbp_login(port: int) -> socket.socket:
    """A socket logged in with SASL PLAIN and on the bucket: nothing else negotiated."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    plain = b"\0" + USER + b"\0" + PASSWORD
    for opcode, key, value in ((OP_SASL_AUTH, b"PLAIN", plain), (OP_SELECT_BUCKET, BUCKET, b"")):
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


def mcbp_parser(ops: list[tuple[str, int]]) -> Callable[[bytes, int, int], tuple[int, int]]:
    """Replies in request order (opaque = index), SUCCESS — or KEY_ENOENT for a GET/DELETE."""
    unpack = HEADER.unpack_from
    size = HEADER.size

    def parse(buffer: bytes, pos: int, seen: int) -> tuple[int, int]:
        got = 0
        end = len(buffer)
        while end - pos >= size:
            magic, _op, _kl, _el, _dt, status, body, opaque, _cas = unpack(buffer, pos)
            if end - pos < size + body:
                break
            index = seen + got
            if magic != RESPONSE or opaque != index:
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

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    @property
    def server_us(self) -> float:
        return 1e6 * self.server_cpu_s / self.items


def measure(pid: int, items: int, work: Callable[[], None]) -> Measured:
    server, client, started = cpu_seconds(pid), time.process_time(), time.perf_counter()
    work()
    seconds = time.perf_counter() - started
    return Measured(items, seconds, cpu_seconds(pid) - server, time.process_time() - client)


def node_row(port: int, pid: int, shape: Shape, count: int, salt: int) -> Measured:
    ops = [(op, n + salt) for op, n in operations(count, shape.mix)]
    if shape.sdk:
        return sdk_upserts(port, pid, ops, shape.window)
    requests = mcbp_requests(ops, shape.flags_expiry)
    sock = mcbp_login(port)
    try:
        return measure(pid, count, lambda: raw_run(sock, requests, shape, mcbp_parser(ops)))
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


def sdk_upserts(port: int, pid: int, ops: list[tuple[str, int]], window: int) -> Measured:
    from couchbase.auth import PasswordAuthenticator
    from couchbase.cluster import Cluster
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


# -- the run --------------------------------------------------------------------------------


def shapes(only: str) -> Iterator[Shape]:
    every = [
        Shape("raw SET w=16 x1", 16, 1),
        Shape("raw SET w=16 x2", 16, 2),
        Shape("raw SET w=256 x1", 256, 1),
        Shape("raw SET w=2000 x1", 2000, 1),
        Shape("raw SET w=2000 x2", 2000, 2),
        Shape("raw SET w=4096 x1", 4096, 1),
        Shape("raw SET w=4096 x2", 4096, 2),
        Shape("raw SET+flags+expiry w=2000 x1", 2000, 1, flags_expiry=True),
        Shape("raw SET/GET/DELETE w=2000 x1", 2000, 1, mix=True),
        Shape("SDK upsert_multi vs redis-py w=2000", 2000, 1, sdk=True),
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
    args = parser.parse_args()
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
                        raw = work / f"spy-{index}.txt"
                        with SpySampler(node.pid, raw):
                            ours = node_row(node.port, node.pid, shape, count, salt)
                        print(f"## profile of the node, {shape.name}")
                        print("\n".join(top_self_time(raw, 25)))
                    else:
                        ours = node_row(node.port, node.pid, shape, count, salt)
                    peer = None
                    if redis_ctx is not None:
                        peer = redis_row(redis_ctx.port, redis_ctx.pid, shape, count, salt)
                    rows.append((shape, ours, peer, before))
                    print(describe(shape, ours, peer, before), flush=True)
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
