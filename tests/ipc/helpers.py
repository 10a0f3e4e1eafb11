"""Child processes for the ipc tests: start one, follow its JSON events, kill it."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

CHILD = Path(__file__).with_name("child.py")
EVENT_TIMEOUT_S = 20.0


class Child:
    """``python tests/ipc/child.py <args>``; its stdout lines are events, in order."""

    def __init__(self, *args: str) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            self.events.append(event)
            self._queue.put(event)
        self._queue.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_for(self, *names: str, timeout_s: float = EVENT_TIMEOUT_S) -> dict[str, Any]:
        """The next event named one of `names` (earlier events are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.args[0]}: no {names} in {timeout_s} s; {self.tail()}")
            try:
                event = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if event is None:
                raise EOFError(f"{self.args[0]} exited before {names}; {self.tail()}")
            if event["event"] in names:
                return event

    def tail(self) -> str:
        return f"events {self.events[-5:]}, stderr {''.join(self._stderr[-20:])}"

    def kill(self) -> None:
        """kill -9, and reap (a zombie would still look alive to the rollback)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def terminate(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def exited(self, timeout_s: float = 10.0) -> int:
        return self.proc.wait(timeout=timeout_s)
