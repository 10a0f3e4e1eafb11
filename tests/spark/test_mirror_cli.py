"""``changefeed mirror`` as a user runs it: killed with SIGKILL mid-stream and restarted, it
ends with mirror == store on every column (metadata, each typed document field, the corrupt
record); ``changefeed mirror status`` reads the lag from the tables, the checkpoint and the
node. The slow variant stops it with SIGTERM (between micro-batches, exit 0) and resumes.
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
from typing import Any

import pytest
from deltalake import DeltaTable

from changefeed.cli.node_process import NodeProcess
from changefeed.spark.mirror import APP_ID
from support.nodes import NodeFactory

from .helpers import assert_typed_mirror_matches, changelog, processes_in_group, write

CHANGEFEED = [sys.executable, "-m", "changefeed"]
RUN_TIMEOUT_S = 240.0


def document(i: int, rng: random.Random) -> bytes:
    return json.dumps(
        {"id": i, "amount": rng.choice([i, i * 1.5]), "status": rng.choice(["new", "paid"]),
         "items": [{"sku": f"s{j}", "qty": j} for j in range(rng.randrange(3))]}
    ).encode()  # fmt: skip


def mirror_command(node: NodeProcess, tables: Path, *extra: str) -> list[str]:
    return [*CHANGEFEED, "mirror", "--cluster", node.address, "--tables", str(tables), *extra]


def start(node: NodeProcess, tables: Path, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as handle:
        return subprocess.Popen(
            mirror_command(node, tables, "--trigger", "0.5 seconds", *extra),
            stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the JVM and workers die with it
        )  # fmt: skip


def committed_batch(tables: Path) -> int:
    path = tables / "mirror"
    if not DeltaTable.is_deltatable(str(path)):
        return -1
    version = DeltaTable(str(path)).transaction_version(APP_ID)
    return -1 if version is None else int(version)


def wait_for(condition: Any, what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not condition():  # bounded by the deadline
        assert proc.poll() is None, f"mirror exited {proc.returncode}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{what} not in {RUN_TIMEOUT_S} s"
        time.sleep(0.2)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    deadline = time.monotonic() + 30
    while processes_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def status(node: NodeProcess, tables: Path) -> dict[str, Any]:
    done = subprocess.run(
        [*CHANGEFEED, "mirror", "status", "--cluster", node.address, "--tables", str(tables),
         "--json"],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.timeout(600)
def test_mirror_killed_and_restarted_equals_the_store(
    nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    tables, log = tmp_path / "tables", tmp_path / "mirror.log"
    write(node.port, [(f"o{i:05d}", document(i, rng)) for i in range(2500)])
    write(node.port, [("broken", b"{not json")])

    proc = start(node, tables, log, "--max-offsets-per-trigger", "400")
    try:
        wait_for(lambda: committed_batch(tables) >= 1, "two micro-batches", proc, log)
        os.killpg(proc.pid, signal.SIGKILL)  # mid-stream: more batches were to come
    finally:
        kill_group(proc)
    killed_at = committed_batch(tables)
    assert status(node, tables)["lag"]["items"] > 0, "killed before it caught up"

    ops: list[tuple[str, bytes | None]] = [
        (f"o{rng.randrange(2500):05d}", document(i, rng)) for i in range(1000)
    ]
    ops += [(f"o{rng.randrange(2500):05d}", None) for _ in range(200)]
    write(node.port, ops)
    done = subprocess.run(
        mirror_command(node, tables, "--once", "--max-offsets-per-trigger", "2000", "--json"),
        capture_output=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    batches = [json.loads(line) for line in done.stdout.splitlines()]
    # Resumed, not restarted: the killed batch again (committed to the tables, not yet to the
    # checkpoint: the writer skips it) or the next one.
    assert batches and batches[0]["batch"] in (killed_at, killed_at + 1), (killed_at, batches)
    assert batches[-1]["lag"]["items"] == 0, batches[-1]
    table = assert_typed_mirror_matches(tables, node)
    assert {"id", "amount", "status", "items", "_corrupt_record"} <= set(table.column_names)
    caught_up = status(node, tables)
    assert caught_up["lag"]["items"] == 0
    # The watermark: the oldest of the vbuckets' last logged changes (no rollback here; CAS:
    # HLC ns in the upper 48 bits), deletions included.
    logged = changelog(tables).group_by("vbucket").aggregate([("cas", "max")])
    oldest_last = min(logged.column("cas_max").to_pylist()) >> 16 << 16
    assert caught_up["resolved_hlc_ns"] == oldest_last, (caught_up, oldest_last)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigterm_stops_the_mirror_between_micro_batches(
    nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    tables, log = tmp_path / "tables", tmp_path / "mirror.log"
    write(node.port, [(f"n{i}", document(i, rng)) for i in range(3000)])
    proc = start(node, tables, log, "--max-offsets-per-trigger", "500")
    try:
        wait_for(lambda: committed_batch(tables) >= 1, "two micro-batches", proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()[-3000:]
    finally:
        kill_group(proc)
    assert "stopped (signal 15) after batch" in log.read_text()
    done = subprocess.run(mirror_command(node, tables, "--once"), capture_output=True,
                          timeout=RUN_TIMEOUT_S)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert_typed_mirror_matches(tables, node)
