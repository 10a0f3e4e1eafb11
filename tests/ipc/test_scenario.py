"""Issue 27's scenario with real processes: a node under a steady writer, local readers
(``changefeed stream --local --follow --state --output``) that are killed, stopped and
restarted, readers killed for good, the node killed with -9 and restarted.

* reader A is killed -9 while it reads (holding its batch) and restarted on its state;
* reader B is stopped (SIGSTOP) past the drop rule: the ring goes round it; resumed, it
  catches up over DCP;
* readers E, F, G take the last seats and are killed for good: the node reclaims them, so a new
  reader H can subscribe (it could not while their seats were taken);
* the node is killed -9 and restarted while everyone reads;
* at the end every reader that ran to the end (A, B, C, D, H from its start) holds every change
  exactly once, and after a clean stop the node leaves nothing in /dev/shm or its directory.

``test_scenario`` runs it in about a minute; ``test_scenario_long`` (``-m slow``) keeps the
writer going for ten minutes with the same events spread over it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from changefeed.consumer import ClientConfig, KvClient
from changefeed.ipc.local_stream import high_seqnos, services_of
from changefeed.ipc.segments import Segment, ServicePaths
from changefeed.ipc.stats import inspect
from ipc.test_node_wiring import dcp_rows, load, shm_node
from support.nodes import NodeFactory

Row = tuple[int, int, str]


class Writer:
    """A steady writer in a thread of its own: ``rate`` keys a second, unique keys; it rides
    out the node's restart (writes refused meanwhile are retried)."""

    def __init__(self, port: int, rate: int) -> None:
        self.port = port
        self.rate = rate
        self.written = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        burst = max(1, self.rate // 50)
        while not self._stop.is_set():
            try:
                async with await KvClient.connect("127.0.0.1", self.port) as kv:
                    while not self._stop.is_set():
                        keys = [f"w{self.written + i}".encode() for i in range(burst)]
                        await asyncio.gather(*(kv.upsert(k, b"v" * 30) for k in keys))
                        self.written += burst
                        await asyncio.sleep(0.02)
            except OSError:
                await asyncio.sleep(0.2)  # the node is down: try again

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


class Reader:
    """``changefeed stream --local --follow`` with a state and an output file."""

    def __init__(self, name: str, port: int, ipc_dir: Path, work: Path, app: int) -> None:
        self.name = name
        self.output = work / f"{name}.jsonl"
        self.state = work / f"{name}.state.json"
        self.args = [
            sys.executable,
            "-m",
            "changefeed",
            "stream",
            "--port",
            str(port),
            "--local",
            "--shm-dir",
            str(ipc_dir),
            "--follow",
            "--state",
            str(self.state),
            "--output",
            str(self.output),
            "--app-id",
            str(app),
        ]
        self.log = work / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log)

    def rows(self) -> list[Row]:
        if not self.output.exists():
            return []
        found = []
        for line in self.output.read_text().splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # a line being written
            if doc.get("op") != "rollback":
                found.append((doc["vb"], doc["seqno"], doc["key"]))
        return found

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def tail(self) -> str:
        return self.log.read_text()[-2000:] if self.log.exists() else ""


def seats(port: int, ipc_dir: Path) -> list[float]:
    return [
        inspect(s, str(ipc_dir))["readers_attached"] for s in services_of("default", port, ipc_dir)
    ]


def wait(condition: Any, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, what
        time.sleep(0.05)
    return time.monotonic() - start


def run_scenario(nodes: NodeFactory, ipc_dir: Path, tmp_path: Path, phase_s: float) -> None:
    node = shm_node(nodes, ipc_dir, tmp_path, shm_slots=16, shm_max_subscribers=7)
    port = node.port
    work = tmp_path / "readers"
    work.mkdir()
    writer = Writer(port, rate=1000)
    readers: dict[str, Reader] = {}
    try:
        for app, name in enumerate("ABCD", start=1):
            readers[name] = Reader(name, port, ipc_dir, work, app)
        wait(lambda: min(seats(port, ipc_dir)) == 4, 30, "four readers attached")
        doomed = [Reader(name, port, ipc_dir, work, app) for app, name in enumerate("EFG", 5)]
        wait(lambda: min(seats(port, ipc_dir)) == 7, 30, "seven readers attached")
        time.sleep(phase_s)
        # A: kill -9 while it reads, then restart it on its state
        readers["A"].kill()
        time.sleep(phase_s / 2)
        readers["A"].start()
        # B: stopped past the drop rule (16 slots go by in well under a second here)
        readers["B"].signal(signal.SIGSTOP)
        time.sleep(max(3.0, phase_s))
        readers["B"].signal(signal.SIGCONT)
        # E, F, G: killed for good; H gets a seat once the node reclaimed theirs
        for reader in doomed:
            reader.kill()
        reclaimed_s = wait(lambda: max(seats(port, ipc_dir)) <= 4, 5, "E, F, G reclaimed")
        readers["H"] = Reader("H", port, ipc_dir, work, 8)
        wait(lambda: min(seats(port, ipc_dir)) == 5, 30, "H attached")
        time.sleep(phase_s)
        # the node: kill -9 and restart while everyone reads
        node.kill()
        time.sleep(1.0)
        node.start()
        time.sleep(phase_s)
    finally:
        writer.stop()
    ends = asyncio.run(high_seqnos(ClientConfig(port=port)))
    reference = sorted((vb, seqno, key) for vb, seqno, key, *_ in asyncio.run(dcp_rows(port)))
    assert len(reference) >= writer.written * 0.9, (len(reference), writer.written)
    total = sum(ends.values())

    def complete(reader: Reader) -> bool:
        if reader.proc.poll() is not None:  # type: ignore[union-attr]
            return True  # died: its rows say what is missing
        if not reader.output.exists():
            return False
        with open(reader.output, "rb") as handle:  # counting lines is cheap; parsing is not
            return sum(1 for _ in handle) >= len(reference)

    for reader in readers.values():
        wait(
            lambda r=reader: complete(r),
            120,
            f"reader {reader.name}: {len(reader.rows())} of {total} changes; {reader.tail()}",
        )
    time.sleep(0.5)
    for reader in readers.values():
        assert reader.terminate() in (0, -signal.SIGTERM), reader.tail()  # --follow: no end
    for name, reader in readers.items():
        rows = reader.rows()
        repeated = [row for row, n in collections.Counter(rows).items() if n > 1]
        assert not repeated, (name, repeated[:5])
        # H too: a new reader starts from the beginning (the CLI's default)
        assert sorted(rows) == reference, (name, len(rows), len(reference))
    print(f"{len(reference)} changes; E, F, G reclaimed {reclaimed_s * 1000:.0f} ms after the kill")
    node.stop()
    for index in (0, 1):
        paths = ServicePaths(f"default-{port}-g{index}", ipc_dir)
        assert not Segment.exists(paths.control_segment)
        assert not Segment.exists(paths.data_segment)
    assert not list(ipc_dir.iterdir()), list(ipc_dir.iterdir())
    assert os.path.exists("/dev/shm")


def test_scenario(nodes: NodeFactory, ipc_dir: Path, tmp_path: Path) -> None:
    run_scenario(nodes, ipc_dir, tmp_path, phase_s=2.0)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_scenario_long(nodes: NodeFactory, ipc_dir: Path, tmp_path: Path) -> None:
    run_scenario(nodes, ipc_dir, tmp_path, phase_s=140.0)  # ~10.5 minutes of batches


def test_the_state_is_written_only_when_output_is_committed(
    nodes: NodeFactory, ipc_dir: Path, tmp_path: Path
) -> None:
    """``stream --local --follow --state``: the state file is replaced when output lines were
    committed, and left alone while nothing arrives (a reader idle for hours writes nothing),
    and stays small however many batches went by."""
    node = shm_node(nodes, ipc_dir, tmp_path)
    work = tmp_path / "readers"
    work.mkdir()
    reader = Reader("S", node.port, ipc_dir, work, 1)
    try:
        asyncio.run(load(node.port, 300, prefix="a"))
        wait(lambda: len(reader.rows()) == 300, 30, f"300 changes; {reader.tail()}")
        stamps = [reader.state.stat().st_mtime_ns]
        while len(stamps) < 10 or len(set(stamps[-10:])) > 1:  # the last commit is done:
            time.sleep(0.1)  # the state unchanged for 1 s (0.1 s after the last line, idle)
            stamps.append(reader.state.stat().st_mtime_ns)
            assert len(stamps) < 300, "the state is rewritten without output"
        before = reader.state.stat()
        time.sleep(3.0)  # nothing written: nothing to commit
        after = reader.state.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
        asyncio.run(load(node.port, 100, prefix="b"))
        wait(lambda: len(reader.rows()) == 400, 30, f"400 changes; {reader.tail()}")
        wait(lambda: reader.state.stat().st_ino != before.st_ino, 5, "the state saved again")
        assert reader.state.stat().st_size < 2000 * 8  # bounded: ~1.3 KB a vbucket at most
    finally:
        reader.kill()
