"""CPU per request of a real `ClientConnection` in process, fed whole windows through
`data_received` (no socket, no flusher running: every vbucket flushed every 64 windows,
outside the clock), to compare trees without a node's noise: the connection's framing, runs,
request windows and replies plus the bucket below them. Shapes from bench_raw_clients.py:
plain SETs in windows of `--window`, or (`--mix`) SET/GET/DELETE 2:1:1 with every GET and
DELETE on a key set at least a window earlier (keys repeat, so most DELETEs and some GETs
answer KEY_NOT_FOUND: the mix times those paths too). The answers' statuses are counted after
the clock and printed; a SET that is not answered SUCCESS ends the run with an error. Run two
trees alternately with PYTHONPATH.

    .venv/bin/python bench/bench_connection_window.py --window 16 --items 64000
    .venv/bin/python bench/bench_connection_window.py --window 2000 --items 64000 --mix
"""

from __future__ import annotations

import argparse
import asyncio
import os
import struct
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from changefeed.protocol.kv import StoreCommand, encode_request, encode_store
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import encode_plain
from changefeed.server.bucket import Bucket
from changefeed.server.config import NodeConfig
from changefeed.server.connection import ClientConnection
from changefeed.server.context import ServerContext
from changefeed.server.users import Users
from changefeed.vbmap import vbucket_for_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_raw_clients import operations

from support.transports import RecordingTransport

VBUCKETS = 64


class Sink(RecordingTransport):
    """The tests' recording transport, keeping a `writelines` call's pieces as they are (no
    join on the clock); the answers are read after the clock."""

    def writelines(self, data: list[bytes]) -> None:
        self.writes.extend(data)

    def statuses(self) -> Counter[tuple[int, int]]:
        """(opcode, status) of every response written, counted."""
        out = self.data
        counts: Counter[tuple[int, int]] = Counter()
        at = 0
        while at + 24 <= len(out):
            _, opcode, _, _, _, status, body = struct.unpack_from(">BBHBBHI", out, at)
            counts[(opcode, status)] += 1
            at += 24 + body
        return counts


def key_of(n: int) -> bytes:
    return b"key%012d" % n


def request(op: str, n: int, opaque: int) -> bytes:
    key = key_of(n)
    vb = vbucket_for_key(key, VBUCKETS)
    if op == "set":
        return encode_store(StoreCommand(Opcode.SET, vb, opaque, key, b"%0100d" % n))
    code = Opcode.GET if op == "get" else Opcode.DELETE
    return encode_request(code, opaque=opaque, vbucket=vb, key=key)


async def measure(
    window: int, items: int, mix: bool, data_dir: Path
) -> tuple[float, Counter[tuple[int, int]]]:
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
    while not sink.writes:
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
        for _ in range(100):  # answers a loop step away (none expected: no durable writes)
            if sum(sink.statuses().values()) >= items + 2:
                break
            await asyncio.sleep(0.01)
    finally:
        conn.close()
        for vbucket in bucket.vbuckets.values():
            vbucket.close()
        bucket.store.close()
    return cpu_s, sink.statuses()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--items", type=int, default=64_000)
    parser.add_argument("--mix", action="store_true", help="SET/GET/DELETE 2:1:1")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cpu_s, statuses = asyncio.run(measure(args.window, args.items, args.mix, Path(tmp)))
    names = {int(Opcode.SET): "SET", int(Opcode.GET): "GET", int(Opcode.DELETE): "DELETE"}
    answered = {
        f"{names[opcode]} 0x{status:02x}": count
        for (opcode, status), count in sorted(statuses.items())
        if opcode in names
    }
    print(f"answers: {answered}")
    failed_sets = sum(c for (op, st), c in statuses.items() if op == Opcode.SET and st != 0)
    if sum(answered.values()) != args.items or failed_sets:
        total = sum(answered.values())
        raise SystemExit(
            f"error: {total} answers of {args.items}, {failed_sets} SETs not SUCCESS: "
            "the tree did not do the work timed"
        )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    shape = "SET/GET/DELETE" if args.mix else "SET"
    print(f"connection {shape} window {args.window}: {1e6 * cpu_s / args.items:.2f} us/request "
          f"({args.items:,} requests; load {load})")  # fmt: skip


if __name__ == "__main__":
    main()
