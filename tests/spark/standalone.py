"""A Spark standalone cluster on loopback, from the pyspark installation: one master and N
workers, each its own ``spark-class`` process (and process group), stopped in ``stop()``.

Workers run Python with this interpreter (``PYSPARK_PYTHON``) and bind 127.0.0.1
(``SPARK_LOCAL_IP``); logs stay quiet through changefeed's ``SPARK_CONF_DIR``. ``start`` waits,
with a deadline, until the master's JSON status lists every worker ALIVE.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyspark

from changefeed.spark.session import CONF_DIR
from support.clients import free_port

SPARK_HOME = Path(pyspark.__file__).parent
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


class Standalone:
    """Master and workers of a standalone cluster; ``url`` is the master URL for sessions."""

    def __init__(self, root: Path, *, workers: int = 2, cores: int = 1, memory: str = "1g"):
        self.root = root
        self.workers = workers
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.webui_port = free_port()
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = {
            **os.environ,
            "SPARK_HOME": str(SPARK_HOME),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": sys.executable,
            "SPARK_CONF_DIR": str(CONF_DIR),
            "SPARK_LOG_DIR": str(root / "logs"),
        }

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spawn(self, name: str, *args: str) -> None:
        log = self.root / f"{name}.log"
        with open(log, "ab") as handle:
            proc = subprocess.Popen(
                [str(SPARK_HOME / "bin" / "spark-class"), *args],
                stdout=handle, stderr=subprocess.STDOUT, env=self.env, cwd=self.root,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append((name, proc))

    def start(self) -> Standalone:
        self.root.mkdir(parents=True, exist_ok=True)
        self._spawn(
            "master", "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--webui-port", str(self.webui_port),
        )  # fmt: skip
        deadline = time.monotonic() + START_TIMEOUT_S
        # Workers that find no master retry registration only after seconds of backoff.
        self._wait(deadline, lambda: self.alive_workers() >= 0, "the master")
        for i in range(self.workers):
            work = self.root / f"worker{i}"
            work.mkdir(exist_ok=True)
            self._spawn(
                f"worker{i}", "org.apache.spark.deploy.worker.Worker", self.url,
                "--host", "127.0.0.1", "--cores", str(self.cores), "--memory", self.memory,
                "--webui-port", str(free_port()), "--work-dir", str(work),
            )  # fmt: skip
        self._wait(deadline, lambda: self.alive_workers() == self.workers, "every worker")
        return self

    def _wait(self, deadline: float, ready: Callable[[], bool], what: str) -> None:
        while not ready():  # bounded by the deadline
            dead = [name for name, proc in self.procs if proc.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited:\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited too long for {what}:\n{self.log_tails()}")
            time.sleep(0.1)

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.webui_port}/json/", timeout=2) as r:
            answer: dict[str, Any] = json.loads(r.read())
            return answer

    def alive_workers(self) -> int:
        """Workers the master lists ALIVE; -1 while the master does not answer."""
        try:
            status = self.status()
        except (OSError, ValueError):  # not listening yet, or an empty answer while it starts
            return -1
        return sum(1 for w in status.get("workers", []) if w.get("state") == "ALIVE")

    def kill_worker(self, index: int) -> None:
        """SIGKILL one worker's process group (its executor JVM and Python workers too)."""
        for name, proc in self.procs:
            if name == f"worker{index}" and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM every process group (workers first), SIGKILL what outlives the timeout."""
        for _, proc in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):  # executors, Python workers
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for name, _ in self.procs:
            log = self.root / f"{name}.log"
            text = log.read_text(errors="replace").splitlines()[-lines:] if log.exists() else []
            out.append(f"--- {name} ---\n" + "\n".join(text))
        return "\n".join(out)
