"""Processes ``bench_node.py`` starts: a changefeed node, a redis-server, a py-spy sampler.

Each is a context manager that stops its process on exit, whatever happened, and every wait
has a deadline. Nothing here measures anything.
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
    """Stop every child still running (from a signal handler: the run is being abandoned)."""
    for proc in list(LIVE):
        with contextlib.suppress(RuntimeError, OSError):
            _stop(proc, deadline_s)


class NodeProcess:
    """``changefeed serve`` on a free loopback port; ``stop()`` / ``start()`` restart it."""

    def __init__(self, data_dir: Path, *, vbuckets: int, extra: list[str] | None = None) -> None:
        self.data_dir = data_dir
        self.vbuckets = vbuckets
        self.extra = extra or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        ready = self.data_dir.parent / f"{self.data_dir.name}.ready"
        ready.unlink(missing_ok=True)
        command = [
            _bin("changefeed"), "serve", "--data-dir", str(self.data_dir), "--port", "0",
            "--ready-file", str(ready), "--vbuckets", str(self.vbuckets), "--log-level",
            "WARNING", *self.extra,
        ]  # fmt: skip
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = _spawn(command, log)
        deadline = time.monotonic() + READY_DEADLINE_S
        while True:  # bounded by the deadline
            if ready.exists() and ready.read_text().strip():
                self.port = int(ready.read_text())
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"node exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"node not ready in {READY_DEADLINE_S} s; see {self.log_path}")
            time.sleep(POLL_S)

    def stop(self) -> float:
        """Clean stop (SIGTERM); returns seconds taken. Raises if the exit was not clean."""
        assert self.proc is not None
        started = time.perf_counter()
        _stop(self.proc, STOP_DEADLINE_S)
        if self.proc.returncode != 0:
            raise RuntimeError(f"node exited with {self.proc.returncode}; see {self.log_path}")
        return time.perf_counter() - started

    def __enter__(self) -> NodeProcess:
        self.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self.proc is None:
            return
        running = self.proc.poll() is None
        _stop(self.proc, STOP_DEADLINE_S)
        if exc_type is None and self.proc.returncode != 0:
            raise RuntimeError(f"node exited with {self.proc.returncode}; see {self.log_path}")
        if exc_type is not None:  # say what the node was doing when the run failed
            state = "was running" if running else f"had exited with {self.proc.returncode}"
            tail = self.log_path.read_text(errors="replace").splitlines()[-20:]
            print(f"# node pid {self.proc.pid} {state}; {self.log_path} ends:", file=sys.stderr)
            print("\n".join(f"#   {line}" for line in tail), file=sys.stderr)


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
