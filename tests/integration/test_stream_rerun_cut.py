"""``changefeed stream`` rerun after a kill: the lines a killed run wrote past its state are cut,
so they are never left behind in the middle of the output (test_stream_resume's flake).

A SIGKILL after a commit leaves the output ahead of the state file by the lines since the
commit. The rerun resumes from the state and writes those changes again. If it kept the old
lines and was itself killed soon after its first commit, before it had streamed past them in
every vbucket, the output held lines far from its end that the new state did not cover ("non
suffix ahead lines"), and the next run wrote them a third time. Here the kill is made
deterministic: the state file is put back to an earlier commit (exactly what a kill before the
next commit leaves), and the rerun that covers only part of what is ahead is one limited to
some vbuckets.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from changefeed.cli.node_process import NodeProcess
from support.clients import kv_connect
from support.nodes import NodeFactory

from .test_stream_resume import run_to_latest

pytestmark = pytest.mark.timeout(180)

VBUCKETS = 8


async def write(node: NodeProcess, prefix: str, count: int) -> None:
    async with await kv_connect(node) as kv:
        await kv.upsert_many(
            [(b"%s-%05d" % (prefix.encode(), n), b"v%d" % n) for n in range(count)]
        )


def state_seqnos(state: Path) -> dict[int, int]:
    raw = json.loads(state.read_text())
    sessions = raw["vbuckets"] if "format" in raw else raw
    return {int(vb): entry["seqno"] for vb, entry in sessions.items()}


def records(output: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.read_text().splitlines()]


def ahead_of(lines: list[dict[str, Any]], seqnos: dict[int, int]) -> list[int]:
    """Positions of the lines the state does not cover."""
    return [n for n, r in enumerate(lines) if r["seqno"] > seqnos.get(r["vb"], 0)]


def test_rerun_cuts_what_a_killed_run_wrote_past_its_state(
    nodes: NodeFactory, tmp_path: Path
) -> None:
    node = nodes(vbuckets=VBUCKETS, args=["--no-durable"])
    state, output = tmp_path / "state.json", tmp_path / "changes.jsonl"

    asyncio.run(write(node, "a", 2000))
    run_to_latest(node, state, output)
    committed = state.read_bytes()
    first_run = records(output)

    asyncio.run(write(node, "b", 2000))
    run_to_latest(node, state, output)
    state.write_bytes(committed)  # killed before it saved a state past the first run's
    assert len(ahead_of(records(output), state_seqnos(state))) == 2000

    # A rerun that covers part of what is ahead (here: half the vbuckets) before its kill.
    run_to_latest(node, state, output, "--vbuckets", "0-3")
    lines = records(output)
    ahead = ahead_of(lines, state_seqnos(state))
    assert ahead == list(range(len(lines) - len(ahead), len(lines))), ahead[:20]  # a suffix
    assert ahead == []  # nothing of the killed run stayed; its changes of 0-3 were rewritten
    assert set(state_seqnos(state)) == set(range(VBUCKETS))  # 4-7 kept where they were
    assert lines[: len(first_run)] == first_run  # what the state covers is never touched

    run_to_latest(node, state, output)
    lines = records(output)
    positions = [(r["vb"], r["seqno"]) for r in lines]
    assert len(positions) == len(set(positions)) == 4000  # every change once, none repeated
    assert {r["key"] for r in lines} == {f"{p}-{n:05d}" for p in "ab" for n in range(2000)}
