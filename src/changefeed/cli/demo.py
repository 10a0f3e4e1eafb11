"""``changefeed demo``: the main job on the embedded single-node default.

What it runs today (the foundation): a realistic workload (inserts, updates, deletes) written
into a durable vbucket store in group-committed batches, then every vbucket streamed back as DCP
frames straight from the stored bodies, decoded in batches, and checked key by key against the
workload's own model. It prints rates and where the data is. Later stages (node server, Spark
mirror) extend this command; its shape — load, stream, verify, report — stays.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from changefeed.protocol.dcp_items import encode_item_body
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import FrameReader
from changefeed.storage import Op, Store
from changefeed.vbmap import vbucket_for_key

_OPCODE_OF = {Op.MUTATION: Opcode.DCP_MUTATION, Op.DELETION: Opcode.DCP_DELETION}


@dataclass
class _Workload:
    """The demo's reference model: the final value (or None = deleted) of every key."""

    vbuckets: int
    final: dict[bytes, bytes | None] = field(default_factory=dict)
    seqnos: dict[int, int] = field(default_factory=dict)

    def next_seqno(self, vb: int) -> int:
        self.seqnos[vb] = self.seqnos.get(vb, 0) + 1
        return self.seqnos[vb]


def _load(store: Store, work: _Workload, items: int, seed: int, console: Console) -> float:
    rng = random.Random(seed)
    keys: list[bytes] = []
    batch_size = 1000
    started = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("loading", total=items)
        for first in range(0, items, batch_size):
            with store.write_batch() as batch:
                for _ in range(min(batch_size, items - first)):
                    roll = rng.random()
                    if keys and roll < 0.1:
                        key = rng.choice(keys)
                        vb = vbucket_for_key(key, work.vbuckets)
                        batch.delete(vb, key, work.next_seqno(vb), cas=rng.getrandbits(48) + 1)
                        work.final[key] = None
                        continue
                    if keys and roll < 0.3:
                        key = rng.choice(keys)
                    else:
                        key = b"user::%08d" % len(keys)
                        keys.append(key)
                    vb = vbucket_for_key(key, work.vbuckets)
                    value = b'{"v":%d,"pad":"%s"}' % (rng.getrandbits(32), b"x" * 80)
                    batch.set(vb, key, work.next_seqno(vb), value, cas=rng.getrandbits(48) + 1)
                    work.final[key] = value
            progress.advance(task, min(batch_size, items - first))
    return time.perf_counter() - started


def _stream_back(store: Store, work: _Workload) -> tuple[dict[bytes, bytes | None], int, float]:
    """Backfill every vbucket as DCP frames and decode them, like a consumer would."""
    seen: dict[bytes, bytes | None] = {}
    frames = 0
    started = time.perf_counter()
    for vb in range(work.vbuckets):
        reader = FrameReader()
        pieces: list[bytes | memoryview] = []
        for record in store.scan(vb, 1, work.seqnos.get(vb, 0)):
            pieces += encode_item_body(
                _OPCODE_OF.get(record.op, Opcode.DCP_EXPIRATION),
                vbucket=vb,
                opaque=vb,
                cas=record.cas,
                datatype=record.datatype,
                extras_len=record.extras_len,
                key_len=len(record.key),
                body=record.body,
            )
        reader.feed(b"".join(pieces))
        batch = reader.read_batch()
        columns = batch.changes
        frames += len(columns)
        for opcode, key, value in zip(columns.opcode, columns.key, columns.value, strict=True):
            seen[key] = value if opcode == Opcode.DCP_MUTATION else None
    return seen, frames, time.perf_counter() - started


@click.command()
@click.option("--items", default=200_000, show_default=True, help="Changes to write.")
@click.option("--vbuckets", default=64, show_default=True, help="Partitions of the bucket.")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Keep the data here.")
@click.option("--seed", default=1, show_default=True, help="Workload random seed.")
def demo(items: int, vbuckets: int, data_dir: Path | None, seed: int) -> None:
    """Load a workload into the embedded store, stream it back as DCP, verify, report."""
    console = Console()
    keep = data_dir is not None
    path = data_dir or Path(tempfile.mkdtemp(prefix="changefeed-demo-"))
    work = _Workload(vbuckets)
    try:
        with Store(path / "default", durable=False) as store:
            load_s = _load(store, work, items, seed, console)
            seen, frames, stream_s = _stream_back(store, work)
        expected = {k: v for k, v in work.final.items() if v is not None}
        got = {k: v for k, v in seen.items() if v is not None}
        if got != expected:
            raise click.ClickException(f"verification failed: {len(got)} vs {len(expected)} keys")
        table = Table(title="changefeed demo (embedded single node)")
        table.add_column("step")
        table.add_column("result", justify="right")
        table.add_row("changes written", f"{items:,} in {load_s:.2f} s ({items / load_s:,.0f}/s)")
        table.add_row("DCP frames streamed", f"{frames:,} in {stream_s:.2f} s")
        table.add_row("stream rate", f"{frames / stream_s:,.0f} items/s")
        table.add_row(
            "live keys verified", f"{len(expected):,} (deleted: {len(seen) - len(got):,})"
        )
        table.add_row("data", str(path) if keep else "(temporary, removed)")
        console.print(table)
    finally:
        if not keep:
            shutil.rmtree(path, ignore_errors=True)
