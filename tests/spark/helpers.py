"""Helpers of the Spark tests: a node process, a seeded workload with its model, and the truth.

``Node`` runs ``changefeed serve`` as a child in its own process group (free port through
``--ready-file``), stops it with SIGTERM (clean) or SIGKILL, and copies or restores its data
directory while it is stopped. ``write`` applies a workload through ``KvClient`` and keeps a
model (key -> value, None once deleted). ``store_state`` is the truth: a fresh DCP client
streaming every vbucket from the beginning to the high seqno. ``assert_mirror_matches`` compares
a mirror table with both, key by key.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from changefeed.consumer import (
    Changes,
    ClientConfig,
    DcpClient,
    KvClient,
    Rollback,
    StreamEnded,
    StreamRefused,
)
from changefeed.protocol.errors import KeyNotFoundError, TemporaryFailureError
from changefeed.protocol.opcode import Opcode
from changefeed.spark import read_mirror

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0
WRITE_CHUNK = 2000
TMPFAIL_RETRIES_MAX = 400  # ~20 s of backoff per chunk at most

Model = dict[str, bytes | None]
Op = tuple[str, bytes | None]  # (key, value); None deletes


def changefeed_command() -> list[str]:
    script = Path(sys.executable).parent / "changefeed"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from changefeed.cli.main import main; main()"]


class Node:
    """One ``changefeed serve`` process and its data directory under ``root``."""

    def __init__(self, root: Path, *, vbuckets: int = 16, args: Iterable[str] = ()) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = root / "data"
        self.ready_file = root / "ready"
        self.log_path = root / "node.log"
        self.vbuckets = vbuckets
        self.args = list(args)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *, timeout_s: float = START_TIMEOUT_S) -> Node:
        """Start (on the same port after the first time) and wait for the ready file."""
        assert not self.alive, "node already running"
        self.ready_file.unlink(missing_ok=True)
        command = [
            *changefeed_command(), "serve",
            "--data-dir", str(self.data_dir),
            "--port", str(self.port),
            "--ready-file", str(self.ready_file),
            "--vbuckets", str(self.vbuckets),
            *self.args,
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:  # bounded by the deadline
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}:\n{self.log_tail()}")
            text = self.ready_file.read_text().strip() if self.ready_file.exists() else ""
            if text.isdigit():
                self.port = int(text)
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"node not ready in {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.02)

    def stop(self, *, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM: a clean shutdown (flush, no new failover entry on the next start)."""
        if not self.alive:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"node ignored SIGTERM:\n{self.log_tail()}") from None
        assert code == 0, f"clean stop exited with {code}:\n{self.log_tail()}"

    def kill(self) -> None:
        """SIGKILL: a crash (the next start adds a failover entry: a new history branch)."""
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def copy_data(self, target: Path) -> Path:
        assert not self.alive, "copy the data directory of a stopped node only"
        shutil.copytree(self.data_dir, target)
        return target

    def restore_data(self, source: Path) -> None:
        assert not self.alive, "restore into a stopped node only"
        shutil.rmtree(self.data_dir)
        shutil.copytree(source, self.data_dir)

    def options(self, **extra: str) -> dict[str, str]:
        """Options of the ``changefeed`` source for this node."""
        return {"cluster": f"{HOST}:{self.port}", **extra}

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


# -- workload ----------------------------------------------------------------------------------


def workload(
    rng: random.Random,
    count: int,
    *,
    keys: int,
    prefix: str = "k",
    tag: str = "v",
    delete_ratio: float = 0.05,
) -> list[Op]:
    """``count`` random upserts and deletes over ``keys`` keys; values name the op's index."""
    assert count >= 0, count
    assert keys > 0, keys
    ops: list[Op] = []
    for i in range(count):
        key = f"{prefix}-{rng.randrange(keys):07d}"
        if rng.random() < delete_ratio:
            ops.append((key, None))
        else:
            ops.append((key, f"{tag}-{i}-{rng.randrange(10**6)}".encode()))
    return ops


async def write_async(port: int, ops: list[Op], model: Model | None = None) -> None:
    """Apply ``ops`` in order (runs of upserts pipelined) and update ``model``."""
    async with await KvClient.connect(HOST, port) as kv:
        run: list[tuple[bytes, bytes]] = []
        for key, value in ops:
            if value is not None:
                run.append((key.encode(), value))
                if len(run) >= WRITE_CHUNK:
                    await _upsert_retrying(kv, run)
                    run = []
                continue
            await _upsert_retrying(kv, run)
            run = []
            with contextlib.suppress(KeyNotFoundError):  # deleting an absent key is fine
                await kv.remove(key.encode())
        await _upsert_retrying(kv, run)
    if model is not None:
        model.update(ops)


def write(port: int, ops: list[Op], model: Model | None = None) -> None:
    asyncio.run(write_async(port, ops, model))


async def _upsert_retrying(kv: KvClient, items: list[tuple[bytes, bytes]]) -> None:
    if not items:
        return
    for attempt in range(TMPFAIL_RETRIES_MAX):
        try:
            await kv.upsert_many(items)
            return
        except TemporaryFailureError:  # checkpoint memory full: the flusher catches up
            await asyncio.sleep(min(0.05, 0.001 * (attempt + 1)))
    raise TimeoutError("writes kept failing with TMPFAIL")


def live(model: Model) -> dict[str, bytes]:
    return {k: v for k, v in model.items() if v is not None}


# -- truth ---------------------------------------------------------------------------------------

_names = itertools.count(1)


async def store_state_async(
    port: int, vbuckets: int, *, timeout_s: float = 120.0
) -> dict[str, bytes]:
    """Every live key and its value: a fresh DCP stream of every vbucket to its high seqno."""
    config = ClientConfig(
        host=HOST, port=port, to_latest=True, name=f"spark-tests:truth:{os.getpid()}:{next(_names)}"
    )
    newest: dict[bytes, tuple[int, bytes | None]] = {}
    ended: set[int] = set()
    async with asyncio.timeout(timeout_s), DcpClient(config) as client:
        await client.stream(list(range(vbuckets)))
        async for event in client.events():
            if isinstance(event, Changes):
                cols = event.columns
                for i in range(len(cols)):
                    deleted = cols.opcode[i] != Opcode.DCP_MUTATION
                    newest[cols.key[i]] = (cols.seqno[i], None if deleted else cols.value[i])
            elif isinstance(event, StreamEnded):
                ended.add(event.vbucket)
            elif isinstance(event, (Rollback, StreamRefused)):
                raise AssertionError(f"truth stream from the beginning got {event}")
            if len(ended) == vbuckets:
                break
    return {k.decode(): v for k, (_, v) in newest.items() if v is not None}


def store_state(port: int, vbuckets: int) -> dict[str, bytes]:
    return asyncio.run(store_state_async(port, vbuckets))


def table_state(table: pa.Table) -> dict[str, bytes]:
    keys = table.column("key").to_pylist()
    values = table.column("value").to_pylist()
    assert len(set(keys)) == len(keys), "the mirror holds a key twice"
    return dict(zip(keys, values, strict=True))


def diff(got: dict[str, bytes], want: dict[str, bytes]) -> str:
    """Empty when equal; else counts and examples of missing, extra and differing keys."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    differ = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    if not (missing or extra or differ):
        return ""
    return (
        f"{len(missing)} missing (e.g. {missing[:5]}), {len(extra)} extra (e.g. {extra[:5]}), "
        f"{len(differ)} differ (e.g. {[(k, got[k], want[k]) for k in differ[:3]]})"
    )


def assert_mirror_matches(path: Path, node: Node, model: Model | None = None) -> dict[str, bytes]:
    """The mirror table equals the store (and the writer's model), key by key; returns it."""
    mirror = table_state(read_mirror(path))
    truth = store_state(node.port, node.vbuckets)
    problem = diff(mirror, truth)
    assert not problem, f"mirror differs from the store: {problem}"
    if model is not None:
        problem = diff(truth, live(model))
        assert not problem, f"store differs from the writer's model: {problem}"
    return mirror


def changelog(path: Path) -> pa.Table:
    return DeltaTable(str(path / "changelog")).to_pyarrow_table()


def assert_changelog_once(path: Path) -> pa.Table:
    """Each (vbucket, seqno) of a change row appears at most once in the changelog."""
    table = changelog(path)
    changes = table.filter(pc.not_equal(table.column("op"), "rollback"))
    counts = changes.group_by(["vbucket", "seqno"]).aggregate([("seqno", "count")])
    twice = counts.filter(pc.greater(counts.column("seqno_count"), 1))
    assert twice.num_rows == 0, f"changelog rows written twice: {twice.slice(0, 5).to_pylist()}"
    return table


def processes_in_group(pgid: int) -> list[int]:
    """Pids whose process group is ``pgid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry))
    return out
