"""``changefeed stream --state S --output F`` killed with SIGKILL loses nothing and repeats at most
its last batch.

The command appends to F and saves S atomically after each batch it has written and synced
(a batch: what arrived since the last commit, at most ``COMMIT_LINES_MAX`` lines plus one read),
so after a crash S is never ahead of F, and F is ahead of S by at most one batch. The
scenario: a first run streams to the latest seqnos; then ``--follow`` runs are killed with
SIGKILL while the node takes writes (the first one during a large backfill); a last run
finishes. Checked against a fresh DCP stream of the node (the truth), field by field:

* every line of F is whole JSON, and the lines past what S said at a kill form a suffix of F at
  that moment, no longer than one batch (the "last batch twice");
* without those suffixes, seqnos rise strictly per vbucket (every change at most once);
* every change the truth holds is in F once, with every field equal; a change in F that the
  truth no longer holds was superseded by a later change of its key (deduplication), so the
  newest change per key in F equals the truth's, every field.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from changefeed.cli.client_commands import COMMIT_LINES_MAX
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer import Changes, DcpClient
from changefeed.consumer.connection import READ_CHUNK_BYTES
from changefeed.protocol.opcode import Opcode
from support.clients import dcp_config, kv_connect, upsert_retrying
from support.consumer import StreamedState, all_ended, drain
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(300)

VBUCKETS = 8
BACKFILL_KEYS = 20_000  # written before the first --follow run: it is killed mid-backfill
CHUNK_KEYS = 400  # written while a --follow run streams
STATE_MOVE_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 120.0
# The batch a crash may repeat: the lines since the last commit, which comes after at most
# COMMIT_LINES_MAX lines plus the rest of one socket read (READ_CHUNK_BYTES, plus the frame
# that straddled the previous read, of items of at least a 24-byte header + 31 bytes of
# extras + a key of 11 bytes).
BATCH_LINES_MAX = COMMIT_LINES_MAX + (READ_CHUNK_BYTES + 64 * 1024) // (24 + 31 + 11)
OPS = {
    Opcode.DCP_MUTATION: "mutation",
    Opcode.DCP_DELETION: "deletion",
    Opcode.DCP_EXPIRATION: "expiration",
}


@dataclass
class Kill:
    """What was on disk when a --follow run was killed."""

    lines: int  # lines of the output file when the next run started
    state: dict[int, int]  # vb -> seqno, as the state file said


@dataclass
class Workload:
    rng: random.Random
    keys: list[bytes] = field(default_factory=list)
    written: int = 0

    async def write(self, node: NodeProcess, count: int) -> None:
        """``count`` changes: new keys, rewrites and deletes, with varied flags and expiry."""
        async with await kv_connect(node) as kv:
            fresh = [(b"key-%07d" % (self.written + n), self._value()) for n in range(count)]
            await upsert_retrying(kv, fresh)
            self.keys.extend(key for key, _ in fresh)
            self.written += count
            for key in self.rng.sample(self.keys, min(len(self.keys), count // 4)):
                meta = {"flags": self.rng.randrange(2**32), "expiry": self.rng.choice([0, 2**31])}
                await kv.upsert(key, self._value(), **meta)
            for key in self.rng.sample(self.keys, min(len(self.keys), count // 10)):
                self.keys.remove(key)
                await kv.remove(key)

    def _value(self) -> bytes:
        if self.rng.random() < 0.2:
            return self.rng.randbytes(self.rng.randrange(1, 40))  # not UTF-8: base64 in F
        return b'{"n":%d}' % self.rng.randrange(10**9)


def stream_command(node: NodeProcess, state: Path, output: Path, *flags: str) -> list[str]:
    return [
        sys.executable, "-m", "changefeed", "stream", "--host", HOST, "--port", str(node.port),
        "--state", str(state), "--output", str(output), *flags,
    ]  # fmt: skip


def run_to_latest(node: NodeProcess, state: Path, output: Path) -> None:
    result = subprocess.run(
        stream_command(node, state, output, "--to-latest"),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def state_seqnos(state: Path) -> dict[int, int]:
    if not state.exists():
        return {}
    return {int(vb): entry["seqno"] for vb, entry in json.loads(state.read_text()).items()}


def line_count(output: Path) -> int:
    return output.read_bytes().count(b"\n") if output.exists() else 0


async def follow_and_kill(
    node: NodeProcess, workload: Workload, state: Path, output: Path, backfill: bool
) -> Kill:
    """Start a --follow run, write while it streams, SIGKILL it once its state file moved."""
    before = state_seqnos(state)
    if backfill:
        await workload.write(node, BACKFILL_KEYS)
    process = subprocess.Popen(
        stream_command(node, state, output, "--follow"),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + STATE_MOVE_TIMEOUT_S
        chunks = 0
        while state_seqnos(state) == before:  # bounded by the deadline
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "the state file did not move while streaming"
            if not backfill and chunks < 20:
                await workload.write(node, CHUNK_KEYS)
                chunks += 1
            await asyncio.sleep(0.01)
        if not backfill:
            await workload.write(node, CHUNK_KEYS)  # still writing when the kill comes
        await asyncio.sleep(workload.rng.uniform(0, 0.05))
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the stream's own group: only what we started
        process.wait(10)
        if process.stderr is not None:
            process.stderr.close()
    return Kill(lines=line_count(output), state=state_seqnos(state))


def record(cols: Any, i: int) -> dict[str, Any]:
    """What a line of the output holds for change ``i``, built here from the wire columns."""
    value = cols.value[i]
    try:
        text = value.decode()
    except UnicodeDecodeError:
        text = "base64:" + base64.b64encode(value).decode()
    return {
        "vb": cols.vbucket[i],
        "seqno": cols.seqno[i],
        "op": OPS[cols.opcode[i]],
        "key": cols.key[i].decode(),
        "cas": cols.cas[i],
        "rev_seqno": cols.rev_seqno[i],
        "flags": cols.flags[i],
        "expiry": cols.expiry[i],
        "delete_time": cols.delete_time[i],
        "datatype": cols.datatype[i],
        "value": text,
    }


async def truth(node: NodeProcess) -> list[dict[str, Any]]:
    """Every change a fresh stream of every vbucket to its high seqno delivers."""
    records: list[dict[str, Any]] = []

    def keep(event: Any) -> None:
        if isinstance(event, Changes):
            records.extend(record(event.columns, i) for i in range(len(event.columns)))

    vbs = list(range(node.vbuckets))
    async with DcpClient(dcp_config(node)) as client:
        await client.stream(vbs)
        await drain(client, StreamedState(), all_ended(vbs), per_event=keep)
    return records


def check_output(lines: list[str], kills: list[Kill], expected: list[dict[str, Any]]) -> None:
    records = [json.loads(line) for line in lines]  # every line whole JSON
    assert all(r["op"] != "rollback" for r in records)  # the node never restarted
    repeated: set[int] = set()
    for kill in kills:
        # Lines past the state at the kill: a suffix of what the file held, one batch at most.
        ahead = [
            n
            for n in range(kill.lines)
            if records[n]["seqno"] > kill.state.get(records[n]["vb"], 0)
        ]
        assert ahead == list(range(kill.lines - len(ahead), kill.lines)), ahead[:20]
        assert len(ahead) <= BATCH_LINES_MAX, len(ahead)
        repeated.update(ahead)
        print(f"killed at {kill.lines} lines, {len(ahead)} of them past the state")
        # The next run resumed exactly at the state: its first line of each vb is past it.
        first_after: dict[int, int] = {}
        for r in records[kill.lines :]:
            first_after.setdefault(r["vb"], r["seqno"])
        for vb, seqno in first_after.items():
            assert seqno > kill.state.get(vb, 0), (vb, seqno, kill.state.get(vb))
    once = [r for n, r in enumerate(records) if n not in repeated]
    last: dict[int, int] = {}
    for r in once:
        assert r["seqno"] > last.get(r["vb"], 0), f"vb {r['vb']}: seqno {r['seqno']} twice"
        last[r["vb"]] = r["seqno"]
    by_position = {(r["vb"], r["seqno"]): r for r in once}
    missing = [r for r in expected if by_position.get((r["vb"], r["seqno"])) != r]
    assert not missing, f"{len(missing)} changes missing or different, e.g. {missing[:3]}"
    newest = {r["key"]: r for r in once}
    assert newest == {r["key"]: r for r in expected}


def test_stream_killed_mid_way_resumes_without_loss(
    nodes: NodeFactory, rng: random.Random, tmp_path: Path
) -> None:
    node = nodes(vbuckets=VBUCKETS, args=["--no-durable"])
    state, output = tmp_path / "state.json", tmp_path / "changes.jsonl"
    workload = Workload(rng)

    async def scenario() -> None:
        await workload.write(node, 3000)
        run_to_latest(node, state, output)
        first = line_count(output)
        assert first >= 3000 * 0.9, first
        kills = [
            await follow_and_kill(node, workload, state, output, backfill=True),
            await follow_and_kill(node, workload, state, output, backfill=False),
        ]
        await workload.write(node, 1000)
        run_to_latest(node, state, output)
        assert output.read_bytes().endswith(b"\n")
        check_output(output.read_text().splitlines(), kills, await truth(node))

    asyncio.run(scenario())
    assert node.errors_in_log() == []
