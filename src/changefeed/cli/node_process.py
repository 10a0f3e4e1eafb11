"""Start and stop node processes (``changefeed serve``): the one launcher of ``changefeed demo``,
the integration and Spark tests, and the benchmarks.

A node runs in its own process, and its own process group, as in production. ``start`` passes
``--port`` (0 the first time, so the node binds any free port; the same port on every restart)
and ``--ready-file``, and waits until the node has written its bound port there. ``stop`` sends
SIGTERM: a clean shutdown (the node flushes, sets its clean-shutdown flag, and its next start
adds no failover entry). ``kill`` sends SIGKILL to the whole group: a crash, nothing flushed.
Everything a node owns lives under one root directory::

    root/data       the data directory (--data-dir)
    root/ready      the ready file (--ready-file)
    root/node.log   stdout and stderr of every start, appended, each start under a header line

By default a node listens on loopback (``--host 127.0.0.1``). The test hosts harness
(``tests/support/hosts.py``, ``docs/test-hosts.md``) passes ``host`` and ``netns``: the node then
runs inside that network namespace (``ip netns exec NAME``, which execs in place, so the pid is
the node's) and listens on, and publishes to the cluster map, that namespace's address.

What it does not do: create namespaces or addresses (the harness does), talk to the node (use
``KvClient`` or ``DcpClient``), or outlive its caller: every wait has a deadline, and a caller
that abandons a run calls ``stop_all()`` (the tests' fixtures stop each node by pid).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType

HOST = "127.0.0.1"  # nodes started here listen on loopback only
VBUCKETS_DEFAULT = 64  # the server's own default
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 60.0  # a clean stop flushes every vbucket first
KILL_WAIT_S = 10.0
POLL_S = 0.02
LOG_TAIL_LINES = 60
# Log lines that mean a bug in the node: tracebacks, ERROR/CRITICAL records (the "serve" log
# format puts the level between spaces), fatal transport errors and failed loop callbacks.
LOG_ERROR_MARKERS = ("Traceback", " ERROR ", " CRITICAL ", "Fatal error", "Exception in callback")

# Every node started in this process and not yet stopped, for stop_all().
_STARTED: weakref.WeakSet[NodeProcess] = weakref.WeakSet()


class NodeProcess:
    """One ``changefeed serve`` child process and the directory it owns.

    Use as a context manager (start on entry; stop on exit, with the node's state and log tail
    added as a note to any exception leaving the block), or call ``start`` and ``stop``.

    Args:
        root: directory of the node: its data directory, ready file and log (created on start).
        vbuckets: ``--vbuckets``.
        args: extra ``serve`` flags, e.g. ``["--no-durable", "--log-level", "WARNING"]``.
        env: environment variables set for the node, on top of this process's environment.
        ready_timeout_s: how long ``start`` waits for the node to serve, unless told otherwise.
        stop_timeout_s: how long ``stop`` (and leaving the ``with`` block) waits after SIGTERM,
            unless told otherwise.
        host: ``--host``, the listen address the node also publishes in the cluster map.
            Default loopback; another address only together with ``netns`` (one of the test
            hosts' namespaces, where that address lives).
        netns: run the node inside this network namespace (``ip netns exec NAME``; needs
            root). Default: this process's namespace.
        port: ``--port`` of the first start (0: any free port, read back from the ready file).
    """

    def __init__(
        self,
        root: Path,
        *,
        vbuckets: int = VBUCKETS_DEFAULT,
        args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        host: str = HOST,
        netns: str | None = None,
        port: int = 0,
    ) -> None:
        assert vbuckets >= 1, vbuckets
        assert 0 <= port <= 65535, port
        assert netns is not None or host == HOST, f"host {host!r} needs a netns of its own"
        self.root = root
        self.data_dir = root / "data"
        self.ready_file = root / "ready"
        self.log_path = root / "node.log"
        self.vbuckets = vbuckets
        self.args = list(args)
        self.env = dict(env or {})
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.host = host  # loopback unless the node runs in a namespace of the test hosts
        self.netns = netns
        self.port = port  # known once started; kept for restarts
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def __repr__(self) -> str:
        state = f"pid {self.process.pid}" if self.alive and self.process else "stopped"
        return f"NodeProcess({str(self.root)!r}, port {self.port}, {state})"

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """Process id of the node (also its process group id).

        Raises:
            RuntimeError: the node was never started.
        """
        return self._started().pid

    @property
    def alive(self) -> bool:
        """Whether the node process is running (one frozen by SIGSTOP counts as running)."""
        return self.process is not None and self.process.poll() is None

    @property
    def address(self) -> str:
        """``host:port`` of the node's KV/DCP listener (the port is 0 before the first start)."""
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The command line ``start`` runs (behind ``ip netns exec NAME`` with a ``netns``)."""
        inside = ["ip", "netns", "exec", self.netns] if self.netns is not None else []
        return [
            *inside,
            sys.executable, "-m", "changefeed", "serve",
            "--data-dir", str(self.data_dir),
            "--host", self.host,
            "--port", str(self.port),  # 0 the first time; the same port on restarts
            "--ready-file", str(self.ready_file),
            "--vbuckets", str(self.vbuckets),
            *self.args,
        ]  # fmt: skip

    def start(self, *, timeout_s: float | None = None) -> NodeProcess:
        """Start the node (on the same port after the first start) and wait until it serves.

        Returns:
            this node, with ``port`` set.

        Raises:
            RuntimeError: the node is already running, exited before it was ready, or was not
                ready in ``timeout_s`` (default ``ready_timeout_s``; it is then killed); the
                message holds its log tail.
        """
        if self.alive:
            raise RuntimeError(f"{self!r} is already running")
        self.root.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        command = self.command()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start #{self.starts + 1}: {' '.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: kill() reaches all of it
            )
        self.starts += 1
        _STARTED.add(self)
        self.wait_ready(timeout_s=timeout_s)
        return self

    def wait_ready(self, *, timeout_s: float | None = None) -> int:
        """Wait until the node has written its bound port to the ready file; returns the port.

        Raises:
            RuntimeError: the node exited first, or was not ready in ``timeout_s`` (default
                ``ready_timeout_s``; it is then killed); the message holds its log tail.
        """
        process = self._started()
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        while True:  # bounded by the deadline
            text = self.ready_file.read_text().strip() if self.ready_file.exists() else ""
            if text.isdigit():  # the node writes its port in one write(); empty: not yet
                self.port = int(text)
                return self.port
            if process.poll() is not None:
                raise RuntimeError(
                    f"node exited with {process.returncode} before it was ready "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"node not ready in {timeout_s} s, killed (log {self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(POLL_S)

    def stop(self, *, timeout_s: float | None = None, check: bool = True) -> int:
        """SIGTERM and wait: a clean shutdown (flush, clean-shutdown flag).

        A node that has already exited (killed, or crashed) is left as it is and its exit code
        returned, unchecked.

        Args:
            timeout_s: how long the node may take (default ``stop_timeout_s``); then it is
                killed (SIGKILL to its group).
            check: raise if the node did not exit with 0.

        Returns:
            the exit code: 0 after a clean stop; -N if signal N ended it.

        Raises:
            RuntimeError: the node was never started; or, with ``check``, it exited with a
                code other than 0 (the message holds its log tail).
            TimeoutError: it was still running after ``timeout_s`` (it has been killed).
        """
        process = self._started()
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        if process.poll() is not None:
            _STARTED.discard(self)
            return process.returncode
        process.send_signal(signal.SIGTERM)
        try:
            code = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(
                f"node ignored SIGTERM for {timeout_s} s, killed (log {self.log_path}):\n"
                f"{self.log_tail()}"
            ) from None
        _STARTED.discard(self)
        if check and code != 0:
            raise RuntimeError(
                f"node exited with {code} on SIGTERM (log {self.log_path}):\n{self.log_tail()}"
            )
        return code

    def kill(self) -> None:
        """SIGKILL the node's whole process group (a crash: nothing is flushed) and reap it.

        Does nothing if the node is not running.
        """
        process = self.process
        if process is None or process.poll() is not None:
            return
        # The group is the node's own (start_new_session) and still exists: the node is not
        # reaped yet. It may exit by itself meanwhile, so a missing group is fine.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(KILL_WAIT_S)
        _STARTED.discard(self)

    def restart(self, *, clean: bool = True, timeout_s: float | None = None) -> NodeProcess:
        """Stop (``clean``: SIGTERM, which must exit with 0; else SIGKILL) and start again on
        the same port and data directory.

        Raises:
            RuntimeError, TimeoutError: as ``stop`` (with ``check``) and ``start``.
        """
        if clean:
            self.stop()
        else:
            self.kill()
        return self.start(timeout_s=timeout_s)

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stop the node. Leaving normally, an unclean exit raises (as ``stop``). Leaving with an
        exception, the node is stopped unchecked (killed if it hangs) and a note on the
        exception says what the node was doing, with its log tail."""
        if self.process is None:
            return
        if exc is None:
            self.stop()
            return
        running = self.alive
        with contextlib.suppress(TimeoutError):  # then it was killed
            self.stop(check=False)
        state = "was running" if running else f"had exited with {self.process.returncode}"
        exc.add_note(f"node pid {self.process.pid} {state}; {self.log_path} ends:")
        exc.add_note(self.log_tail(20))

    def _started(self) -> subprocess.Popen[bytes]:
        if self.process is None:
            raise RuntimeError(f"node {self.root} was never started")
        return self.process

    # -- data directory -----------------------------------------------------------------------

    def copy_data(self, target: Path) -> Path:
        """Copy the data directory of the stopped node to ``target`` (the LMDB files of a
        stopped node are consistent); returns ``target``.

        Raises:
            RuntimeError: the node is running (use ``snapshot_data``).
        """
        if self.alive:
            raise RuntimeError("copy the data directory of a stopped node only")
        shutil.copytree(self.data_dir, target)
        return target

    def snapshot_data(self, target: Path) -> Path:
        """Copy the data directory of the *running* node, frozen with SIGSTOP meanwhile: what a
        volume snapshot takes (crash-consistent, and marked unclean since the node is running).
        Returns ``target``.

        Raises:
            RuntimeError: the node is not running (use ``copy_data``).
        """
        if not self.alive:
            raise RuntimeError("snapshot a running node only")
        process = self._started()
        process.send_signal(signal.SIGSTOP)
        try:
            shutil.copytree(self.data_dir, target)
        finally:
            process.send_signal(signal.SIGCONT)
        return target

    def restore_data(self, source: Path) -> None:
        """Replace the data directory of the stopped node with a copy of ``source`` (made by
        ``copy_data`` or ``snapshot_data``).

        Raises:
            RuntimeError: the node is running.
        """
        if self.alive:
            raise RuntimeError("restore into a stopped node only")
        shutil.rmtree(self.data_dir, ignore_errors=True)
        shutil.copytree(source, self.data_dir)

    # -- observation ----------------------------------------------------------------------------

    def status_kib(self, field: str = "VmRSS") -> int:
        """A field of ``/proc/PID/status`` in KiB (VmRSS, RssAnon, VmHWM...). Linux only.

        Raises:
            KeyError: no such field.
            OSError: the process is gone.
        """
        with open(f"/proc/{self.pid}/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)

    def rss_bytes(self) -> int:
        """Resident set size of the node now (VmRSS), in bytes."""
        return self.status_kib("VmRSS") * 1024

    def source_options(self, **extra: str) -> dict[str, str]:
        """Options of the ``changefeed`` Spark source (and of ``MirrorWriter``) that reach this
        node, plus ``extra``."""
        return {"cluster": self.address, **extra}

    def log_text(self) -> str:
        """Everything the node wrote, over all its starts ("" before the first)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def errors_in_log(self) -> list[str]:
        """Log lines that mean a bug (``LOG_ERROR_MARKERS``): tracebacks, ERROR and CRITICAL
        records, fatal transport errors."""
        return [
            line
            for line in self.log_text().splitlines()
            if any(marker in line for marker in LOG_ERROR_MARKERS)
        ]


def stop_all(*, timeout_s: float = 20.0) -> list[NodeProcess]:
    """Stop every node started in this process that is still running: SIGTERM, then SIGKILL
    after ``timeout_s``. For a program abandoning a run (a signal handler, ``atexit``); returns
    the nodes it stopped. Exit codes are not checked."""
    stopped = []
    for node in list(_STARTED):
        if node.alive:
            with contextlib.suppress(TimeoutError, OSError):
                node.stop(timeout_s=timeout_s, check=False)
            node.kill()  # no-op unless the stop failed
            stopped.append(node)
    _STARTED.clear()
    return stopped
