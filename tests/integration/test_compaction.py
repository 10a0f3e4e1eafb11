"""Compaction on a real node: the purge seqno rule end to end, and the schedule.

``test_a_consumer_below_the_purge_seqno_rolls_back_to_0_and_ends_equal_to_the_store``:

1. write documents with flags, expiry, datatype; delete some in every vbucket (old tombstones);
2. a consumer streams everything and keeps its session S1;
3. more deletes and updates in vbuckets 0 and 1, only updates in 2 and 3 (new tombstones);
4. ``changefeed compact --purge-age 0``: every tombstone goes; vbuckets 0 and 1 now have a purge
   seqno above S1's seqno, 2 and 3 one below it (STAT and /metrics say so; V2.2 markers carry it);
5. the consumer resumes from S1: the node tells it to roll back to 0 in vbuckets 0 and 1 only
   (dcp-wire.md §9.1 rule 2), and it ends equal to the store, read directly once the node has
   stopped: keys, values, and every piece of metadata (seqno, rev_seqno, CAS, flags, expiry,
   datatype, deletion or expiration).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from changefeed.cli.main import cli
from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import (
    Changes,
    DcpClient,
    Event,
    Rollback,
    SessionState,
    Snapshot,
    StreamEnded,
)
from changefeed.protocol.opcode import Opcode
from changefeed.storage import Op, Record, Store
from support.clients import HOST, dcp_config, free_port, kv_connect, raw_connection, stats
from support.consumer import all_ended, drain
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(120)

VBUCKETS = 4
OPCODE_OF_OP = {Op.MUTATION: Opcode.DCP_MUTATION, Op.DELETION: Opcode.DCP_DELETION}
OPCODE_OF_OP[Op.EXPIRATION] = Opcode.DCP_EXPIRATION


@dataclass(frozen=True, slots=True)
class Row:
    """A key's newest version with every field a consumer can compare with the store."""

    opcode: int
    seqno: int
    rev_seqno: int
    cas: int
    flags: int
    expiry: int
    datatype: int
    value: bytes


@dataclass
class MetadataState:
    """What a consumer holds: every change per vbucket, rollbacks applied (``drain`` feeds it)."""

    history: dict[int, list[tuple[bytes, Row]]] = field(default_factory=dict)
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    ended: dict[int, int] = field(default_factory=dict)
    purge_seqnos: dict[int, int] = field(default_factory=dict)  # from V2.2 markers

    def apply(self, event: Event) -> None:
        if isinstance(event, Changes):
            cols = event.columns
            for i in range(len(cols)):
                row = Row(
                    cols.opcode[i], cols.seqno[i], cols.rev_seqno[i], cols.cas[i], cols.flags[i],
                    cols.expiry[i], cols.datatype[i], cols.value[i],
                )  # fmt: skip
                changes = self.history.setdefault(cols.vbucket[i], [])
                assert not changes or changes[-1][1].seqno < row.seqno, (changes[-1], row)
                changes.append((cols.key[i], row))
        elif isinstance(event, Rollback):
            self.rollbacks.append((event.vbucket, event.seqno))
            kept = [c for c in self.history.get(event.vbucket, []) if c[1].seqno <= event.seqno]
            self.history[event.vbucket] = kept
        elif isinstance(event, Snapshot):
            self.purge_seqnos[event.vbucket] = event.purge_seqno
        elif isinstance(event, StreamEnded):
            self.ended[event.vbucket] = int(event.reason)

    def latest(self) -> dict[bytes, Row]:
        return {key: row for changes in self.history.values() for key, row in changes}


class MarkerV22Client(DcpClient):
    """A DcpClient that asks for V2.2 snapshot markers (they carry the purge seqno)."""

    def _controls(self) -> list[tuple[str, str]]:
        return [*super()._controls(), ("max_marker_version", "2.2")]


def store_state(data_dir: Path) -> dict[bytes, Row]:
    """The truth: every record in the stopped node's store, as a consumer would hold it."""
    with Store(data_dir / "default", durable=False) as store:
        return {
            record.key: row_of(record)
            for vb in range(VBUCKETS)
            for record in store.scan(vb, 0, store.high_seqno(vb))
        }


def row_of(record: Record) -> Row:
    opcode = OPCODE_OF_OP[record.op]
    meta = (record.rev_seqno, record.cas, record.flags, record.expiry, record.datatype)
    return Row(opcode, record.seqno, *meta, record.value)


def node_config(node_root: Path, **values: float) -> list[str]:
    path = node_root.parent / f"{node_root.name}.toml"
    path.write_text("".join(f"{key} = {value}\n" for key, value in values.items()))
    return ["--config", str(path)]


async def stream(
    node: NodeProcess,
    state: MetadataState,
    start: str | SessionState,
    client_class: type[DcpClient] = DcpClient,
) -> SessionState:
    state.ended.clear()
    vbs = list(range(VBUCKETS))
    async with client_class(dcp_config(node)) as client:
        await client.stream(vbs, start=start)  # type: ignore[arg-type]
        await drain(client, state, all_ended(vbs), timeout_s=30)  # type: ignore[arg-type]
        return SessionState.from_json(client.session.to_json())


async def seqno_stats(node: NodeProcess) -> dict[str, str]:
    conn = await raw_connection(node)
    try:
        return await stats(conn, "vbucket-seqno")
    finally:
        await conn.close()


async def http_metrics(port: int) -> str:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(b"GET /metrics HTTP/1.0\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return raw.partition(b"\r\n\r\n")[2].decode()


def keys_per_vbucket(vbucket_of: object, count: int) -> dict[int, list[bytes]]:
    out: dict[int, list[bytes]] = {vb: [] for vb in range(VBUCKETS)}
    for i in range(count):
        key = b"doc-%04d" % i
        out[vbucket_of(key)].append(key)  # type: ignore[operator]
    return out


async def write_phase_one(node: NodeProcess) -> dict[int, list[bytes]]:
    async with await kv_connect(node) as kv:
        keys = keys_per_vbucket(kv.vbucket_of, 120)
        for vb_keys in keys.values():
            for i, key in enumerate(vb_keys):
                json_value = i % 2 == 0
                value = b'{"i": %d}' % i if json_value else b"raw-%d" % i
                await kv.upsert(
                    key, value, flags=0xF000 + i, expiry=10 * 24 * 3600 if i % 3 else 0,
                    datatype=1 if json_value else 0,
                )  # fmt: skip
            for key in vb_keys[:3]:
                await kv.remove(key, durability="persist")
    return keys


async def write_phase_two(node: NodeProcess, keys: dict[int, list[bytes]]) -> None:
    async with await kv_connect(node) as kv:
        for vb, vb_keys in keys.items():
            if vb in (0, 1):
                for key in vb_keys[3:8]:
                    await kv.remove(key)
            for key in vb_keys[8:13]:
                await kv.upsert(key, b"updated", flags=7, expiry=20 * 24 * 3600)
            await kv.upsert(vb_keys[-1], b"last", durability="persist")


def compact_with_the_cli(node: NodeProcess) -> dict[str, object]:
    result = CliRunner().invoke(
        cli, ["compact", "--port", str(node.port), "--purge-age", "0", "--json"]
    )
    assert result.exit_code == 0, result.output
    answer: dict[str, object] = json.loads(result.output)
    return answer


def test_a_consumer_below_the_purge_seqno_rolls_back_to_0_and_ends_equal_to_the_store(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    metrics_port = free_port()
    config = node_config(tmp_path / "node0", compaction_interval_s=0, expiry_pager_interval_s=0)
    node = nodes(vbuckets=VBUCKETS, args=[*config, "--metrics-port", str(metrics_port)])
    consumer = MetadataState()

    keys = asyncio.run(write_phase_one(node))
    session1 = asyncio.run(stream(node, consumer, "beginning"))
    s1_seqnos = {vb: session1.get(vb).seqno for vb in range(VBUCKETS)}
    asyncio.run(write_phase_two(node, keys))

    answer = compact_with_the_cli(node)
    assert answer["vbuckets"] == VBUCKETS
    assert answer["purged"] == 3 * VBUCKETS + 5 * 2  # every tombstone: purge age 0
    purge_seqnos = {int(vb): s for vb, s in answer["purge_seqnos"].items()}  # type: ignore[attr-defined]
    for vb in range(VBUCKETS):
        below = purge_seqnos[vb] > s1_seqnos[vb]
        assert below == (vb in (0, 1)), (vb, purge_seqnos[vb], s1_seqnos[vb])

    async def check_and_resume() -> None:
        seqnos = await seqno_stats(node)
        for vb in range(VBUCKETS):
            assert int(seqnos[f"vb_{vb}:purge_seqno"]) == purge_seqnos[vb]  # live, not 0
        body = await http_metrics(metrics_port)
        for vb in range(VBUCKETS):
            line = f'changefeed_purge_seqno{{vbucket="{vb}"}} {float(purge_seqnos[vb])}'
            assert line in body, line
        assert re.search(r"^changefeed_compaction_tombstones_purged_total 22\.0$", body, re.M)
        assert re.search(r"^changefeed_compaction_requests_total 4\.0$", body, re.M)
        # A fresh V2.2 reader is told the purge seqno in its markers (taken at stream start).
        fresh = MetadataState()
        await stream(node, fresh, "beginning", MarkerV22Client)
        assert fresh.purge_seqnos == purge_seqnos
        # The consumer resumes from S1.
        await stream(node, consumer, session1)

    asyncio.run(check_and_resume())
    assert sorted(consumer.rollbacks) == [(0, 0), (1, 0)]
    node.stop()
    truth = store_state(node.data_dir)
    assert len(truth) == 120 - 3 * VBUCKETS - 5 * 2  # purged tombstones are gone for good
    assert all(row.opcode == Opcode.DCP_MUTATION for row in truth.values())
    assert consumer.latest().keys() - truth.keys() == _deleted(consumer.latest())
    live = {key: row for key, row in consumer.latest().items() if row.opcode == Opcode.DCP_MUTATION}
    assert live == truth  # keys, values and every piece of metadata
    assert node.errors_in_log() == []


def _deleted(rows: dict[bytes, Row]) -> set[bytes]:
    """Keys the consumer holds as deleted: tombstones it saw before the purge (vbuckets 2 and 3
    kept their old deletes, which were below its position, so no rollback told it otherwise)."""
    return {key for key, row in rows.items() if row.opcode != Opcode.DCP_MUTATION}


def test_scheduled_compaction_purges_by_age(nodes: NodeFactory, tmp_path: Path) -> None:
    config = node_config(
        tmp_path / "node0",
        compaction_interval_s=0.2,
        tombstone_purge_age_s=0,
        expiry_pager_interval_s=0,
    )
    node = nodes(vbuckets=VBUCKETS, args=config)

    async def scenario() -> dict[str, str]:
        async with await kv_connect(node) as kv:
            written = [await kv.upsert(b"k-%d" % i, b"v") for i in range(40)]
            deleted = [await kv.remove(b"k-%d" % i) for i in range(0, 40, 4)]
            # A live write after the deletes in every vbucket: the record at a vbucket's high
            # seqno is never purged (compactor._purge_ceiling).
            after = [await kv.upsert(b"after-%d" % i, b"v") for i in range(8 * VBUCKETS)]
            await kv.upsert(b"after", b"v", durability="persist")
        wanted = _max_per_vb(deleted)
        assert set(wanted) <= {r.vbucket for r in after}
        assert wanted and written
        conn = await raw_connection(node)
        try:
            async with asyncio.timeout(20):
                while True:
                    seqnos = await stats(conn, "vbucket-seqno")
                    if all(int(seqnos[f"vb_{vb}:purge_seqno"]) >= s for vb, s in wanted.items()):
                        return await stats(conn, "")
                    await asyncio.sleep(0.1)
        finally:
            await conn.close()

    general = asyncio.run(scenario())
    assert int(general["compaction_runs"]) >= 1
    assert int(general["compaction_tombstones_purged"]) == 10
    assert general["compaction_tombstone_purge_age_s"] == "0"
    assert "compaction: purged" in node.log_text()
    assert node.errors_in_log() == []


def _max_per_vb(results: Iterable[object]) -> dict[int, int]:
    out: dict[int, int] = {}
    for result in results:
        vb, seqno = result.vbucket, result.seqno  # type: ignore[attr-defined]
        out[vb] = max(out.get(vb, 0), seqno)
    return out
