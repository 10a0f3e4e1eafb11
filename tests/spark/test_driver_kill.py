"""Offsets resume after SIGKILL of the whole Spark driver (Python, JVM and Python workers).

The streaming mirror query runs in a subprocess (``mirror_driver.py``) with a checkpoint and
``maxOffsetsPerTrigger``, so it takes several micro-batches. A chosen batch holds at a chosen
point; the test kills the driver's process group with SIGKILL there, writes more, and reruns
on the same checkpoint. Spark replays the killed batch with its logged offsets, and the mirror
writer's Delta app transactions keep each table exactly once:

1. kill in batch 1 before any table commit (Spark: offsets/1 logged, commits/1 not);
2. kill in batch 3 after the changelog commit, before the mirror commit;
3. run to completion (availableNow).

At the end the mirror equals the store (and the writer's model) key by key, and the changelog
holds each (vbucket, seqno) at most once. The slow variant kills at random moments instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deltalake import DeltaTable

from changefeed.cli.node_process import NodeProcess
from changefeed.spark.mirror import APP_ID
from support.nodes import NodeFactory

from .helpers import (
    Model,
    assert_changelog_once,
    assert_mirror_matches,
    processes_in_group,
    workload,
    write,
)

DRIVER = Path(__file__).with_name("mirror_driver.py")
LIMIT = 3000
# Bounds, not expectations: on a loaded 2-core machine a driver's start and first distributed
# micro-batch (a shuffle, fresh Arrow UDF workers) took 80 s and 40 s; a run does several.
HOLD_TIMEOUT_S = 480.0
RUN_TIMEOUT_S = 600.0


class Driver:
    """Runs of ``mirror_driver.py`` against one node, tables and checkpoint under ``root``."""

    def __init__(self, node: NodeProcess, root: Path) -> None:
        self.node = node
        self.root = root
        self.tables = root / "tables"
        self.checkpoint = root / "checkpoint"
        self.events = root / "events.jsonl"
        self.runs = 0

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable, str(DRIVER),
            "--cluster", f"127.0.0.1:{self.node.port}",
            "--tables", str(self.tables),
            "--checkpoint", str(self.checkpoint),
            "--max-offsets", str(LIMIT),
            "--events", str(self.events),
            *extra,
        ]  # fmt: skip

    def start(self, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
        self.runs += 1
        log = self.root / f"driver-{self.runs}.log"
        with open(log, "wb") as handle:
            proc = subprocess.Popen(
                self.command(*extra), stdout=handle, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: JVM and workers die with it
            )  # fmt: skip
        return proc, log

    def kill_at(self, batch: int, point: str) -> None:
        """Run until ``batch`` holds at ``point``, then SIGKILL the process group."""
        hold = self.root / f"hold-{self.runs + 1}"
        proc, log = self.start(
            "--hold-batch", str(batch), "--hold-at", point, "--hold-file", str(hold)
        )
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while not hold.exists():  # bounded by the deadline
            if proc.poll() is not None or time.monotonic() > deadline:
                kill_group(proc)
                raise AssertionError(f"batch {batch} never held at {point}:\n{tail(log)}")
            time.sleep(0.05)
        kill_group(proc)

    def kill_after(self, seconds: float) -> int | None:
        """Run, SIGKILL the process group after ``seconds``; returns the exit code if it ended
        before (then it must have succeeded)."""
        proc, log = self.start()
        try:
            code = proc.wait(seconds)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return None
        assert code == 0, f"driver exited with {code}:\n{tail(log)}"
        return code

    def complete(self) -> list[int]:
        """Run to completion; returns rows per batch of this run."""
        proc, log = self.start()
        try:
            code = proc.wait(RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            raise AssertionError(
                f"driver did not finish in {RUN_TIMEOUT_S} s:\n{tail(log)}"
            ) from None
        assert code == 0, f"driver exited with {code}:\n{tail(log)}"
        lines = [x for x in log.read_text().splitlines() if x.startswith('{"rows_per_batch"')]
        rows: list[int] = json.loads(lines[-1])["rows_per_batch"]
        return rows

    def batch_events(self) -> list[dict[str, int | str]]:
        return [json.loads(x) for x in self.events.read_text().splitlines()]

    def txn_versions(self) -> tuple[int | None, int | None]:
        out = []
        for name in ("changelog", "mirror"):
            path = str(self.tables / name)
            ok = DeltaTable.is_deltatable(path)
            out.append(DeltaTable(path).transaction_version(APP_ID) if ok else None)
        return out[0], out[1]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the driver's whole process group and check that nothing of it survives."""
    pgid = proc.pid  # start_new_session: the driver leads its own group
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pgid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 10
    while processes_in_group(pgid):  # bounded by the deadline
        assert time.monotonic() < deadline, f"survivors of SIGKILL: {processes_in_group(pgid)}"
        time.sleep(0.05)


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def logged(checkpoint: Path, kind: str) -> set[int]:
    """Batch ids of Spark's checkpoint ``offsets`` or ``commits`` log."""
    folder = checkpoint / kind
    return {int(p.name) for p in folder.iterdir() if p.name.isdigit()} if folder.exists() else set()


@pytest.mark.timeout(1500)  # three driver runs; see HOLD_TIMEOUT_S
def test_offsets_resume_after_sigkill_of_the_driver_mid_batch(
    nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    driver = Driver(node, tmp_path)
    model: Model = {}
    write(node.port, workload(rng, 9000, keys=5000, tag="w0", delete_ratio=0.1), model)

    driver.kill_at(1, "before-commit")
    assert logged(driver.checkpoint, "offsets") == {0, 1}
    assert logged(driver.checkpoint, "commits") == {0}
    assert driver.txn_versions() == (0, 0), "batch 1 committed nothing"

    write(node.port, workload(rng, 4000, keys=6000, tag="w1", delete_ratio=0.1), model)
    driver.kill_at(3, "between-commits")
    assert driver.txn_versions() == (3, 2), "batch 3: changelog committed, mirror not"
    assert 3 in logged(driver.checkpoint, "offsets")
    assert 3 not in logged(driver.checkpoint, "commits")

    write(node.port, workload(rng, 3000, keys=6000, tag="w2", delete_ratio=0.1), model)
    rows = driver.complete()
    print(f"rows per batch of the last run {rows}")
    assert all(r <= LIMIT for r in rows), rows

    starts = [e["batch"] for e in driver.batch_events() if e["event"] == "start"]
    assert starts.count(1) == 2, f"batch 1 replayed once: {starts}"
    assert starts.count(3) == 2, f"batch 3 replayed once: {starts}"
    ends = [e for e in driver.batch_events() if e["event"] == "end"]
    assert sorted(e["batch"] for e in ends) == list(range(len(ends))), "each batch ended once"
    assert all(int(e["rows"]) <= LIMIT for e in ends), ends
    assert_mirror_matches(driver.tables, node, model)
    assert_changelog_once(driver.tables)


@pytest.mark.slow
def test_offsets_resume_after_sigkill_at_random_moments(
    nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    """Kills anywhere (planning, reading, Delta commits, Spark's own log writes), with writes
    between the runs."""
    node = nodes(args=["--no-durable"])
    driver = Driver(node, tmp_path)
    model: Model = {}
    for round_number in range(6):
        write(node.port, workload(rng, 6000, keys=8000, tag=f"r{round_number}"), model)
        seconds = rng.uniform(8.0, 30.0)
        finished = driver.kill_after(seconds)
        print(f"round {round_number}: killed after {seconds:.1f} s" if finished is None else
              f"round {round_number}: finished within {seconds:.1f} s")  # fmt: skip
    rows = driver.complete()
    assert all(r <= LIMIT for r in rows), rows
    assert_mirror_matches(driver.tables, node, model)
    assert_changelog_once(driver.tables)
