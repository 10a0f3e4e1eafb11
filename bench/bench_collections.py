"""Collections benchmark: a stream filtered to 1 of 10 equally written collections, against the
unfiltered stream of all 10 that the client filters itself (issue 28).

One ``--no-durable`` node process; 10 collections in one scope, ``--per`` documents each
(100-byte values), written over a collections connection in pipelined windows; then streamed
from memory (a "parked" DCP connection, cursors at seqno 0 with a 1-byte window, keeps every
checkpoint; the load is persisted before the streams start) and from disk (the node restarted,
so every stream is a backfill), alternating, ``--runs`` times each:

* filtered: ``DcpClient(collections=("bench.c3",))``, ``to_latest`` over every vbucket — the
  node sends collection 3's documents and a SEQNO_ADVANCED where it skipped the others;
* all + client filter: ``DcpClient(collections_aware=True)``, every collection's documents
  sent, the client keeping collection 3's (what a client without filters would do).

Per run: wanted items received, items sent, wall time, node CPU (from /proc) and client CPU,
node CPU per wanted item; then the ratio all / filtered of node CPU per wanted item (the goal
is >= 5: the node's cost follows the items sent, not the items skipped), and the load average.

Usage::

    .venv/bin/python bench/bench_collections.py              # 10 x 20,000 documents
    .venv/bin/python bench/bench_collections.py --quick      # 10 x 2,000, a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import struct
import tempfile
import time
from pathlib import Path

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import ClientConfig, DcpClient, KvClient, MutationResult
from changefeed.consumer.collections_admin import edit_manifest
from changefeed.consumer.connection import Connection
from changefeed.consumer.events import Changes, StreamEnded
from changefeed.consumer.handshake import connect
from changefeed.protocol.collections import encode_leb128, split_key
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.dcp import (
    DcpControl,
    DcpOpen,
    OpenFlag,
    StreamRequest,
    encode_dcp_control,
    encode_dcp_open,
    encode_stream_request,
)
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.vbmap import vbucket_for_key

USER, PASSWORD = "Administrator", "password"
VBUCKETS = 16
COLLECTIONS = 10
WANTED = 3
WINDOW = 1000


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(node: NodeProcess, per: int) -> tuple[dict[int, int], dict[int, int]]:
    """Make the collections and write `per` documents in each: their ids by index, and each
    vbucket's high seqno (its documents plus the 11 system events)."""
    features = [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON, Feature.COLLECTIONS]
    conn = await connect(
        HOST, node.port, agent="bench-collections", user=USER, password=PASSWORD,
        bucket="default", features=features,
    )  # fmt: skip
    try:

        def make(m: Manifest) -> Manifest:
            m = m.with_scope("bench")
            for i in range(COLLECTIONS):
                m = m.with_collection("bench", f"c{i}")
            return m

        manifest = await edit_manifest(conn, make)
        ids = {i: manifest.resolve(f"bench.c{i}")[1].uid for i in range(COLLECTIONS)}  # type: ignore[union-attr]
        value = b"v" * 100
        extras = struct.pack(">II", 0, 0)
        docs = [(cid, b"doc-%07d" % n) for n in range(per) for cid in ids.values()]
        highs = dict.fromkeys(range(VBUCKETS), 1 + COLLECTIONS)
        for _, key in docs:
            highs[vbucket_for_key(key, VBUCKETS)] += 1
        for start in range(0, len(docs), WINDOW):  # bounded by the documents
            frames, opaques = [], []
            for cid, key in docs[start : start + WINDOW]:
                opaque = conn.next_opaque()
                opaques.append(opaque)
                frames.append(
                    encode_request(
                        Opcode.SET, opaque=opaque, vbucket=vbucket_for_key(key, VBUCKETS),
                        extras=extras, key=encode_leb128(cid) + key, value=value,
                    )
                )  # fmt: skip
            replies = await conn.request_batch(b"".join(frames), opaques, timeout_s=60)
            assert all(r.status == 0 for r in replies), replies[0]
        return ids, highs
    finally:
        await conn.close()


async def park(node: NodeProcess) -> Connection:
    """Streams of every vbucket from seqno 0 with a 1-byte window, never acked: their cursors
    stay at 0, so the checkpoints keep everything loaded after them (bench_node.py's trick)."""
    conn = await connect(
        HOST, node.port, agent="bench:parked", user=USER, password=PASSWORD, bucket="default"
    )
    for request in (
        encode_dcp_open(DcpOpen(conn.next_opaque(), "bench:parked", OpenFlag.PRODUCER)),
        encode_dcp_control(DcpControl(conn.next_opaque(), "connection_buffer_size", "1")),
        *(
            encode_stream_request(StreamRequest(vb, conn.next_opaque(), 0, 0, 2**64 - 1, 0, 0, 0))
            for vb in range(VBUCKETS)
        ),
    ):
        opaque = int.from_bytes(request[12:16], "big")
        answer = await conn.request(request, opaque, timeout_s=30)
        assert answer.status == 0, answer
    return conn


async def wait_persisted(node: NodeProcess, highs: dict[int, int]) -> None:
    async with await KvClient.connect(HOST, node.port, user=USER, password=PASSWORD) as kv:
        for vb, high in highs.items():
            await kv.wait_persisted(MutationResult(vbucket=vb, seqno=high, cas=0, vb_uuid=0))


async def stream(node: NodeProcess, config: ClientConfig, wanted_id: int) -> dict[str, float]:
    sent = wanted = 0
    node_cpu, client_cpu, t0 = cpu_seconds(node.pid), time.process_time(), time.perf_counter()
    async with DcpClient(config) as client:
        await client.stream(list(range(VBUCKETS)))
        ended = 0
        async for event in client.events():
            if isinstance(event, Changes):
                keys = event.columns.key
                sent += len(keys)
                wanted += sum(1 for k in keys if split_key(k)[0] == wanted_id)  # client filter
            elif isinstance(event, StreamEnded):
                ended += 1
                if ended == VBUCKETS:
                    break
    wall = time.perf_counter() - t0
    node_s = cpu_seconds(node.pid) - node_cpu
    return {
        "wanted": wanted,
        "sent": sent,
        "wall_s": wall,
        "node_cpu_s": node_s,
        "client_cpu_s": time.process_time() - client_cpu,
        "node_us_per_wanted": node_s / max(wanted, 1) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per", type=int, default=20_000, help="documents per collection")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--only", choices=("filtered", "all + client filter"), help="stream one kind (profiling)"
    )
    args = parser.parse_args()
    per = 2_000 if args.quick else args.per
    rows: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-collections-") as tmp:
        args_node = ["--no-durable", "--checkpoint-quota-bytes", str(2**30)]
        node = NodeProcess(Path(tmp) / "node", vbuckets=VBUCKETS, args=args_node)
        node.start()
        try:
            t0 = time.perf_counter()
            load_s = 0.0

            async def memory_phase() -> dict[int, int]:
                """Park, load, wait for the flusher, then stream from memory (one loop, so
                the parked connection lives through the streams)."""
                parked = await park(node)
                try:
                    ids, highs = await load(node, per)
                    await wait_persisted(node, highs)
                    nonlocal load_s
                    load_s = time.perf_counter() - t0
                    await streams("memory", ids[WANTED])
                finally:
                    await parked.close()
                return ids

            async def streams(source: str, wanted_id: int) -> None:
                base = {"host": HOST, "port": node.port, "to_latest": True}
                configs = {
                    "filtered": ClientConfig(**base, collections=(f"bench.c{WANTED}",)),  # type: ignore[arg-type]
                    "all + client filter": ClientConfig(**base, collections_aware=True),  # type: ignore[arg-type]
                }
                for _ in range(args.runs):  # alternate, so both see the same load
                    for name, config in configs.items():
                        if args.only is not None and name != args.only:
                            continue
                        result = await stream(node, config, wanted_id)
                        rows.setdefault(f"{source}: {name}", []).append(result)

            ids = asyncio.run(memory_phase())
            node.restart(clean=True)  # every stream below is a disk backfill
            asyncio.run(streams("disk", ids[WANTED]))
        finally:
            node.stop()
    print(
        f"collections benchmark: {COLLECTIONS} collections x {per:,} documents (100 B), "
        f"{VBUCKETS} vbuckets; load and persist {COLLECTIONS * per:,} docs in {load_s:.1f} s"
    )
    print(
        f"{'stream':30} {'wanted':>8} {'sent':>9} {'wall s':>7} {'node cpu s':>10} "
        f"{'client cpu s':>12} {'node us/wanted':>14}  (median of {args.runs})"
    )
    medians = {}
    for name, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        medians[name] = med
        print(
            f"{name:30} {med['wanted']:>8,.0f} {med['sent']:>9,.0f} {med['wall_s']:>7.2f} "
            f"{med['node_cpu_s']:>10.2f} {med['client_cpu_s']:>12.2f} "
            f"{med['node_us_per_wanted']:>14.1f}"
        )
    for source in ("memory", "disk") if args.only is None else ():
        all_, one = medians[f"{source}: all + client filter"], medians[f"{source}: filtered"]
        ratio = all_["node_us_per_wanted"] / one["node_us_per_wanted"]
        both = (all_["node_cpu_s"] + all_["client_cpu_s"]) / (
            one["node_cpu_s"] + one["client_cpu_s"]
        )
        print(
            f"{source}: node CPU per wanted item, all / filtered: {ratio:.1f}x (goal >= 5x); "
            f"node + client CPU: {both:.1f}x"
        )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
