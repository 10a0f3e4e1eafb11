"""The Spark mirror job of a chaos run: ``changefeed mirror --cluster h1:p1,... --tables DIR``
as a subprocess in its own process group (the JVM and its Python workers die with it), and
its final state read from the Delta table (``deltalake``, no Spark in the test process)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from deltalake import DeltaTable

from .history import Version

STOP_WAIT_S = 60.0


class MirrorJob:
    """One ``changefeed mirror`` process (binary documents: the loader's values are not JSON)."""

    def __init__(self, seeds: Sequence[str], tables: Path, log: Path) -> None:
        self.command = [
            sys.executable, "-m", "changefeed", "mirror", "--cluster", ",".join(seeds),
            "--tables", str(tables), "--format", "binary", "--trigger", "0.5 seconds",
        ]  # fmt: skip
        self.tables = tables
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> MirrorJob:
        with open(self.log, "ab") as handle:
            self.process = subprocess.Popen(
                self.command, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def state(self) -> dict[bytes, Version] | None:
        """key -> newest change the mirror table holds; None before its first commit."""
        path = self.tables / "mirror"
        if not DeltaTable.is_deltatable(str(path)):
            return None
        table = DeltaTable(str(path)).to_pyarrow_table(
            columns=["key", "seqno", "value", "cas", "rev_seqno"]
        )
        columns = [
            table.column(n).to_pylist() for n in ("key", "seqno", "value", "cas", "rev_seqno")
        ]
        return {
            key.encode("utf-8", "surrogateescape"): Version(seqno, value, cas, rev, False)
            for key, seqno, value, cas, rev in zip(*columns, strict=True)
        }

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self) -> int | None:
        """SIGTERM to the job (it finishes its micro-batch), SIGKILL to its group after
        ``STOP_WAIT_S``; returns its exit code."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(STOP_WAIT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the JVM and workers, whatever happened
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(10)
        return process.returncode
