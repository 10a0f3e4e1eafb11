"""Test harness for integration tests: real node processes on 127.0.0.1 and a checking consumer.

``NodeProcess`` runs ``changefeed serve`` as a child process (free port via ``--ready-file``),
stops it with SIGTERM (clean: flush, no new failover entry) or SIGKILL (unclean), restarts it on
the same data directory and port, and copies or restores that directory while it is stopped.

``Mirror`` is what a careful consumer application keeps: every change per vbucket in seqno order,
so that a ``Rollback`` can discard the changes after its seqno and the state before them comes
back. It asserts invariant 3 (seqnos only rise within a vbucket, except after a rollback) on
every item. ``drain`` runs a ``DcpClient`` into a ``Mirror`` until a condition holds, with a
deadline; ``server_state`` is the truth: a fresh client streaming every vbucket from the
beginning to the latest seqno.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from changefeed.consumer import (
    Changes,
    ClientConfig,
    DcpClient,
    Disconnected,
    Event,
    KvClient,
    Rollback,
    SessionState,
    Snapshot,
    StreamEnded,
    StreamOpened,
    StreamRefused,
)
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import authenticate, hello, select_bucket
from changefeed.protocol.errors import TemporaryFailureError
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.status import Status

HOST = "127.0.0.1"
USER = "Administrator"
PASSWORD = "password"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0
OP_DELETION = Opcode.DCP_DELETION
OP_EXPIRATION = Opcode.DCP_EXPIRATION
MARKER_MEMORY = 0x01
MARKER_DISK = 0x02


def free_port() -> int:
    """A port that was free a moment ago (for --metrics-port; the KV port uses --ready-file)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def _changefeed_command() -> list[str]:
    script = Path(sys.executable).parent / "changefeed"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from changefeed.cli.main import main; main()"]


class NodeProcess:
    """One ``changefeed serve`` child process and its data directory.

    Args:
        workdir: where the data directory, ready file and log live.
        vbuckets: ``--vbuckets``.
        args: extra ``serve`` flags (e.g. ``["--checkpoint-quota-bytes", "1048576"]``).
        name: sub-directory of ``workdir`` for this node.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        vbuckets: int = 8,
        args: Iterable[str] = (),
        name: str = "node",
        env: dict[str, str] | None = None,
    ) -> None:
        self.root = workdir / name
        self.root.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.root / "data"
        self.ready_file = self.root / "ready"
        self.log_path = self.root / "node.log"
        self.vbuckets = vbuckets
        self.args = list(args)
        self.env = env
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    # -- life cycle -------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None, "node not started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, *, timeout_s: float = START_TIMEOUT_S) -> NodeProcess:
        """Start (or restart, on the same port) and wait until the ready file names the port."""
        assert not self.alive, "node already running"
        self.ready_file.unlink(missing_ok=True)
        command = [
            *_changefeed_command(), "serve",
            "--data-dir", str(self.data_dir),
            "--port", str(self.port),  # 0 the first time; the same port on restarts
            "--ready-file", str(self.ready_file),
            "--vbuckets", str(self.vbuckets),
            *self.args,
        ]  # fmt: skip
        env = dict(os.environ)
        env.update(self.env or {})
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start #{self.starts + 1}: {' '.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while True:  # bounded by the deadline
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"node exited with {self.proc.returncode} before ready:\n{self.log_tail()}"
                )
            text = self.ready_file.read_text().strip() if self.ready_file.exists() else ""
            if text.isdigit():
                self.port = int(text)
                return self
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"node not ready in {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.02)

    def stop(self, *, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (clean shutdown: flush and close the store) and wait; returns the exit code."""
        assert self.proc is not None, "node not started"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise TimeoutError(
                    f"node ignored SIGTERM for {timeout_s} s:\n{self.log_tail()}"
                ) from None
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (an unclean crash) and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self, *, clean: bool = True) -> NodeProcess:
        if clean:
            code = self.stop()
            assert code == 0, f"clean stop exited with {code}:\n{self.log_tail()}"
        else:
            self.kill()
        return self.start()

    # -- data directory ---------------------------------------------------------------------

    def copy_data(self, target: Path) -> Path:
        """Copy the data directory (the node must be stopped: LMDB files are then consistent)."""
        assert not self.alive, "copy the data directory of a stopped node only"
        shutil.copytree(self.data_dir, target)
        return target

    def snapshot_data(self, target: Path) -> Path:
        """Copy the data directory of a *running* node, frozen with SIGSTOP meanwhile: what a
        volume snapshot takes (crash-consistent, marked unclean, since the node is running)."""
        assert self.alive, "snapshot a running node only"
        self.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            shutil.copytree(self.data_dir, target)
        finally:
            self.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        return target

    def restore_data(self, source: Path) -> None:
        """Replace the data directory with a copy made by ``copy_data`` (node stopped)."""
        assert not self.alive, "restore into a stopped node only"
        shutil.rmtree(self.data_dir)
        shutil.copytree(source, self.data_dir)

    # -- observation ------------------------------------------------------------------------

    def status_kib(self, field_name: str = "VmRSS") -> int:
        """A field of /proc/PID/status in KiB (VmRSS, RssAnon, VmHWM...)."""
        with open(f"/proc/{self.pid}/status") as handle:
            for line in handle:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        raise KeyError(field_name)

    def rss_bytes(self) -> int:
        return self.status_kib("VmRSS") * 1024

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def errors_in_log(self) -> list[str]:
        """Log lines that mean a bug: tracebacks, ERROR/CRITICAL records, fatal transport errors."""
        markers = ("Traceback", " ERROR ", " CRITICAL ", "Fatal error", "Exception in callback")
        return [line for line in self.log_text().splitlines() if any(m in line for m in markers)]


# -- clients -------------------------------------------------------------------------------


async def kv_connect(node: NodeProcess, **kwargs: Any) -> KvClient:
    return await KvClient.connect(HOST, node.port, **kwargs)


_client_numbers = itertools.count(1)


def dcp_config(node: NodeProcess, **overrides: Any) -> ClientConfig:
    # A unique name: a DCP name reused by a new connection kicks the older one (dcp-wire.md §4).
    name = f"changefeed-tests:{next(_client_numbers)}"
    values: dict[str, Any] = {"host": HOST, "port": node.port, "to_latest": True, "name": name}
    values.update(overrides)
    return ClientConfig(**values)


async def upsert_retrying(
    kv: KvClient, items: list[tuple[bytes, bytes]], *, chunk: int = 1000, durability: str = "none"
) -> None:
    """``upsert_many`` in chunks, retrying a chunk on TMPFAIL (checkpoint memory full)."""
    for first in range(0, len(items), chunk):
        part = items[first : first + chunk]
        for attempt in range(400):  # ~ 20 s of backoff at most
            try:
                await kv.upsert_many(part, durability=durability)  # type: ignore[arg-type]
                break
            except TemporaryFailureError:
                await asyncio.sleep(min(0.05, 0.001 * (attempt + 1)))
        else:
            raise TimeoutError("writes kept failing with TMPFAIL")


async def raw_connection(node: NodeProcess, *, auth: bool = True) -> Connection:
    """A bare connection: HELLO, and (with ``auth``) SASL and SELECT_BUCKET."""
    conn = await Connection.open(HOST, node.port)
    await hello(conn, "changefeed-tests", [Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON])
    if auth:
        await authenticate(conn, USER, PASSWORD)
        await select_bucket(conn, "default")
    return conn


async def stats(conn: Connection, group: str, *, timeout_s: float = 10.0) -> dict[str, str]:
    """STAT ``group``: the multi-response answer up to the empty terminator (or an error)."""
    opaque = conn.next_opaque()
    request = encode_request(Opcode.STAT, opaque=opaque, key=group.encode())
    frames = await conn.request_many(
        request, opaque, lambda f: f.status != Status.SUCCESS or not f.key, timeout_s=timeout_s
    )
    status = frames[-1].status
    assert status == Status.SUCCESS, f"STAT {group!r} answered status {status:#x}"
    return {f.key.decode(): f.value.decode() for f in frames[:-1]}


async def high_seqnos(node: NodeProcess) -> dict[int, int]:
    conn = await raw_connection(node)
    try:
        answer = await stats(conn, "vbucket-seqno")
    finally:
        await conn.close()
    return {vb: int(answer[f"vb_{vb}:high_seqno"]) for vb in range(node.vbuckets)}


# -- the checking consumer ------------------------------------------------------------------


@dataclass(slots=True)
class Change:
    seqno: int
    key: bytes
    deleted: bool
    value: bytes


@dataclass
class Mirror:
    """Everything a consumer received, per vbucket, with rollback applied."""

    history: dict[int, list[Change]] = field(default_factory=dict)
    last_seqno: dict[int, int] = field(default_factory=dict)
    markers: list[tuple[int, int, int, int]] = field(default_factory=list)  # vb, start, end, flags
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    ended: dict[int, int] = field(default_factory=dict)  # vb -> StreamEndReason
    refused: list[StreamRefused] = field(default_factory=list)
    opened: set[int] = field(default_factory=set)
    disconnects: int = 0
    items: int = 0
    received: dict[int, list[int]] = field(default_factory=dict)  # every seqno, in order
    # Per vb, in arrival order: ("item", seqno) and ("rollback", seqno).
    timeline: dict[int, list[tuple[str, int]]] = field(default_factory=dict)

    def apply(self, event: Event) -> None:
        if isinstance(event, Changes):
            cols = event.columns
            for i in range(len(cols)):
                vb, seqno = cols.vbucket[i], cols.seqno[i]
                last = self.last_seqno.get(vb, 0)
                assert seqno > last, f"vb {vb}: seqno {seqno} after {last} without a rollback"
                self.last_seqno[vb] = seqno
                deleted = cols.opcode[i] in (OP_DELETION, OP_EXPIRATION)
                self.history.setdefault(vb, []).append(
                    Change(seqno, cols.key[i], deleted, cols.value[i])
                )
                self.received.setdefault(vb, []).append(seqno)
                self.timeline.setdefault(vb, []).append(("item", seqno))
            self.items += len(cols)
        elif isinstance(event, Snapshot):
            self.markers.append((event.vbucket, event.snap_start, event.snap_end, event.flags))
        elif isinstance(event, Rollback):
            self.rollbacks.append((event.vbucket, event.seqno))
            self.timeline.setdefault(event.vbucket, []).append(("rollback", event.seqno))
            kept = [c for c in self.history.get(event.vbucket, []) if c.seqno <= event.seqno]
            self.history[event.vbucket] = kept
            self.last_seqno[event.vbucket] = min(self.last_seqno.get(event.vbucket, 0), event.seqno)
        elif isinstance(event, StreamEnded):
            self.ended[event.vbucket] = int(event.reason)
        elif isinstance(event, StreamOpened):
            self.opened.add(event.vbucket)
        elif isinstance(event, StreamRefused):
            self.refused.append(event)
        elif isinstance(event, Disconnected):
            self.disconnects += 1

    def latest(self) -> dict[bytes, Change]:
        """Newest change per key (deletions included)."""
        out: dict[bytes, Change] = {}
        for changes in self.history.values():
            for change in changes:
                out[change.key] = change
        return out

    def live(self) -> dict[bytes, tuple[int, bytes]]:
        """key -> (seqno, value) of every key whose newest change is a mutation."""
        return {k: (c.seqno, c.value) for k, c in self.latest().items() if not c.deleted}

    def values(self) -> dict[bytes, bytes]:
        return {k: v for k, (_, v) in self.live().items()}


Until = Callable[[DcpClient, Mirror], bool]


def all_ended(vbuckets: Iterable[int]) -> Until:
    wanted = set(vbuckets)
    return lambda client, mirror: wanted <= set(mirror.ended)


def reached(targets: dict[int, int]) -> Until:
    """Every vbucket's session seqno is at least its target (e.g. the server's high seqno)."""
    return lambda client, mirror: all(
        client.session.get(vb).seqno >= high for vb, high in targets.items()
    )


async def drain(
    client: DcpClient,
    mirror: Mirror,
    until: Until,
    *,
    timeout_s: float = 60.0,
    per_event: Callable[[Event], Any] | None = None,
    stop_after_items: int | None = None,
) -> None:
    """Apply events to ``mirror`` until ``until`` holds (checked after each event).

    With ``stop_after_items`` it stops after the first ``Changes`` event that takes the mirror to
    that many items (a consumer that quits part-way, at an arbitrary point in a snapshot).
    """
    if until(client, mirror):
        return
    async with asyncio.timeout(timeout_s):
        async for event in client.events():
            mirror.apply(event)
            assert not isinstance(event, StreamRefused), event
            if per_event is not None:
                result = per_event(event)
                if asyncio.iscoroutine(result):
                    await result
            if stop_after_items is not None and mirror.items >= stop_after_items:
                return
            if until(client, mirror):
                return


async def stream_to_latest(
    node: NodeProcess,
    *,
    start: str | SessionState = "beginning",
    mirror: Mirror | None = None,
    timeout_s: float = 60.0,
    **config: Any,
) -> tuple[Mirror, SessionState]:
    """Stream every vbucket up to its high seqno at request time; returns mirror and session."""
    mirror = mirror if mirror is not None else Mirror()
    mirror.ended.clear()  # a mirror carried over from an earlier stream: wait for new ends
    vbs = list(range(node.vbuckets))
    async with DcpClient(dcp_config(node, **config)) as client:
        await client.stream(vbs, start=start)  # type: ignore[arg-type]
        await drain(client, mirror, all_ended(vbs), timeout_s=timeout_s)
        session = SessionState.from_json(client.session.to_json())
    return mirror, session


async def server_state(node: NodeProcess, *, timeout_s: float = 60.0) -> Mirror:
    """The truth: what a fresh consumer streaming everything from the beginning receives."""
    mirror, _ = await stream_to_latest(node, timeout_s=timeout_s)
    assert not mirror.rollbacks, mirror.rollbacks
    return mirror


def mark(mirror: Mirror) -> dict[int, int]:
    """Where each vbucket's timeline ends now (to check what a resumed stream adds)."""
    return {vb: len(events) for vb, events in mirror.timeline.items()}


def assert_resumed_after(mirror: Mirror, marked: dict[int, int], session: SessionState) -> None:
    """Invariant 2 for a stream resumed from ``session``: per vbucket, either every item is after
    the session's seqno, or a rollback comes before the first item and every item follows it."""
    for vb, events in mirror.timeline.items():
        resumed = events[marked.get(vb, 0) :]
        floor = session.get(vb).seqno
        for kind, seqno in resumed:
            if kind == "rollback":
                assert seqno <= floor, f"vb {vb}: rollback to {seqno} above the resume point"
                floor = seqno
            else:
                assert seqno > floor, f"vb {vb}: item {seqno} not after {floor} (resumed stream)"
        rollbacks = [i for i, (kind, _) in enumerate(resumed) if kind == "rollback"]
        items = [i for i, (kind, _) in enumerate(resumed) if kind == "item"]
        if rollbacks and items:
            assert max(rollbacks) < min(items), f"vb {vb}: a rollback came after items"


def assert_same_state(got: Mirror, want: Mirror, *, what: str = "consumer") -> None:
    """Live keys, values and seqnos equal; a key deleted on one side is absent or deleted."""
    got_live, want_live = got.live(), want.live()
    missing = sorted(set(want_live) - set(got_live))
    extra = sorted(set(got_live) - set(want_live))
    differ = sorted(k for k in set(got_live) & set(want_live) if got_live[k] != want_live[k])
    assert not (missing or extra or differ), (
        f"{what} state differs from the server's: {len(missing)} missing (e.g. {missing[:5]}), "
        f"{len(extra)} extra (e.g. {extra[:5]}), {len(differ)} differ "
        f"(e.g. {[(k, got_live[k][0], want_live[k][0]) for k in differ[:5]]})"
    )


def assert_matches_model(mirror: Mirror, model: dict[bytes, bytes | None]) -> None:
    """Every key of the writer's model: live with its last value, or (deleted) absent/deleted."""
    live = mirror.values()
    wrong = []
    for key, value in model.items():
        if value is None:
            if key in live:
                wrong.append((key, "deleted but live"))
        elif live.get(key) != value:
            wrong.append((key, "missing" if key not in live else "stale value"))
    assert not wrong, f"{len(wrong)} keys differ from the model, e.g. {wrong[:5]}"
    unknown = set(live) - set(model)
    assert not unknown, f"keys never written: {sorted(unknown)[:5]}"


@contextlib.asynccontextmanager
async def rss_sampler(node: NodeProcess, period_s: float = 0.05) -> Any:
    """Sample the node's VmRSS in the background; yields a list that ends up holding samples."""
    samples: list[int] = []

    async def sample() -> None:
        while True:  # until cancelled
            with contextlib.suppress(OSError, KeyError):
                samples.append(node.rss_bytes())
            await asyncio.sleep(period_s)

    task = asyncio.get_running_loop().create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
