"""CPU per request of a real `ClientConnection` in process, fed whole windows through
`data_received` (no socket, no flusher running: every vbucket flushed every 64 windows,
outside the clock), to compare trees without a node's noise: the connection's framing, runs,
request windows and replies plus the bucket below them. Shapes as bench_raw_clients.py:
plain SETs in windows of `--window`, or (`--mix`) SET/GET/DELETE 2:1:1 with every GET and
DELETE on a key set at least a window earlier. Run two trees alternately with PYTHONPATH.

    .venv/bin/python bench/bench_connection_window.py --window 16 --items 64000
    .venv/bin/python bench/bench_connection_window.py --window 2000 --items 64000 --mix
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import zlib
from pathlib import Path

from changefeed.protocol.kv import StoreCommand, encode_request, encode_store
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import encode_plain
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users

VBUCKETS = 64


class Sink:
    """A transport that counts what the connection writes and keeps nothing."""

    def __init__(self) -> None:
        self.bytes = 0

    def write(self, data: bytes) -> None:
        self.bytes += len(data)

    def writelines(self, data: list[bytes]) -> None:
        self.bytes += sum(map(len, data))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def key_of(n: int) -> bytes:
    return b"key%012d" % n


def vbucket_of(key: bytes) -> int:
    return ((zlib.crc32(key) >> 16) & 0x7FFF) % VBUCKETS


def request(op: str, n: int, opaque: int) -> bytes:
    key = key_of(n)
    vb = vbucket_of(key)
    if op == "set":
        return encode_store(StoreCommand(Opcode.SET, vb, opaque, key, b"%0100d" % n))
    code = Opcode.GET if op == "get" else Opcode.DELETE
    return encode_request(code, opaque=opaque, vbucket=vb, key=key)


def operations(count: int, mix: bool) -> list[tuple[str, int]]:
    """bench_raw_clients.operations: the same requests."""
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


async def measure(window: int, items: int, mix: bool, data_dir: Path) -> float:
    config = NodeConfig(data_dir=data_dir, vbuckets=VBUCKETS, durable=False)
    users = Users()
    users.add("u", "p")
    bucket = Bucket.open(config)
    ops = operations(items, mix)
    windows = [
        b"".join(request(op, n, at + i) for i, (op, n) in enumerate(ops[at : at + window]))
        for at in range(0, items, window)
    ]
    conn = ClientConnection(ServerContext(config, users, bucket))
    sink = Sink()
    conn.connection_made(sink)  # type: ignore[arg-type]
    conn.data_received(
        encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=encode_plain("u", "p"))
    )
    while not sink.bytes:
        await asyncio.sleep(0.01)
    conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"))
    cpu_s = 0.0
    try:
        for number, data in enumerate(windows):
            started = time.process_time()
            conn.data_received(data)
            cpu_s += time.process_time() - started
            if number % 64 == 63:
                for vbucket in bucket.vbuckets.values():
                    vbucket.flush()
    finally:
        conn.close()
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()
    return cpu_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--items", type=int, default=64_000)
    parser.add_argument("--mix", action="store_true", help="SET/GET/DELETE 2:1:1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cpu_s = asyncio.run(measure(args.window, args.items, args.mix, Path(tmp)))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    shape = "SET/GET/DELETE" if args.mix else "SET"
    print(f"connection {shape} window {args.window}: {1e6 * cpu_s / args.items:.2f} us/request "
          f"({args.items:,} requests; load {load})")  # fmt: skip


if __name__ == "__main__":
    main()
