"""Where a service lives: its marker files, control socket and shared-memory segments.

A service is named by the caller (the node names one per stream group) and lives in a
directory, ``$CHANGEFEED_IPC_DIR`` or ``/tmp/changefeed-ipc`` by default (LoLa uses
``/tmp/mw_com_lola/partial_restart``). In that directory:

* ``<service>.exist`` — existence marker. The provider holds an exclusive ``flock`` on it for
  its life; a second provider cannot get it and is refused. The OS drops the lock when the
  provider dies, so a leftover file never blocks a restart.
* ``<service>.usage`` — usage marker. Every proxy holds a shared ``flock`` on it while it has
  the segments mapped; a provider that can lock it exclusively knows no proxy is attached.
* ``<service>.ctl`` — the provider's unix datagram control socket (outdated-pid notices).
* ``<service>.rollback`` — rollback lock. Whoever rolls back a dead reader's transaction log (a
  restarting reader, or the provider reclaiming a reader that never returns) holds an exclusive
  ``flock`` on it meanwhile; the OS drops it when the holder dies, so it never stays taken.

The segments are POSIX shared memory (``/dev/shm`` on Linux), named after the service and a
hash of the directory: ``cfipc-<hash>-<service>-ctl`` and ``-data``. They are opened the way
``multiprocessing.shared_memory.SharedMemory`` opens them, but never registered with its
resource tracker: on Python < 3.13 the tracker unlinks a segment when the process that opened
it exits, and on a provider crash that would destroy exactly the state a restart must reuse.
Only the provider unlinks, and only while it holds the usage marker exclusively.

flock pitfalls handled here: locks belong to the open file description, so every process opens
the marker itself (``O_CLOEXEC``; never inherited through fork+exec); a lock taken on a file
that was unlinked and recreated meanwhile is worthless, so after locking, the path must still
name the locked inode, or the lock is dropped and taken again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import mmap
import os
import re
import time
from pathlib import Path
from typing import Any, Final

from changefeed.ipc.errors import ServiceNotFoundError

try:  # the module SharedMemory uses: shm_open / shm_unlink (untyped in typeshed)
    _posixshmem: Any = importlib.import_module("_posixshmem")
except ImportError:  # pragma: no cover - not a POSIX system
    _posixshmem = None

DIR_ENV: Final = "CHANGEFEED_IPC_DIR"
DEFAULT_DIR: Final = Path("/tmp/changefeed-ipc")
SERVICE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}")
LOCK_RETRY_S: Final = 0.002


def service_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """The directory services live in, created (mode 0700) if missing."""
    path = Path(directory) if directory is not None else Path(os.environ.get(DIR_ENV, DEFAULT_DIR))
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return path


def check_service_name(service: str) -> str:
    if not SERVICE_NAME.fullmatch(service):
        raise ValueError(
            f"service name {service!r}: 1-100 characters of letters, digits, '_', '.', '-', "
            "starting with a letter or digit"
        )
    return service


class ServicePaths:
    """The files and segment names of one service in one directory."""

    def __init__(self, service: str, directory: str | os.PathLike[str] | None = None) -> None:
        self.service = check_service_name(service)
        self.directory = service_dir(directory)
        self.existence = self.directory / f"{service}.exist"
        self.usage = self.directory / f"{service}.usage"
        self.control_socket = self.directory / f"{service}.ctl"
        # Rollback lock: whoever rolls back a dead reader's log (a restarting reader, or the
        # provider reclaiming it) holds it exclusively, so one log is never rolled back twice.
        self.rollback_lock = self.directory / f"{service}.rollback"
        tag = hashlib.sha1(str(self.directory.resolve()).encode()).hexdigest()[:10]
        self.control_segment = f"/cfipc-{tag}-{service}-ctl"
        self.data_segment = f"/cfipc-{tag}-{service}-data"

    def wakeup_address(self, segment_id: int, log_index: int) -> bytes:
        """The abstract-namespace datagram address a reader of log `log_index` sleeps on.

        Abstract (Linux): it vanishes with the process, so a killed reader leaves no file.
        """
        return f"\0cfipc-{segment_id:016x}-{log_index}".encode()


# -- markers ---------------------------------------------------------------------------------


class Marker:
    """An open marker file and the flock held on it (closed: the lock is gone)."""

    def __init__(self, path: Path, fd: int, exclusive: bool) -> None:
        self.path = path
        self.fd = fd
        self.exclusive = exclusive

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the flock
            self.fd = -1

    def unlock(self) -> None:
        """Drop the lock but keep the file open."""
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def __repr__(self) -> str:
        mode = "exclusive" if self.exclusive else "shared"
        return f"Marker({str(self.path)!r}, {mode}, fd={self.fd})"


def try_lock(path: Path, *, exclusive: bool, create: bool, timeout_s: float = 0.0) -> Marker | None:
    """Open `path` and flock it; None if another holder keeps it past `timeout_s`.

    Raises:
        FileNotFoundError: `path` is missing and `create` is False.
    """
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    operation = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline (and by recreations of the file, which are rare)
        fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(fd, operation)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(LOCK_RETRY_S)
            continue
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return Marker(path, fd, exclusive)
        os.close(fd)  # the file was replaced after we opened it: lock the new one
        if not create and not path.exists():
            raise FileNotFoundError(errno.ENOENT, "marker removed", str(path))


def read_pid(path: Path) -> int:
    """The pid a provider wrote into its existence marker (0 if none or unreadable)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return 0
    return int(text) if text.isdigit() else 0


def write_pid(marker: Marker) -> None:
    os.ftruncate(marker.fd, 0)
    os.pwrite(marker.fd, f"{os.getpid()}\n".encode(), 0)


# -- segments --------------------------------------------------------------------------------


class Segment:
    """One mapped POSIX shared-memory segment."""

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self.size = len(mapping)
        self._mmap = mapping
        self.buf = memoryview(mapping)

    @classmethod
    def create(cls, name: str, size: int, mode: int = 0o600) -> Segment:
        """Create `name` exclusively, sized `size` (zero-filled).

        Raises:
            FileExistsError: it exists.
        """
        assert _posixshmem is not None, "POSIX shared memory is not available"
        fd = _posixshmem.shm_open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=mode)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                _posixshmem.shm_unlink(name)
            raise
        os.close(fd)
        return cls(name, mapping)

    @classmethod
    def open(cls, name: str, service: str = "") -> Segment:
        """Map an existing segment read-write.

        Raises:
            ServiceNotFoundError: no such segment.
        """
        assert _posixshmem is not None, "POSIX shared memory is not available"
        try:
            fd = _posixshmem.shm_open(name, os.O_RDWR, mode=0o600)
        except FileNotFoundError:
            raise ServiceNotFoundError(
                f"service {service or name!r} has no shared memory segment {name}"
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ServiceNotFoundError(f"segment {name} is empty (its creator died)")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(name, mapping)

    @staticmethod
    def unlink(name: str) -> bool:
        """Remove the name (mappings stay valid); False if it did not exist."""
        assert _posixshmem is not None, "POSIX shared memory is not available"
        try:
            _posixshmem.shm_unlink(name)
        except FileNotFoundError:
            return False
        return True

    @staticmethod
    def exists(name: str) -> bool:
        assert _posixshmem is not None, "POSIX shared memory is not available"
        try:
            fd = _posixshmem.shm_open(name, os.O_RDONLY, mode=0o600)
        except FileNotFoundError:
            return False
        os.close(fd)
        return True

    def close(self) -> bool:
        """Unmap; False if batches still refer to the memory (it is unmapped when they go)."""
        try:
            self.buf.release()
            self._mmap.close()
        except BufferError:
            return False
        return True
