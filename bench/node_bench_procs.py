"""Processes ``bench_node.py`` starts besides the node: a redis-server, a py-spy sampler.

The node is ``changefeed.cli.node_process.NodeProcess``, the launcher the demo and the tests use
(``node_process`` below sets the benchmark's flags and deadlines). Each is a context manager
that stops its process on exit, whatever happened, and every wait has a deadline;
``stop_children`` stops them all, nodes included, when a run is abandoned. Nothing here
measures anything.
"""

from __future__ import annotations

import collections
import contextlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from changefeed.cli.node_process import NodeProcess, stop_all

# Every child started here and not yet reaped, for stop_children() on SIGTERM/SIGINT.
LIVE: set[subprocess.Popen[bytes]] = set()
READY_DEADLINE_S = 60.0
STOP_DEADLINE_S = 120.0  # a clean node stop flushes every vbucket first
POLL_S = 0.02


def _bin(name: str) -> str:
    """``name`` next to this interpreter (the virtualenv's scripts), else on PATH."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found next to {sys.executable} or on PATH")
    return found


def _spawn(command: list[str], log: IO[bytes] | None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    LIVE.add(proc)
    return proc


def _stop(proc: subprocess.Popen[bytes], deadline_s: float, sig: int = signal.SIGTERM) -> None:
    """Send ``sig``, wait up to ``deadline_s``, then SIGKILL. No-op once it has exited."""
    try:
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10.0)
            raise RuntimeError(f"pid {proc.pid} ignored signal {sig} for {deadline_s} s") from None
    finally:
        if proc.poll() is not None:
            LIVE.discard(proc)


def stop_children(deadline_s: float = 20.0) -> None:
    """Stop every child still running, nodes too (from a signal handler: the run is being
    abandoned)."""
    stop_all(timeout_s=deadline_s)
    for proc in list(LIVE):
        with contextlib.suppress(RuntimeError, OSError):
            _stop(proc, deadline_s)


def node_process(root: Path, *, vbuckets: int, extra: list[str] | None = None) -> NodeProcess:
    """A node for the benchmark under ``root`` (not started: use it in a ``with`` block), with
    warnings-only logging and the benchmark's deadlines."""
    return NodeProcess(
        root,
        vbuckets=vbuckets,
        args=["--log-level", "WARNING", *(extra or [])],
        ready_timeout_s=READY_DEADLINE_S,
        stop_timeout_s=STOP_DEADLINE_S,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisProcess:
    """A redis-server on a free loopback port, no RDB snapshots, AOF only if ``extra`` asks."""

    def __init__(self, work_dir: Path, *, extra: list[str] | None = None) -> None:
        self.work_dir = work_dir
        self.extra = extra or ["--appendonly", "no"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.version = ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> RedisProcess:
        import redis

        self.work_dir.mkdir(parents=True, exist_ok=True)
        server = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.version = (
            subprocess.run(
                [server, "--version"], capture_output=True, text=True, timeout=10, check=True
            )
            .stdout.split()[2]
            .removeprefix("v=")
        )
        for _attempt in range(5):  # another process may take the free port first
            self.port = free_port()
            command = [
                server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--dir", str(self.work_dir), "--daemonize", "no", "--protected-mode", "no",
                "--logfile", str(self.work_dir / "redis.log"), *self.extra,
            ]  # fmt: skip
            self.proc = _spawn(command, None)
            deadline = time.monotonic() + READY_DEADLINE_S
            while self.proc.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(redis.ConnectionError):
                    client = redis.Redis(host="127.0.0.1", port=self.port)
                    try:
                        if client.ping():
                            return self
                    finally:
                        client.close()
                time.sleep(POLL_S)
            _stop(self.proc, 10.0)
        raise RuntimeError(f"redis-server did not start; see {self.work_dir / 'redis.log'}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            _stop(self.proc, 30.0)


class SpySampler:
    """``py-spy record`` of ``pid`` (raw collapsed stacks of busy threads) while in the block.

    Idle samples (the thread waiting in epoll) are not recorded, so percentages are of the
    time the process was on a CPU. ``--nonblocking``: the target is not paused to sample.
    """

    RATE_HZ = 250

    def __init__(self, pid: int, output: Path) -> None:
        self.pid = pid
        self.output = output
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> SpySampler:
        self.output.parent.mkdir(parents=True, exist_ok=True)
        command = [
            _bin("py-spy"), "record", "--pid", str(self.pid), "--format", "raw",
            "--nonblocking", "--rate", str(self.RATE_HZ), "--output", str(self.output),
        ]  # fmt: skip
        log = open(self.output.with_suffix(".log"), "wb")  # closed in __exit__
        self._log = log
        self.proc = _spawn(command, log)
        time.sleep(0.5)  # py-spy attaches before the measured work starts
        if self.proc.poll() is not None:
            raise RuntimeError(f"py-spy exited: {self.output.with_suffix('.log').read_text()}")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        try:
            _stop(self.proc, 60.0, signal.SIGINT)  # py-spy writes its output on SIGINT
        finally:
            self._log.close()


_LINE = re.compile(r":\d+\)$")


def top_self_time(raw_path: Path, count: int) -> list[str]:
    """Top ``count`` functions by own (leaf) samples from a py-spy raw file, with callers.

    Stacks of the sampler's own setup and teardown (``SpySampler``) are left out. A leaf of
    ``Runner.run`` is time in the event loop's C code (uvloop: socket reads and writes, epoll,
    callback dispatch), which py-spy cannot see into.
    """
    own: collections.Counter[str] = collections.Counter()
    callers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    total = 0
    if not raw_path.exists():
        return [f"  (no samples: {raw_path.with_suffix('.log')})"]
    for line in raw_path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        if not stack or "SpySampler" in stack:
            continue
        frames = [_LINE.sub(")", frame) for frame in stack.split(";")]
        n = int(samples)
        total += n
        own[frames[-1]] += n
        if len(frames) > 1:
            callers[frames[-1]][frames[-2].split(" (")[0]] += n
    lines = []
    for name, n in own.most_common(count):
        top = callers[name].most_common(1)
        via = f"  <- {top[0][0]}" if top else ""
        lines.append(f"  {100 * n / total:5.1f}%  {name}{via}")
    lines.append(f"  ({total} busy samples)")
    return lines
