"""TLS against plain TCP on one node, in the same run: ingest, DCP, and handshakes per second.

One node process serves both listeners (``--port`` and ``--tls-port``, certificates from
``changefeed certs create``). Rounds alternate plain / TLS so that drift (page cache, a busy
neighbour) hits both alike; each workload reports its best round:

* ingest: ``KvClient.upsert_many`` of ``--items`` new 100-byte values, in windows;
* dcp: a ``DcpClient`` streams every vbucket to the latest seqno (everything ingested);
* handshakes: connections opened and closed, ``--connections`` of them, 8 at a time: the TLS
  handshake alone, and the whole set-up a client does (TCP or TLS, HELLO, SCRAM-SHA512,
  SELECT_BUCKET).

CPU is the node's (``/proc/<pid>/stat``) and this process's (``time.process_time``), in
microseconds per item (or per connection). Usage::

    .venv/bin/python bench/bench_tls.py [--items 200000] [--rounds 2] [--vbuckets 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import ClientConfig, DcpClient, KvClient
from changefeed.consumer.connection import Connection, client_tls_context
from changefeed.consumer.events import Changes, StreamEnded
from changefeed.consumer.handshake import connect

WINDOW = 20_000  # items per upsert_many call
HANDSHAKE_CONCURRENCY = 8
DEADLINE_S = 600.0
USER, PASSWORD = "Administrator", "password"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measured(pid: int, count: int, work: Callable[[], Awaitable[None]]) -> dict[str, float]:
    """Run ``work`` (``count`` items or connections); rate and CPU per unit on both sides."""
    node_cpu, client_cpu = cpu_seconds(pid), time.process_time()
    started = time.perf_counter()
    async with asyncio.timeout(DEADLINE_S):
        await work()
    seconds = time.perf_counter() - started
    node_cpu, client_cpu = cpu_seconds(pid) - node_cpu, time.process_time() - client_cpu
    return {
        "per_s": count / seconds,
        "node_us": 1e6 * node_cpu / count,
        "client_us": 1e6 * client_cpu / count,
    }


async def ingest(port: int, ca: Path | None, prefix: str, count: int) -> None:
    kv = await KvClient.connect(HOST, port, user=USER, password=PASSWORD, tls_ca=ca)
    try:
        for first in range(0, count, WINDOW):
            last = min(count, first + WINDOW)
            items = [(b"%s:%09d" % (prefix.encode(), n), b"%0100d" % n) for n in range(first, last)]
            await kv.upsert_many(items)
    finally:
        await kv.close()


async def stream_all(port: int, ca: Path | None, vbuckets: int, expected: int) -> None:
    config = ClientConfig(
        host=HOST, port=port, to_latest=True, tls_ca=None if ca is None else str(ca)
    )
    received = ended = 0
    async with DcpClient(config) as client:
        await client.stream(list(range(vbuckets)))
        async for event in client.events():
            if isinstance(event, Changes):
                received += len(event.columns.seqno)
            elif isinstance(event, StreamEnded):
                ended += 1
                if ended == vbuckets:
                    break
    assert received == expected, (received, expected)


async def handshakes(port: int, ca: Path | None, count: int, *, full: bool) -> None:
    tls = None if ca is None else client_tls_context(ca)
    left = iter(range(count))

    async def worker() -> None:
        for _ in left:
            if full:
                conn = await connect(
                    HOST, port, agent="bench-tls", user=USER, password=PASSWORD,
                    bucket="default", tls=tls,
                )  # fmt: skip
            else:
                conn = await Connection.open(HOST, port, tls=tls)
            await conn.close()

    await asyncio.gather(*(worker() for _ in range(HANDSHAKE_CONCURRENCY)))


async def run(node: NodeProcess, tls_port: int, ca: Path, args: argparse.Namespace) -> list[Any]:
    ports = {"tcp": (node.port, None), "tls": (tls_port, ca)}
    rows: dict[tuple[str, str], list[dict[str, float]]] = {}
    pid = node.pid
    ingested = 0
    for round_index in range(args.rounds):
        for transport, (port, ca_file) in ports.items():
            prefix = f"{transport}{round_index}"
            result = await measured(
                pid, args.items, lambda p=port, c=ca_file, x=prefix: ingest(p, c, x, args.items)
            )
            rows.setdefault(("ingest", transport), []).append(result)
            ingested += args.items
    for _ in range(args.rounds):
        for transport, (port, ca_file) in ports.items():
            total = ingested
            result = await measured(
                pid, total, lambda p=port, c=ca_file, t=total: stream_all(p, c, args.vbuckets, t)
            )
            rows.setdefault(("dcp", transport), []).append(result)
    for _ in range(args.rounds):
        for transport, (port, ca_file) in ports.items():
            for full, label in ((False, "connect"), (True, "connect+auth")):
                result = await measured(
                    pid,
                    args.connections,
                    lambda p=port, c=ca_file, f=full: handshakes(p, c, args.connections, full=f),
                )
                rows.setdefault((label, transport), []).append(result)
    return [(key, max(results, key=lambda r: r["per_s"]), results) for key, results in rows.items()]


def print_table(rows: list[Any], args: argparse.Namespace) -> None:
    best = {key: result for key, result, _ in rows}
    print(
        f"\nbench_tls: {args.items} items x {args.rounds} rounds per transport, 100-byte values, "
        f"{args.vbuckets} vbuckets, {args.connections} connections per handshake round "
        f"({HANDSHAKE_CONCURRENCY} at a time); best round of {args.rounds}; "
        f"{os.cpu_count()} CPUs\n"
    )
    header = (
        f"| {'workload':<13} | {'transport':<9} | {'per second':>10} | {'node CPU us':>11} "
        f"| {'client CPU us':>13} | {'TLS / TCP rate':>14} | {'rounds (per s)':<22} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    for key, result, results in rows:
        workload, transport = key
        plain = best[(workload, "tcp")]
        ratio = f"{result['per_s'] / plain['per_s']:.2f}x" if transport == "tls" else ""
        spread = ", ".join(f"{r['per_s']:,.0f}" for r in results)
        print(
            f"| {workload:<13} | {transport:<9} | {result['per_s']:>10,.0f} "
            f"| {result['node_us']:>11.2f} | {result['client_us']:>13.2f} | {ratio:>14} "
            f"| {spread:<22} |"
        )
    print("\nCPU in microseconds per item (ingest, dcp) or per connection (connect rows).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vbuckets", type=int, default=64)
    parser.add_argument("--connections", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as work:
        root = Path(work)
        result = CliRunner().invoke(
            cli, ["certs", "create", "--dir", str(root / "certs"), "--nodes", "n0"]
        )
        assert result.exit_code == 0, result.output
        tls_port = _free_port()
        node = NodeProcess(
            root / "node",
            vbuckets=args.vbuckets,
            args=[
                "--no-durable", "--log-level", "WARNING", "--tls-port", str(tls_port),
                "--tls-cert", str(root / "certs/n0.pem"), "--tls-key", str(root / "certs/n0.key"),
            ],
        )  # fmt: skip
        with node:
            rows = run_loop(run(node, tls_port, root / "certs/ca.pem", args))
        print_table(rows, args)
    sys.stdout.flush()


def run_loop(coroutine: Any) -> Any:
    """On uvloop when installed, as the node and the clients run in production."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    main()
