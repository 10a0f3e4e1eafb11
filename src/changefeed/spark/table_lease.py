"""One mirror job per set of tables: a lease file in the tables' root.

Two queries writing the same tables would each skip the other's batch ids and interleave their
commits, so the second is refused at its first micro-batch with a one-line ``MirrorBusyError``.
The lease (``_changefeed_lease.json``: owner, host, pid, renewal time) is renewed by a daemon
thread every ``ttl_s / 3``; a lease not renewed for ``ttl_s`` has expired and is taken over. A
holder on this host whose process is gone (a SIGKILLed driver being restarted) is taken over at
once. Owners are processes: queries of one process share the lease.

Object stores have no exclusive create through this interface, so two jobs starting within the
same ~second could both write the lease; each re-reads it after a pause and the one that lost
refuses. (Delta's own conflict check does not help: blind appends do not conflict.)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any, Final

import pyarrow.fs as pafs

from changefeed.spark.delta_files import table_fs

log = logging.getLogger("changefeed.mirror")

LEASE_FILE: Final = "_changefeed_lease.json"
TTL_S: Final = 30.0
_SETTLE_S: Final = 0.2  # between writing the lease and reading it back


class MirrorBusyError(RuntimeError):
    """Another job holds the tables' lease; the message names it."""


class TablesLease:
    """The lease of the tables at ``root`` for this process (see the module docstring)."""

    def __init__(self, root: str, storage_options: dict[str, str] | None, ttl_s: float = TTL_S):
        self.root = root
        self.ttl_s = ttl_s
        self._fs: pafs.FileSystem = table_fs(root, storage_options)
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lost: str | None = None

    def hold(self) -> None:
        """Take the lease, or check that this process still holds it.

        Raises:
            MirrorBusyError: another live job holds it (or took it over after ours expired).
        """
        if self._lost is not None:
            raise MirrorBusyError(self._lost)
        if self._thread is not None:
            return
        held = self._read()
        if held is not None and self._blocks(held):
            raise MirrorBusyError(self._busy(held))
        self._write()
        time.sleep(_SETTLE_S)
        held = self._read()
        if held is None or held.get("owner") != self.owner:
            raise MirrorBusyError(self._busy(held or {}))
        self._thread = threading.Thread(target=self._renew, name="changefeed-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the lease up (the next job need not wait for it to expire)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        held = self._read()
        if held is not None and held.get("owner") == self.owner:
            self._fs.delete_file(LEASE_FILE)

    def _blocks(self, held: dict[str, Any]) -> bool:
        if held.get("owner") == self.owner:
            return False
        if time.time() - float(held.get("renewed", 0)) >= self.ttl_s:
            return False
        if held.get("host") == socket.gethostname():
            return _alive(int(held.get("pid", 0)))
        return True

    def _busy(self, held: dict[str, Any]) -> str:
        age = time.time() - float(held.get("renewed", 0))
        return (
            f"tables {self.root} are written by another mirror job ({held.get('owner', '?')}, "
            f"lease renewed {age:.0f} s ago, expires after {self.ttl_s:.0f} s): stop it, or "
            "give other --tables"
        )

    def _read(self) -> dict[str, Any] | None:
        try:
            with self._fs.open_input_stream(LEASE_FILE) as stream:
                data = json.loads(stream.read())
        except (FileNotFoundError, OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def _write(self) -> None:
        record = {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                  "renewed": time.time()}  # fmt: skip
        with self._fs.open_output_stream(LEASE_FILE) as out:
            out.write(json.dumps(record).encode())

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):  # bounded by release()
            held = self._read()
            if held is not None and held.get("owner") != self.owner:
                self._lost = self._busy(held)
                log.error("%s", self._lost)
                return
            try:
                self._write()
            except FileNotFoundError:  # the tables' directory is gone: nothing left to hold
                log.info("tables %s are gone: the lease is no longer renewed", self.root)
                return
            except OSError as error:  # the next renewal tries again; expiry is ttl_s away
                log.warning("cannot renew the lease of %s: %s", self.root, error)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
