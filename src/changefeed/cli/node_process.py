"""Start and stop node processes (``changefeed serve``) for the demo and tests.

A node runs in its own process, as in production: it writes its bound port to a ready file, and
stops cleanly on SIGTERM (flush, clean-shutdown flag) or dies on SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_TIMEOUT_S = 30.0


class NodeProcess:
    def __init__(self, data_dir: Path, *, vbuckets: int = 64, extra: list[str] | None = None):
        self.data_dir = data_dir
        self.vbuckets = vbuckets
        self.extra = extra or []
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = data_dir.parent / f"{data_dir.name}.log"

    def start(self) -> int:
        """Start and wait until it serves; returns the port. Raises RuntimeError on failure."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ready = self.data_dir.parent / f"{self.data_dir.name}.port"
        ready.unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "changefeed", "serve", "--data-dir", str(self.data_dir),
            "--port", str(self.port), "--ready-file", str(ready),
            "--vbuckets", str(self.vbuckets), *self.extra,
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self.process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if ready.exists() and ready.read_text().strip():
                self.port = int(ready.read_text())
                return self.port
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.kill()
        tail = self.log_path.read_text(errors="replace")[-2000:]
        raise RuntimeError(f"node did not start (log {self.log_path}):\n{tail}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM: clean shutdown (flush). Falls back to SIGKILL after ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the node: nothing is flushed, as in a crash."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid
