"""Test hosts: every node, every etcd member and the test client in a network namespace of its
own, on a virtual network this module creates and removes, with faults injected on it.

Topology (``docs/test-hosts.md`` draws it)::

    host namespace  PREFIX-<name>   eth0 10.77.I.2/24, default route via 10.77.I.1
         | veth pair, created directly inside the two namespaces (nothing in the root one)
    router namespace PREFIX-r       vI 10.77.I.1/24 per host, ip_forward on

Each host sits on a /24 of its own, so every packet between two hosts crosses the router, and a
fault is a policy rule there: ``ip rule add from A to B blackhole`` drops A's packets to B in
silence (this kernel has no netem or tc filters; a silent drop is what a real partition does).
``Network.block`` drops one direction (one-way loss), ``cut`` both, ``isolate`` one host from
all the others, ``partition`` cuts groups from each other; ``heal`` deletes every rule.

Names: ``PREFIX`` is ``cfh<pid>x<n>``, unique per process and per network, so parallel runs
never collide; the veth names exist only inside the run's namespaces. Addresses 10.77.0.0/16
exist only inside those namespaces too.

``HostCluster`` builds on it: a router, a ``client`` host, a 3-member etcd (``e1``..``e3``,
``EtcdServer`` with ``netns``) and nodes ``n1``..``nN`` (``NodeProcess`` with ``netns`` and
``host``, port 11210, node ``nI`` given every etcd member, starting with
``e((I-1) % members + 1)``: ``serve --etcd a,b,c`` fails over between them). The test process
stays in the root namespace; ``in_netns`` runs a function in a thread that has entered a
namespace (``setns(2)`` affects the calling thread only), so the async helpers below (maps,
seqnos, copies) run from the client host. The official SDK, whose C++ core makes threads of its
own, runs as a process in the client namespace (``HostCluster.client_command``).

Cleanup: leaving ``HostCluster`` (or ``Network``) by any path stops every process it started by
pid (SIGTERM, then SIGKILL to its group), SIGKILLs anything else still inside its namespaces
(``ip netns pids``), and deletes every namespace (which deletes the veth pairs and unmounts the
``/run/netns`` bind mounts). ``leftovers(prefix)`` lists what would remain: the tests check it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from changefeed.cli.node_process import NodeProcess
from changefeed.cluster.etcd_server import EtcdServer, healthy
from changefeed.consumer import DcpClient
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import call, connect
from changefeed.protocol.opcode import Opcode
from changefeed.vbmap import ClusterMap
from support.clients import AGENT, BUCKET, FEATURES, PASSWORD, USER, dcp_config, stats
from support.cluster import cluster_args
from support.consumer import Change, StreamedState, all_ended, drain
from support.latency import Delayer, open_tun

T = TypeVar("T")

SUBNET = "10.77"  # 10.77.I.0/24 per host, inside the run's namespaces only
HOSTS_MAX = 250
CLONE_NEWNET = 0x40000000  # <sched.h>
NODE_PORT = 11210
IP_TIMEOUT_S = 10.0
STOP_S = 10.0
RULE_PRIORITY_FIRST = 1000
DELAY_TABLE_FIRST = 100  # routing table of the router's first delay device (dl1)
MAP_WAIT_S = 60.0
ETCD_WAIT_S = 30.0
IN_NETNS_TIMEOUT_S = 300.0
COPY_READ_S = 60.0

_libc = ctypes.CDLL(None, use_errno=True)
_networks = itertools.count(1)


def new_prefix() -> str:
    """A name prefix no other run uses: this process's pid and a counter."""
    return f"cfh{os.getpid()}x{next(_networks)}"


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run ``ip [-n NETNS] ARGS``; returns stdout.

    Raises:
        subprocess.CalledProcessError: with ``check``, a non-zero exit (stderr in the message).
    """
    command = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(
            done.returncode, command, done.stdout, f"{' '.join(command)}: {done.stderr.strip()}"
        )
    return done.stdout


def _enter_netns(netns: str) -> None:
    """Move the calling thread (only it) into network namespace ``netns``."""
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into {netns}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def in_netns(
    netns: str, function: Callable[..., T], *args: Any, timeout_s: float = IN_NETNS_TIMEOUT_S
) -> T:
    """Call ``function(*args)`` in a new thread that first enters ``netns``: every socket it
    (and any thread it starts) opens lives there. Returns its result or raises its exception.

    Raises:
        TimeoutError: it did not return in ``timeout_s`` (the thread is left behind, daemonic).
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            _enter_netns(netns)
            box["result"] = function(*args)
        except BaseException as error:  # handed to the caller
            box["error"] = error

    thread = threading.Thread(target=run, name=f"in-{netns}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"{getattr(function, '__name__', function)} in {netns}: {timeout_s} s")
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result


@dataclass(frozen=True)
class Host:
    """One namespace on the network: ``name`` (n1, e2, client...), ``netns`` (its namespace),
    ``address`` (10.77.I.2) and ``index`` I."""

    name: str
    netns: str
    address: str
    index: int

    def command(self, *args: str) -> list[str]:
        """``args`` run inside this host (``ip netns exec``)."""
        return ["ip", "netns", "exec", self.netns, *args]


class Network:
    """A router namespace and hosts attached to it; faults as blackhole rules on the router.

    Use as a context manager (``close`` on exit, whatever happens), or call ``create`` and
    ``close``.
    """

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or new_prefix()
        self.router = f"{self.prefix}-r"
        self.hosts: dict[str, Host] = {}
        self.namespaces: list[str] = []  # every namespace created, for close
        self._rules: dict[tuple[str, str], int] = {}  # (source, target) -> rule priority
        self._priorities = itertools.count(RULE_PRIORITY_FIRST)
        self._delayed: dict[tuple[str, str], tuple[int, str, int]] = {}  # -> priority, iif, table
        self._delayers: dict[float, tuple[Delayer, int]] = {}  # delay_s -> delayer, its table
        self._devices = itertools.count(1)

    def __repr__(self) -> str:
        return (
            f"Network({self.prefix}, {len(self.hosts)} hosts, {len(self._rules)} drop rules, "
            f"{len(self._delayed)} delayed pairs {list(self._delayers)})"
        )

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self.namespaces.append(name)  # only once it exists: close deletes what exists
        ip("link", "set", "lo", "up", netns=name)

    def create(self) -> Network:
        """Create the router namespace (forwarding on)."""
        assert not self.namespaces, self.namespaces
        self._add_namespace(self.router)
        forward = ["ip", "netns", "exec", self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"]
        subprocess.run(forward, check=True, capture_output=True, timeout=IP_TIMEOUT_S)
        return self

    def add_host(self, name: str) -> Host:
        """A namespace ``PREFIX-name`` with one veth to the router, its own /24."""
        assert name not in self.hosts, name
        assert self.namespaces, "create() first"
        index = len(self.hosts) + 1
        assert index <= HOSTS_MAX, index
        host = Host(name, f"{self.prefix}-{name}", f"{SUBNET}.{index}.2", index)
        gateway = f"{SUBNET}.{index}.1"
        self._add_namespace(host.netns)
        # Both ends are created inside their namespaces: no name ever appears in the root one.
        ip("link", "add", "eth0", "netns", host.netns, "type", "veth",
           "peer", "name", f"v{index}", "netns", self.router)  # fmt: skip
        ip("addr", "add", f"{host.address}/24", "dev", "eth0", netns=host.netns)
        ip("link", "set", "eth0", "up", netns=host.netns)
        ip("route", "add", "default", "via", gateway, netns=host.netns)
        ip("addr", "add", f"{gateway}/24", "dev", f"v{index}", netns=self.router)
        ip("link", "set", f"v{index}", "up", netns=self.router)
        self.hosts[name] = host
        return host

    # -- faults ---------------------------------------------------------------------------------

    def block(self, sources: Iterable[Host], targets: Iterable[Host]) -> None:
        """Drop, in silence, every packet from each of ``sources`` to each of ``targets`` (one
        direction: the other keeps flowing)."""
        targets = list(targets)
        for source in sources:
            for target in targets:
                if source == target or (source.address, target.address) in self._rules:
                    continue
                priority = next(self._priorities)
                ip("rule", "add", "from", source.address, "to", target.address,
                   "priority", str(priority), "blackhole", netns=self.router)  # fmt: skip
                self._rules[(source.address, target.address)] = priority

    def cut(self, side: Iterable[Host], other: Iterable[Host]) -> None:
        """Drop every packet between ``side`` and ``other``, both directions."""
        side, other = list(side), list(other)
        self.block(side, other)
        self.block(other, side)

    def isolate(self, host: Host) -> None:
        """Cut ``host`` from every other host (nodes, etcd, client)."""
        self.cut([host], [h for h in self.hosts.values() if h != host])

    def partition(self, *groups: Sequence[Host]) -> None:
        """Cut each group from every other group (hosts in no group reach everyone)."""
        for i, side in enumerate(groups):
            for other in groups[i + 1 :]:
                self.cut(side, other)

    def delay(self, sources: Iterable[Host], targets: Iterable[Host], delay_s: float) -> None:
        """Hold every packet from each of ``sources`` to each of ``targets`` ``delay_s`` in the
        router before forwarding it (one direction; ``support.latency`` says how)."""
        targets = list(targets)
        table = self._delayer(delay_s)
        for source in sources:
            for target in targets:
                if source == target or (source.address, target.address) in self._delayed:
                    continue
                priority, iif = next(self._priorities), f"v{source.index}"
                ip("rule", "add", "from", source.address, "to", target.address, "iif", iif,
                   "priority", str(priority), "lookup", str(table), netns=self.router)  # fmt: skip
                self._delayed[(source.address, target.address)] = (priority, iif, table)

    def slow(self, host: Host, delay_s: float) -> None:
        """Delay every packet between ``host`` and every other host, both directions (its
        round trip to anyone grows by ``2 * delay_s``)."""
        rest = [h for h in self.hosts.values() if h != host]
        self.delay([host], rest, delay_s)
        self.delay(rest, [host], delay_s)

    def _delayer(self, delay_s: float) -> int:
        """The routing table whose packets are held ``delay_s``: a TUN device in the router and
        its forwarding thread, made on first use."""
        if delay_s in self._delayers:
            return self._delayers[delay_s][1]
        number = next(self._devices)
        device, table = f"dl{number}", DELAY_TABLE_FIRST + number
        delayer = Delayer(in_netns(self.router, open_tun, device), delay_s)
        self._delayers[delay_s] = (delayer, table)  # close() closes it whatever fails next
        ip("link", "set", device, "up", netns=self.router)
        ip("route", "add", "default", "dev", device, "table", str(table), netns=self.router)
        for conf in ("all", device):  # packets written back arrive on dl, sourced elsewhere
            sysctl = ["sysctl", "-qw", f"net.ipv4.conf.{conf}.rp_filter=0"]
            subprocess.run(
                ["ip", "netns", "exec", self.router, *sysctl],
                check=True, capture_output=True, timeout=IP_TIMEOUT_S,
            )  # fmt: skip
        delayer.start()
        return table

    def heal(self) -> None:
        """Delete every drop rule and every delay (rules, devices, forwarding threads)."""
        for (source, target), priority in list(self._rules.items()):
            ip("rule", "del", "from", source, "to", target,
               "priority", str(priority), "blackhole", netns=self.router)  # fmt: skip
            del self._rules[(source, target)]
        assert not self._rules, self._rules
        for (source, target), (priority, iif, table) in list(self._delayed.items()):
            ip("rule", "del", "from", source, "to", target, "iif", iif,
               "priority", str(priority), "lookup", str(table), netns=self.router)  # fmt: skip
            del self._delayed[(source, target)]
        self._close_delayers()

    def _close_delayers(self) -> None:
        while self._delayers:
            _, (delayer, _) = self._delayers.popitem()
            delayer.close()

    @property
    def delayers(self) -> list[Delayer]:
        """The delays in place now (each counts the packets it forwarded)."""
        return [delayer for delayer, _ in self._delayers.values()]

    @property
    def drops(self) -> list[tuple[str, str]]:
        """(source, target) addresses whose packets are dropped now."""
        return sorted(self._rules)

    # -- clean up -------------------------------------------------------------------------------

    def close(self) -> list[str]:
        """SIGKILL any process still inside the namespaces, then delete them all (the veths and
        the ``/run/netns`` mounts go with them). Returns what is left over (nothing, normally)."""
        self._delayed.clear()  # the rules go with the router namespace
        self._close_delayers()  # the forwarding threads stop; the TUN devices go
        for name in reversed(self.namespaces):
            for pid in _netns_pids(name):  # processes of this run only: they live in its netns
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        errors = []
        for name in reversed(self.namespaces):
            deadline = time.monotonic() + STOP_S
            while _netns_pids(name) and time.monotonic() < deadline:
                time.sleep(0.05)
            try:
                ip("netns", "del", name)
            except subprocess.CalledProcessError as error:
                errors.append(str(error.stderr))
        self.namespaces.clear()
        self.hosts.clear()
        self._rules.clear()
        return leftovers(self.prefix) + errors

    def __enter__(self) -> Network:
        return self.create()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def _netns_pids(netns: str) -> list[int]:
    done = subprocess.run(
        ["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=IP_TIMEOUT_S
    )
    return [int(p) for p in done.stdout.split() if p.isdigit()] if done.returncode == 0 else []


def leftovers(prefix: str) -> list[str]:
    """What a run with names starting ``prefix`` left behind: namespaces, mounts under
    ``/run/netns``, links in the root namespace, processes in those namespaces."""
    found = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(prefix):
            found.append(f"namespace {name} (pids {_netns_pids(name)})")
    for line in Path("/proc/self/mounts").read_text().splitlines():
        if f"/run/netns/{prefix}" in line:
            found.append(f"mount {line.split()[1]}")
    for line in ip("-o", "link", "show").splitlines():
        if prefix in line:
            found.append(f"link {line.split(':')[1].strip()}")
    return found


def reap_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone (a run killed with SIGKILL cannot
    clean up; its pid is in its names, ``cfh<pid>x<n>-...``). Returns the names deleted."""
    deleted = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(r"cfh(\d+)x\d+-.+", name)
        if match is None or not process_gone(int(match.group(1))):
            continue
        for pid in _netns_pids(name):  # the dead run's own processes, left in its namespace
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.CalledProcessError):  # deleted meanwhile
            ip("netns", "del", name)
            deleted.append(name)
    return deleted


def process_gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (absent, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


# -- a cluster on the test hosts ----------------------------------------------------------------


class HostCluster:
    """Nodes ``n1``..``nN`` and a ``members``-member etcd, each on a host of its own, and a
    ``client`` host; the nodes joined as cluster ``cluster`` with ``replicas`` replicas.

    Use as a context manager: entering builds everything and waits until every node serves a
    map placing every vbucket; leaving (also on an exception, with log tails added to it as
    notes) stops every process by pid and removes the network.

    Args:
        workdir: data directories and logs (``workdir/n1/node.log``, ``workdir/e1.log``...).
        nodes, replicas, vbuckets: the cluster's shape.
        members: etcd members (3: a real quorum; 1: a single member).
        failover_timeout_s: ``--failover-timeout-s`` (the node lease).
        node_args: more ``serve`` flags for every node.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        nodes: int = 3,
        replicas: int = 2,
        vbuckets: int = 16,
        members: int = 3,
        cluster: str = "hosts",
        failover_timeout_s: int = 3,
        node_args: Iterable[str] = (),
    ) -> None:
        assert nodes >= 1, nodes
        assert 0 <= replicas < nodes, (replicas, nodes)
        assert members >= 1, members
        self.workdir = workdir
        self.node_count = nodes
        self.replicas = replicas
        self.vbuckets = vbuckets
        self.member_count = members
        self.cluster = cluster
        self.failover_timeout_s = failover_timeout_s
        self.node_args = list(node_args)
        self.network = Network()
        self.prefix = self.network.prefix
        self.client: Host | None = None
        self.etcd: list[EtcdServer] = []
        self.etcd_hosts: list[Host] = []
        self.nodes: list[NodeProcess] = []
        self.node_hosts: list[Host] = []
        self.pids: list[int] = []  # every process started, for the cleanup check

    def __repr__(self) -> str:
        return f"HostCluster({self.prefix}, {self.node_count} nodes, {self.member_count} etcd)"

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> HostCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network.create()
        self.client = self.network.add_host("client")
        self.etcd_hosts = [self.network.add_host(f"e{i}") for i in range(1, self.member_count + 1)]
        self.node_hosts = [self.network.add_host(f"n{i}") for i in range(1, self.node_count + 1)]
        peers = ",".join(f"{h.name}=http://{h.address}:2380" for h in self.etcd_hosts)
        for host in self.etcd_hosts:
            server = EtcdServer(
                self.workdir / host.name, name=host.name, host=host.address, netns=host.netns,
                initial_cluster=peers, cluster_token=self.prefix,
            )  # fmt: skip
            self.etcd.append(server)
            server.start(wait=False)
            self.pids.append(server.pid)
        self.wait_etcd_healthy()
        for i, host in enumerate(self.node_hosts):
            args = cluster_args(
                self.etcd_endpoint(i), self.cluster, host.name, count=self.node_count,
                replicas=self.replicas,
                extra=["--failover-timeout-s", str(self.failover_timeout_s), *self.node_args],
            )  # fmt: skip
            node = NodeProcess(
                self.workdir / host.name, vbuckets=self.vbuckets, args=args,
                host=host.address, netns=host.netns, port=NODE_PORT,
            )  # fmt: skip
            self.nodes.append(node)
        for node in self.nodes:  # a node is ready (serving) before the first map is made
            node.start()
            self.pids.append(node.pid)
        self.run(self.wait_maps())
        return self

    def restart_node(self, index: int) -> NodeProcess:
        """Start node ``index`` (0-based) again after a stop or kill, in its namespace."""
        node = self.nodes[index]
        node.start()
        self.pids.append(node.pid)
        return node

    def restart_etcd(self, index: int) -> EtcdServer:
        """Start etcd member ``index`` (0-based) again (same data directory) and wait until
        the cluster is healthy."""
        server = self.etcd[index]
        server.start(wait=False)
        self.pids.append(server.pid)
        self.wait_etcd_healthy()
        return server

    def stop(self) -> list[str]:
        """Stop every node and member by pid, remove the network; returns the leftovers."""
        with contextlib.ExitStack() as teardown:  # each step runs even if one fails
            teardown.callback(self.network.close)
            for server in self.etcd:
                teardown.callback(server.stop)
            for node in self.nodes:
                teardown.callback(_stop_node, node)
        return leftovers(self.prefix) + [f"pid {p}" for p in self.pids if not process_gone(p)]

    def __enter__(self) -> HostCluster:
        try:
            return self.start()
        except BaseException as error:
            self._notes(error)
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc is not None:
            self._notes(exc)
        self.stop()

    def _notes(self, error: BaseException) -> None:
        error.add_note(f"{self!r}; drops {self.network.drops}")
        for node in self.nodes:
            error.add_note(f"--- {node.root.name} ({node.address}) log tail:")
            error.add_note(node.log_tail(15))
        for server in self.etcd:
            error.add_note(f"--- {server.name} log tail:\n{server.log_tail(5)}")

    # -- where things are -----------------------------------------------------------------------

    def etcd_endpoint(self, node_index: int) -> str:
        """Every etcd member, for ``serve --etcd a,b,c``: node ``node_index`` (0-based) starts
        on member ``node_index % members`` and fails over to the next ones in turn, so the
        nodes still spread over the members."""
        first = node_index % len(self.etcd)
        ordered = self.etcd[first:] + self.etcd[:first]
        return ",".join(server.endpoint for server in ordered)

    def host_of(self, node: NodeProcess) -> Host:
        return self.node_hosts[self.nodes.index(node)]

    def node_at(self, address: str) -> NodeProcess:
        """The node listening on ``address`` (``host`` or ``host:port``)."""
        host = address.split(":")[0]
        return next(n for n in self.nodes if n.host == host)

    def connection_string(self) -> str:
        """``couchbase://`` URL of every node (the SDK bootstraps from any)."""
        return "couchbase://" + ",".join(n.host for n in self.nodes)

    def client_command(self, *args: str) -> list[str]:
        """``args`` as a command run on the client host."""
        assert self.client is not None, "not started"
        return self.client.command(*args)

    def run(self, coroutine: Coroutine[Any, Any, T], *, timeout_s: float = 300.0) -> T:
        """Run ``coroutine`` to its end on the client host (a thread inside its namespace)."""
        assert self.client is not None, "not started"
        result: T = in_netns(self.client.netns, asyncio.run, coroutine, timeout_s=timeout_s)
        return result

    # -- etcd -----------------------------------------------------------------------------------

    def wait_etcd_healthy(self, *, timeout_s: float = ETCD_WAIT_S) -> None:
        """Wait until every running member says healthy (a quorum and a leader)."""
        assert self.client is not None
        deadline = time.monotonic() + timeout_s
        while True:  # bounded by timeout_s
            running = [s for s in self.etcd if s.alive]
            assert running, "no etcd member runs"
            down = [s.name for s in running if not in_netns(self.client.netns, healthy, s.endpoint)]
            if not down:
                return
            if time.monotonic() > deadline:
                tails = "\n".join(f"{s.name}: {s.log_tail(5)}" for s in self.etcd)
                raise TimeoutError(f"etcd members {down} not healthy in {timeout_s} s\n{tails}")
            time.sleep(0.1)

    def etcd_leader(self) -> int:
        """Index (0-based) of the etcd member that is the raft leader now.

        Raises:
            LookupError: no running member names itself leader.
        """
        assert self.client is not None
        for i, server in enumerate(self.etcd):
            if server.alive and in_netns(self.client.netns, _is_etcd_leader, server.endpoint):
                return i
        raise LookupError("no etcd leader")

    # -- nodes, from the client host (run these with ``run``) -----------------------------------

    async def wait_maps(self, *, timeout_s: float = MAP_WAIT_S) -> ClusterMap:
        """Wait until every running node serves a map placing every vbucket on its copies."""
        deadline = time.monotonic() + timeout_s
        while True:  # bounded by timeout_s
            maps = []
            for node in self.nodes:
                if node.alive:
                    with contextlib.suppress(OSError, TimeoutError, ConnectionError):
                        maps.append(await cluster_map(node))
            complete = [m for m in maps if m.rev >= 1 and len(m.nodes) > 1]
            if len(complete) == sum(n.alive for n in self.nodes):
                return max(complete, key=lambda m: m.rev)
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every node serves a map after {timeout_s} s")
            await asyncio.sleep(0.2)

    async def newest_map(self) -> ClusterMap:
        """The newest map any reachable node serves."""
        maps = []
        for node in self.nodes:
            if node.alive:
                with contextlib.suppress(OSError, TimeoutError, ConnectionError):
                    async with asyncio.timeout(5.0):
                        maps.append(await cluster_map(node))
        assert maps, "no node answers"
        return max(maps, key=lambda m: m.rev)

    async def wait_converged(self, *, timeout_s: float = 90.0) -> ClusterMap:
        """Wait until every node serves the same newest map and every replica copy's high
        seqno equals its active's; returns that map."""
        deadline = time.monotonic() + timeout_s
        behind: list[object] = []
        while time.monotonic() < deadline:
            try:
                async with asyncio.timeout(10.0):
                    behind = await self._behind()
            except (OSError, TimeoutError, ConnectionError, AssertionError) as error:
                behind = [repr(error)]
            if not behind:
                return await self.newest_map()
            await asyncio.sleep(0.3)
        details = await self._diagnose(behind)
        raise TimeoutError(f"not converged after {timeout_s} s: {behind[:8]}{details}")

    async def _diagnose(self, behind: list[object]) -> str:
        """What the actives say of the replicas behind (``STAT replication``), for the error."""
        lines = []
        with contextlib.suppress(OSError, TimeoutError, ConnectionError, AssertionError):
            async with asyncio.timeout(10.0):
                cmap = await self.newest_map()
                for vb in sorted({b[0] for b in behind if isinstance(b, tuple)})[:4]:
                    active = cmap.active(vb)
                    assert active is not None
                    found = await _stat(self.node_at(active.host), "replication")
                    mine = {k: v for k, v in found.items() if k.startswith(f"vb_{vb}:")}
                    lines.append(f"vb {vb} on active {active.host} (map rev {cmap.rev}): {mine}")
        return "".join(f"\n  {line}" for line in lines)

    async def wait_settled(self, *, timeout_s: float = 60.0) -> ClusterMap:
        """Wait until every running node serves the same map and it names an active for every
        vbucket (copies may still be catching up: writes may go on meanwhile)."""
        deadline = time.monotonic() + timeout_s
        revs: dict[str, int] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, TimeoutError, ConnectionError):
                async with asyncio.timeout(10.0):
                    revs = {n.host: (await cluster_map(n)).rev for n in self.nodes if n.alive}
                    cmap = await self.newest_map()
                placed = all(cmap.active(vb) is not None for vb in range(cmap.vbuckets))
                if len(set(revs.values())) == 1 and placed:
                    return cmap
            await asyncio.sleep(0.3)
        raise TimeoutError(f"no settled map after {timeout_s} s: revs {revs}")

    async def _behind(self) -> list[object]:
        revs = {n.host: (await cluster_map(n)).rev for n in self.nodes if n.alive}
        cmap = await self.newest_map()
        if len(set(revs.values())) > 1:
            return [f"map revs {revs}"]
        highs = {n.host: await seqnos(n) for n in self.nodes if n.alive}
        behind: list[object] = []
        for vb in range(cmap.vbuckets):
            active = cmap.active(vb)
            if active is None:
                behind.append((vb, "no active"))
                continue
            want = highs.get(active.host, {}).get(vb, (-1, -1))[0]
            for replica in cmap.replica_nodes(vb):
                got = highs.get(replica.host, {}).get(vb, (-1, -1))[0]
                if got != want:
                    behind.append((vb, replica.host, got, want))
        return behind

    async def copies(self, cmap: ClusterMap) -> dict[int, list[tuple[str, dict[bytes, Change]]]]:
        """Per vbucket, every copy (active first) as (node host, key -> newest change)."""
        out: dict[int, list[tuple[str, dict[bytes, Change]]]] = {}
        for vb in range(cmap.vbuckets):
            active = cmap.active(vb)
            assert active is not None, vb
            holders = [active, *cmap.replica_nodes(vb)]
            out[vb] = [(h.host, (await copy_of(self.node_at(h.host), [vb]))[vb]) for h in holders]
        return out


def _stop_node(node: NodeProcess) -> None:
    try:
        if node.alive:
            node.stop(timeout_s=STOP_S, check=False)
    except (TimeoutError, OSError) as error:  # TimeoutError: it was killed
        print(f"--- {node.root.name}: stop failed: {error!r}")
    finally:
        node.kill()


def _is_etcd_leader(endpoint: str) -> bool:
    request = urllib.request.Request(f"{endpoint}/v3/maintenance/status", data=b"{}")
    try:
        with urllib.request.urlopen(request, timeout=2.0) as reply:
            status = json.loads(reply.read())
    except (OSError, ValueError):
        return False
    return bool(status.get("leader")) and status["leader"] == status["header"]["member_id"]


# -- node readers that take the node's own address (support.clients dials 127.0.0.1) ------------


async def raw_connection(node: NodeProcess) -> Connection:
    """A connection to ``node`` at its address, after the handshake."""
    return await connect(
        node.host, node.port, agent=AGENT, user=USER, password=PASSWORD, bucket=BUCKET,
        features=FEATURES,
    )  # fmt: skip


async def cluster_map(node: NodeProcess) -> ClusterMap:
    """The map ``node`` serves (GET_CLUSTER_CONFIG)."""
    conn = await raw_connection(node)
    try:
        return ClusterMap.from_couchbase_config(
            json.loads((await call(conn, Opcode.GET_CLUSTER_CONFIG)).value)
        )
    finally:
        await conn.close()


async def _stat(node: NodeProcess, group: str) -> dict[str, str]:
    conn = await raw_connection(node)
    try:
        return await stats(conn, group)
    finally:
        await conn.close()


async def seqnos(node: NodeProcess) -> dict[int, tuple[int, int]]:
    """vb -> (high seqno, persisted seqno) of every copy ``node`` holds."""
    found = await _stat(node, "vbucket-seqno")
    out: dict[int, tuple[int, int]] = {}
    for key, value in found.items():
        if key.endswith(":high_seqno"):
            vb = int(key[3:].split(":")[0])
            out[vb] = (int(value), int(found[f"vb_{vb}:last_persisted_seqno"]))
    return out


async def purge_seqnos(node: NodeProcess) -> dict[int, int]:
    found = await _stat(node, "vbucket-seqno")
    return {
        int(key[3:].split(":")[0]): int(value)
        for key, value in found.items()
        if key.endswith(":purge_seqno")
    }


async def copy_of(node: NodeProcess, vbuckets: list[int]) -> dict[int, dict[bytes, Change]]:
    """``node``'s own copy of ``vbuckets`` (active or replica): per vb, key -> newest change."""
    state = StreamedState()
    config = dcp_config(node, host=node.host, follow_map=False)
    async with DcpClient(config) as client:
        await client.stream(vbuckets)
        try:
            await drain(client, state, all_ended(vbuckets), timeout_s=COPY_READ_S)
        except TimeoutError:
            raise TimeoutError(
                f"{node.root.name} ({node.host}): vbuckets {vbuckets} not read in {COPY_READ_S} s:"
                f" opened {sorted(state.opened)}, ended {state.ended}, last seqnos "
                f"{state.last_seqno}, rollbacks {state.rollbacks}, refused {state.refused}, "
                f"disconnects {state.disconnects}"
            ) from None
    out: dict[int, dict[bytes, Change]] = {}
    for vb in vbuckets:
        latest: dict[bytes, Change] = {}
        for change in state.history.get(vb, []):
            latest[change.key] = change
        out[vb] = latest
    return out
