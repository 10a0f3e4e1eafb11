"""``changefeed stream --state S --output F`` killed with SIGKILL loses nothing and writes every
change once.

The command appends to F and saves S atomically after each batch it has written and synced
(a batch: what arrived since the last commit, at most ``COMMIT_LINES_MAX`` lines plus one read),
with F's length then, so after a crash S is never ahead of F, and F is ahead of S by at most one
batch; a rerun cuts F back to the length S names and streams that batch again. The scenario: a
first run streams to the latest seqnos; then ``--follow`` runs are killed with SIGKILL while the
node takes writes (the first one during a large backfill); a last run finishes. Checked against
a fresh DCP stream of the node (the truth), field by field:

* at each kill, every line of F is whole JSON but maybe the last, the lines past what S said
  form a suffix of F, no longer than one batch, and S's length of F is where that suffix
  starts; the next run keeps F up to there, byte for byte, and starts each vbucket past S;
* in the final F, seqnos rise strictly per vbucket (every change at most once, even the ones a
  killed run had written past its state);
* every change the truth holds is in F, with every field equal; a change in F that the truth no
  longer holds was superseded by a later change of its key (deduplication), so the newest
  change per key in F equals the truth's, every field.

(The runs used to keep the lines past S. A run killed soon after its first commit, before it
streamed past them again in every vbucket, then left lines far from F's end that its S did not
cover: the flake that ``test_stream_rerun_cut.py`` reproduces deterministically.)
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

    output: bytes  # the output file as the kill left it
    state: dict[int, int]  # vb -> seqno, as the state file said
    committed: int  # the output's length the state file says was synced


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


def run_to_latest(node: NodeProcess, state: Path, output: Path, *flags: str) -> None:
    """One `changefeed stream --to-latest` run that must succeed (also test_stream_rerun_cut)."""
    result = subprocess.run(
        stream_command(node, state, output, "--to-latest", *flags),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def read_state(state: Path) -> tuple[dict[int, int], int]:
    """vb -> seqno, and the output length the state says was synced (format 2)."""
    if not state.exists():
        return {}, 0
    raw = json.loads(state.read_text())
    assert raw["format"] == 2, raw.keys()
    seqnos = {int(vb): entry["seqno"] for vb, entry in raw["vbuckets"].items()}
    return seqnos, raw["output"]["size"]


def state_seqnos(state: Path) -> dict[int, int]:
    return read_state(state)[0]


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
    seqnos, committed = read_state(state)
    return Kill(output=output.read_bytes(), state=seqnos, committed=committed)


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


def check_kill(kill: Kill, final: bytes) -> None:
    """The output at a kill (``kill.output``) against its state, and what the next run kept."""
    whole = kill.output[: kill.output.rfind(b"\n") + 1]  # a last line may be unfinished
    lines = whole.splitlines(keepends=True)
    records = [json.loads(line) for line in lines]  # every finished line whole JSON
    # Lines past the state at the kill: a suffix of what the file held, one batch at most.
    ahead = [n for n, r in enumerate(records) if r["seqno"] > kill.state.get(r["vb"], 0)]
    kept = len(lines) - len(ahead)
    assert ahead == list(range(kept, len(lines))), ahead[:20]
    assert len(ahead) <= BATCH_LINES_MAX, len(ahead)
    # The state's length of the output is where that suffix starts...
    assert kill.committed == sum(len(line) for line in lines[:kept]), (kill.committed, kept)
    # ...and the next run kept the output up to there, byte for byte, and cut the rest.
    assert final[: kill.committed] == kill.output[: kill.committed]
    print(f"killed at {len(lines)} lines, {len(ahead)} of them past the state (cut)")
    # The next run resumed exactly at the state: its first line of each vb is past it.
    first_after: dict[int, int] = {}
    for line in final[kill.committed :].splitlines():
        r = json.loads(line)
        first_after.setdefault(r["vb"], r["seqno"])
    for vb, seqno in first_after.items():
        assert seqno > kill.state.get(vb, 0), (vb, seqno, kill.state.get(vb))


def check_output(final: bytes, kills: list[Kill], expected: list[dict[str, Any]]) -> None:
    records = [json.loads(line) for line in final.splitlines()]  # every line whole JSON
    assert all(r["op"] != "rollback" for r in records)  # the node never restarted
    for kill in kills:
        check_kill(kill, final)
    last: dict[int, int] = {}
    for r in records:  # no line twice: what a killed run wrote past its state was cut
        assert r["seqno"] > last.get(r["vb"], 0), f"vb {r['vb']}: seqno {r['seqno']} twice"
        last[r["vb"]] = r["seqno"]
    by_position = {(r["vb"], r["seqno"]): r for r in records}
    missing = [r for r in expected if by_position.get((r["vb"], r["seqno"])) != r]
    assert not missing, f"{len(missing)} changes missing or different, e.g. {missing[:3]}"
    newest = {r["key"]: r for r in records}
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
        check_output(output.read_bytes(), kills, await truth(node))

    asyncio.run(scenario())
    assert node.errors_in_log() == []
