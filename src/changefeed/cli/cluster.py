"""``changefeed cluster start | restart | status | stop | failover | add | remove``: a local
cluster of nodes on loopback, on etcd.

``start`` launches an etcd (unless ``--etcd URL`` names one) and N ``changefeed serve``
processes (through ``NodeProcess``, the one launcher), each with its own directory under
``--dir``, and records what it started in ``DIR/cluster.json``; it returns once the
orchestrator has written the first map and every node answers. The processes outlive the
command (each in its own process group); ``stop`` stops them by the recorded pids (nodes
first, with SIGTERM: a clean shutdown; then etcd). ``restart`` starts one recorded node again
in place (same port, data and flags; no rebalance) and records its new pid. The readiness
checks log in as the nodes' admin user, whose password the nodes take from
``CHANGEFEED_PASSWORD`` as this command does. ``status`` reads the map from etcd and each
copy's seqnos from its node (STAT ``vbucket-seqno``), plus the active's view of each replica
(STAT ``replication``) when the node has it, and leads with a summary of them. ``add`` and
``remove`` hand a rebalance request to the orchestrator (cluster/rebalance.py) and follow its
progress until the map is the target; ``add`` first starts the node in ``--dir`` (as ``start``
does), ``remove`` waits for the removed node to stop (it stops by itself once the map no
longer lists it).

Failures are one ``Error:`` line naming the endpoint, node or file: exit 1; usage errors exit 2.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import re
import time
from collections.abc import Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import click

from changefeed import limits
from changefeed.cli.certs import ADMIN_NAME, CA_CERT, CRL, ETCD_NAME, ensure_node_certificates
from changefeed.cli.node_process import NodeProcess
from changefeed.cluster.etcd_server import (
    EtcdServer,
    EtcdServerTls,
    free_port,
    process_runs,
    stop_pid,
)
from changefeed.cluster.failover import plan_failover
from changefeed.cluster.metadata import ClusterMetadata, EtcdTls, MetadataUnavailableError
from changefeed.cluster.rebalance import read_request, read_status, request_rebalance
from changefeed.consumer.handshake import connect
from changefeed.protocol.errors import AuthError, StatusError
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import REPLICAS_MAX, ClusterMap, NodeAddress

T = TypeVar("T")
RECORD = "cluster.json"
NODES_MAX = 64  # a local cluster on one machine
ETCD_CERTS_ENV = "CHANGEFEED_ETCD_CERTS"
START_TIMEOUT_S = 120.0  # etcd, N nodes, the first map
NODE_STOP_TIMEOUT_S = 60.0  # a clean stop flushes every vbucket first
STAT_TIMEOUT_S = 5.0
POLL_S = 0.1
REPLICATION_KEY = re.compile(r"vb_(\d+):replica:(.+):([a-z_]+)")


# -- the record of a started cluster -----------------------------------------------------------


def _record_path(directory: Path) -> Path:
    return directory / RECORD


def _read_record(directory: Path) -> dict[str, Any]:
    path = _record_path(directory)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise click.ClickException(
            f"no cluster in {directory}: {path} does not exist (changefeed cluster start "
            f"--dir {directory} makes one)"
        ) from None
    except (OSError, ValueError) as error:
        raise click.ClickException(f"cannot read {path}: {error}") from None
    if not isinstance(record, dict) or "etcd" not in record or "nodes" not in record:
        raise click.ClickException(f"{path} is not a cluster record")
    return record


def write_record(directory: Path, record: Mapping[str, Any]) -> None:
    """Write atomically (a crash leaves the old record or the new one, never half)."""
    path = _record_path(directory)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(temporary, path)


def _running(record: Mapping[str, Any]) -> list[str]:
    """Names of the recorded processes that still run."""
    alive = [
        node["name"]
        for node in record.get("nodes", [])
        if node.get("pid") and process_runs(int(node["pid"]), str(node["data_dir"]))
    ]
    if record.get("etcd_pid") and process_runs(
        int(record["etcd_pid"]), str(record["etcd_data_dir"])
    ):
        alive.append("etcd")
    return alive


def _where(
    directory: Path | None, etcd_url: str | None, name: str | None
) -> tuple[str, str, EtcdTls | None]:
    """The etcd endpoint, cluster name and what to present to etcd: from --etcd/--cluster or
    a directory's cluster.json (the CLI's certificate in its certs directory when etcd is
    https, or in $CHANGEFEED_ETCD_CERTS)."""
    if directory is None and etcd_url is None:
        raise click.UsageError("give --dir DIR or --etcd URL")
    certs: str | None = None
    if directory is not None:
        record = _read_record(directory)
        etcd_url = etcd_url or str(record["etcd"])
        name = name or str(record.get("cluster", "default"))
        certs = record.get("certs") if record.get("tls") else None
    assert etcd_url is not None
    return etcd_url, name or "default", etcd_tls(etcd_url, certs)


def etcd_tls(endpoint: str, certs: str | Path | None) -> EtcdTls | None:
    """What the CLI presents to an https etcd: the ``admin`` certificate of the cluster's certs
    directory (``cluster start --tls`` makes it; ``changefeed certs create --nodes admin``
    too), from cluster.json or $CHANGEFEED_ETCD_CERTS. None for a plain-http etcd.

    Raises:
        click.ClickException: etcd is https and no certs directory is known.
    """
    if not endpoint.lstrip().startswith("https://"):
        return None
    where = certs or os.environ.get(ETCD_CERTS_ENV)
    if not where:
        raise click.ClickException(
            f"etcd {endpoint} is https: give --dir of a `cluster start --tls`, or set "
            f"{ETCD_CERTS_ENV} to a directory with {CA_CERT}, {ADMIN_NAME}.pem and "
            f"{ADMIN_NAME}.key (changefeed certs create --nodes {ADMIN_NAME})"
        )
    folder = Path(where)
    return EtcdTls(folder / CA_CERT, folder / f"{ADMIN_NAME}.pem", folder / f"{ADMIN_NAME}.key")


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; an unreachable etcd becomes one ``Error:`` line."""
    try:
        return asyncio.run(coroutine)
    except MetadataUnavailableError as error:
        raise click.ClickException(str(error)) from None
    except ValueError as error:  # a malformed endpoint or cluster name, or a bad stored map
        raise click.ClickException(str(error)) from None


def _say(message: str) -> None:
    """Progress, on stderr (stdout stays for --json)."""
    click.echo(message, err=True)


# -- commands ----------------------------------------------------------------------------------


@click.group()
def cluster() -> None:
    """Start, inspect and stop a local cluster (etcd plus nodes on 127.0.0.1)."""


@cluster.command()
@click.option(
    "--nodes", "node_count", type=click.IntRange(1, NODES_MAX), default=3, show_default=True
)
@click.option("--replicas", type=click.IntRange(0, REPLICAS_MAX), default=1, show_default=True)
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="Holds cluster.json, etcd's data and one directory per node.",
)
@click.option(
    "--etcd", "etcd_url", help="Use this etcd (http://host:port) instead of starting one."
)
@click.option("--cluster", "name", default="default", show_default=True, help="Cluster name.")
@click.option(
    "--vbuckets", type=click.IntRange(1, limits.VBUCKETS_MAX), default=64, show_default=True
)
@click.option(
    "--base-port",
    type=click.IntRange(0, 65535),
    default=0,
    help="Node i listens on BASE_PORT + i (default: any free ports).",
)
@click.option("--timeout", "timeout_s", type=float, default=START_TIMEOUT_S, show_default=True)
@click.option("--log-level", default="INFO", show_default=True, help="The nodes' log level.")
@click.option(
    "--failover-timeout-s",
    type=click.IntRange(2, 3600),
    help="The nodes' lease TTL: a node cut off this long is failed over (a crash confirmed "
    "sooner). Default: serve's (5).",
)
@click.option(
    "--tls",
    is_flag=True,
    help="Nodes serve TLS too (ports after the plain ones), with certificates made in "
    "DIR/certs (a CA, a CRL, one per node, etcd's, the CLI's 'admin'); replicas stream over "
    "TLS, each node authenticated by its certificate; the etcd started here serves only "
    "TLS and asks every client for a certificate.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the record (cluster.json) as JSON.")
def start(
    node_count: int,
    replicas: int,
    directory: Path,
    etcd_url: str | None,
    name: str,
    vbuckets: int,
    base_port: int,
    timeout_s: float,
    log_level: str,
    failover_timeout_s: int | None,
    tls: bool,
    as_json: bool,
) -> None:
    """Start etcd (unless --etcd) and NODES nodes; return once the first map is written and
    every node serves. On a DIR whose cluster was stopped, start it again (same options: the
    same ports and data)."""
    if base_port and base_port + node_count - 1 > 65535:
        raise click.BadParameter(
            f"{base_port} + {node_count} nodes runs past port 65535", param_hint="'--base-port'"
        )
    directory.mkdir(parents=True, exist_ok=True)
    directory = directory.resolve()
    previous = _previous_run(directory, node_count, vbuckets, replicas, name, etcd_url)
    deadline = time.monotonic() + timeout_s
    record: dict[str, Any] = {
        "cluster": name,
        "etcd": etcd_url,
        "etcd_pid": None,
        "etcd_data_dir": None,
        "vbuckets": vbuckets,
        "replicas": replicas,
        "failover_timeout_s": failover_timeout_s,
        "tls": tls,
        "certs": str(directory / "certs"),
        "nodes": [],
        "started_at": time.time(),
    }
    server: EtcdServer | None = None
    nodes: list[NodeProcess] = []
    certs = directory / "certs"
    try:
        if tls:
            names = [f"node{i}" for i in range(node_count)]
            ensure_node_certificates(certs, [*names, ETCD_NAME, ADMIN_NAME])
        if etcd_url is None:
            server = EtcdServer(
                directory / "etcd",
                name=f"changefeed-{name}",
                # a restart keeps the ports: etcd's member record and the map name them
                client_port=int(previous.get("etcd_client_port", 0)),
                peer_port=int(previous.get("etcd_peer_port", 0)),
                tls=etcd_server_tls(certs) if tls else None,
            )
            try:
                server.start(timeout_s=min(limits.ETCD_START_TIMEOUT_S, timeout_s))
            except (RuntimeError, FileNotFoundError) as error:
                raise click.ClickException(str(error).splitlines()[0]) from None
            record.update(
                etcd=server.endpoint,
                etcd_pid=server.pid,
                etcd_data_dir=str(server.data_dir),
                etcd_client_port=server.client_port,
                etcd_peer_port=server.peer_port,
            )
            write_record(directory, record)
            _say(f"etcd {server.endpoint} (pid {server.pid}, log {server.log_path})")
        else:
            stored = run(_read_map(etcd_url, name, etcd_tls(etcd_url, certs if tls else None)))
            if stored is not None and not previous:
                raise click.ClickException(
                    f"cluster {name!r} already has a map (rev {stored.rev}) in etcd {etcd_url}: "
                    "pick another --cluster"
                )
            _say(f"etcd {etcd_url} (given)")
        endpoint = str(record["etcd"])
        for i in range(node_count):
            node_name = f"node{i}"
            args = node_args(
                endpoint, name, node_name, node_count, replicas, log_level, failover_timeout_s
            )
            if tls:
                args += tls_args(directory / "certs", node_name, base_port, node_count, i, previous)
            node = NodeProcess(
                directory / node_name,
                vbuckets=vbuckets,
                args=args,
                ready_timeout_s=max(1.0, deadline - time.monotonic()),
            )
            if base_port:
                node.port = base_port + i
            elif previous:  # a restart: the same ports, which the map names
                node.port = int(previous["nodes"][i]["port"])
            nodes.append(node)
        _say(f"starting {node_count} nodes under {directory}")
        start_nodes(nodes)  # together: a node may wait for the others before it serves
        record["nodes"] = [node_record(node) for node in nodes]
        write_record(directory, record)
        for node in nodes:
            _say(f"{node.root.name} {node.address} (pid {node.pid}, log {node.log_path})")
        _say("waiting for the first map and every node")
        cluster_map = run(
            wait_until_up(
                endpoint, name, nodes, deadline, etcd_tls(endpoint, certs if tls else None)
            )
        )
    except BaseException:
        _say("start failed: stopping what was started")
        stop_nodes(nodes)
        if server is not None:
            server.stop()
        record["stopped_at"] = time.time()
        if directory.exists():
            write_record(directory, record)
        raise
    _say(
        f"cluster {name!r} is up: map rev {cluster_map.rev}, {cluster_map.vbuckets} vbuckets, "
        f"{cluster_map.replicas} replicas on {len(cluster_map.nodes)} nodes "
        f"(changefeed cluster status --dir {directory})"
    )
    if as_json:
        click.echo(json.dumps(record, indent=1))


def node_args(
    endpoint: str,
    name: str,
    node_name: str,
    expected_nodes: int,
    replicas: int,
    log_level: str,
    failover_timeout_s: int | None = None,
) -> list[str]:
    """The ``serve`` flags of a node of a local cluster (besides NodeProcess's own)."""
    lease = () if failover_timeout_s is None else ("--failover-timeout-s", str(failover_timeout_s))
    return [
        *("--etcd", endpoint, "--cluster", name, "--node-name", node_name),
        *("--expected-nodes", str(expected_nodes), "--replicas", str(replicas)),
        *("--log-level", log_level),
        *lease,
    ]


def tls_args(
    certs: Path,
    node_name: str,
    base_port: int,
    node_count: int,
    index: int,
    previous: Mapping[str, Any],
) -> list[str]:
    """The TLS flags of node ``index`` of a ``cluster start --tls``: its TLS port (after the
    plain ports with --base-port; the one it had on a restart; else any free one), its
    certificate, the cluster CA (clients' certificates, dialling other nodes) and the CRL."""
    if base_port:
        port = base_port + node_count + index
    else:
        earlier: list[str] = []
        if previous and index < len(previous.get("nodes", [])):
            earlier = list(previous["nodes"][index].get("args", []))
        port = int(earlier[earlier.index("--tls-port") + 1]) if "--tls-port" in earlier else 0
        port = port or free_port()
    return [
        *("--tls-port", str(port), "--tls-cert", str(certs / f"{node_name}.pem")),
        *("--tls-key", str(certs / f"{node_name}.key"), "--tls-ca", str(certs / CA_CERT)),
        *("--tls-crl", str(certs / CRL)),
    ]


def etcd_server_tls(certs: Path) -> EtcdServerTls:
    """The files the etcd of a ``cluster start --tls`` serves with."""
    return EtcdServerTls(certs / f"{ETCD_NAME}.pem", certs / f"{ETCD_NAME}.key", certs / CA_CERT)


def node_record(node: NodeProcess) -> dict[str, Any]:
    """A node as cluster.json records it: where it runs, and how to start it again."""
    return {
        "name": node.root.name,
        "host": node.host,
        "port": node.port,
        "pid": node.pid,
        "root": str(node.root),
        "data_dir": str(node.data_dir),
        "log": str(node.log_path),
        "args": list(node.args),  # `cluster restart` starts it with these again
    }


def admin_credentials() -> tuple[str, str]:
    """The user a node creates on its first start (server/node.py): ``Administrator`` with the
    password ``CHANGEFEED_PASSWORD`` (default ``password``). The nodes inherit this process's
    environment, so the readiness checks log in as they do."""
    return "Administrator", os.environ.get("CHANGEFEED_PASSWORD", "password")


def start_nodes(nodes: list[NodeProcess]) -> None:
    """Start every node at once (threads: each start waits for its node's ready file).

    Raises:
        click.ClickException: a node failed to start (naming it and its log).
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        futures = {pool.submit(node.start): node for node in nodes}
        failures = []
        for future in concurrent.futures.as_completed(futures):
            error = future.exception()
            if error is not None:
                node = futures[future]
                first = str(error).splitlines()[0] if str(error) else repr(error)
                failures.append(f"{node.root.name}: {first} (log {node.log_path})")
    if failures:
        raise click.ClickException("; ".join(sorted(failures)))


def stop_nodes(nodes: list[NodeProcess]) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        for node in nodes:
            if node.process is not None:
                pool.submit(_stop_quietly, node)


def _stop_quietly(node: NodeProcess) -> None:
    with contextlib.suppress(TimeoutError, OSError, RuntimeError):
        node.stop(timeout_s=NODE_STOP_TIMEOUT_S, check=False)
    node.kill()


def _previous_run(
    directory: Path,
    node_count: int,
    vbuckets: int,
    replicas: int,
    name: str,
    etcd_url: str | None,
) -> dict[str, Any]:
    """The record of an earlier, stopped run from ``directory`` ({} if none): a restart must
    have the same shape (the data dirs and the map hold it) and reuses its ports.

    Raises:
        click.ClickException: the earlier run still runs, or had another shape.
    """
    if not _record_path(directory).exists():
        return {}
    old = _read_record(directory)
    alive = _running(old)
    if alive:
        raise click.ClickException(
            f"a cluster already runs from {directory} ({', '.join(alive)}): "
            f"changefeed cluster stop --dir {directory}"
        )
    if not old["nodes"]:
        return {}  # it never got as far as nodes
    shape = (len(old["nodes"]), old.get("vbuckets"), old.get("replicas"), old.get("cluster"))
    external = None if old.get("etcd_pid") else old.get("etcd")
    if shape != (node_count, vbuckets, replicas, name) or external != etcd_url:
        raise click.ClickException(
            f"{directory} holds cluster {old.get('cluster')!r} of {shape[0]} nodes, "
            f"{shape[1]} vbuckets, {shape[2]} replicas"
            + (f" on etcd {external}" if external else "")
            + ": restart it with the same options, or use a new --dir"
        )
    return old


async def _read_map(endpoint: str, name: str, tls: EtcdTls | None) -> ClusterMap | None:
    md = await ClusterMetadata.connect(endpoint, name, tls=tls)
    try:
        stored = await md.read_map()
        return None if stored is None else stored[0]
    finally:
        await md.close()


async def wait_until_up(
    endpoint: str,
    name: str,
    nodes: list[NodeProcess],
    deadline: float,
    tls: EtcdTls | None = None,
) -> ClusterMap:
    """Wait for the first map, every node registered, and every node answering STAT.

    Raises:
        click.ClickException: not so by ``deadline`` (naming what is missing).
    """
    md = await ClusterMetadata.connect(endpoint, name, tls=tls)
    try:
        names = {node.root.name for node in nodes}
        stored = None
        live: set[str] = set()
        while time.monotonic() < deadline:
            for node in nodes:
                if not node.alive:
                    raise click.ClickException(
                        f"{node.root.name} exited with {node.process and node.process.returncode}"
                        f" (log {node.log_path})"
                    )
            stored = await md.read_map()
            live = set(await md.live_nodes())
            if stored is not None and names <= live:
                break
            await asyncio.sleep(POLL_S)
        else:
            missing = sorted(names - live)
            raise click.ClickException(
                f"cluster {name!r} not up in time: "
                + ("no map yet" if stored is None else f"map rev {stored[0].rev}")
                + (f"; not registered: {', '.join(missing)}" if missing else "")
            )
        assert stored is not None
        user, password = admin_credentials()
        for node in nodes:
            await _check_serves(node, user, password)
        await _wait_replicas_connected(stored[0], nodes, deadline, user, password)
        return stored[0]
    finally:
        await md.close()


async def _wait_replicas_connected(
    cluster_map: ClusterMap, nodes: list[NodeProcess], deadline: float, user: str, password: str
) -> None:
    """Wait until every replica stream the map asks of ``nodes`` is connected, as each active
    reports it (STAT "replication"): until then a durable write to a vbucket whose replica has
    not yet connected is refused as DURABILITY_IMPOSSIBLE, which is not what "up" promises.

    Raises:
        click.ClickException: not so by ``deadline`` (naming the missing streams).
    """
    index = {address.name: i for i, address in enumerate(cluster_map.nodes)}
    missing: list[str] = []
    while True:
        missing = []
        for node in nodes:
            me = index.get(node.root.name)
            if me is None:
                continue
            wanted = [
                (vb, cluster_map.nodes[r].name)
                for vb, chain in enumerate(cluster_map.chains)
                if chain[0] == me
                for r in chain[1:]
                if r != -1
            ]
            if not wanted:
                continue
            try:
                stats = await stat(
                    node.host, node.port, "replication", STAT_TIMEOUT_S, user, password
                )
            except (OSError, TimeoutError, StatusError):
                stats = {}
            missing += [
                f"vb {vb} {node.root.name}->{replica}"
                for vb, replica in wanted
                if stats.get(f"vb_{vb}:replica:{replica}:connected") != "1"
            ]
        if not missing:
            return
        if time.monotonic() >= deadline:
            raise click.ClickException(
                f"replica streams not connected in time: {', '.join(missing[:8])}"
                + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            )
        await asyncio.sleep(POLL_S)


async def _check_serves(node: NodeProcess, user: str, password: str) -> None:
    """STAT "" of `node`, logged in as `user`.

    Raises:
        click.ClickException: it refused the login (naming CHANGEFEED_PASSWORD) or the STAT.
        OSError, TimeoutError, StatusError: it did not answer properly.
    """
    try:
        await stat(node.host, node.port, "", STAT_TIMEOUT_S, user, password)
    except AuthError:
        raise click.ClickException(
            f"{node.root.name} ({node.address}) refused user {user!r}: its users file "
            f"({node.data_dir / 'users.json'}) was made with another password; set "
            "CHANGEFEED_PASSWORD to that one"
        ) from None


@cluster.command()
@click.argument("node")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="The directory `cluster start` made (reads and updates its cluster.json).",
)
@click.option("--timeout", "timeout_s", type=float, default=START_TIMEOUT_S, show_default=True)
@click.option("--log-level", help="The node's log level (default: as it was started).")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def restart(
    node: str, directory: Path, timeout_s: float, log_level: str | None, as_json: bool
) -> None:
    """Start NODE again in place: same port, data and flags; no rebalance. A stopped or killed
    node comes back with its data and catches up from the actives (a vbucket it led that was
    failed over meanwhile, it holds as a replica); a running one is stopped cleanly first.
    cluster.json records the new process, so `cluster stop` stops it."""
    directory = directory.resolve()
    deadline = time.monotonic() + timeout_s
    record = _read_record(directory)
    known = _recorded_node(record, directory, node)
    endpoint, name, tls = _where(directory, None, None)
    if record.get("etcd_pid") and not process_runs(
        int(record["etcd_pid"]), str(record["etcd_data_dir"])
    ):
        raise click.ClickException(
            f"the etcd of {directory} is not running: changefeed cluster start --dir {directory} "
            "starts the whole cluster again"
        )
    stored = run(_read_map(endpoint, name, tls))
    if stored is not None and stored.node_index(node) is None:
        raise click.ClickException(
            f"{node} is not in map rev {stored.rev} (removed?): changefeed cluster add {node} "
            f"--dir {directory} brings it back with a rebalance"
        )
    was = "stopped"
    if known.get("pid") and process_runs(int(known["pid"]), str(known["data_dir"])):
        _say(f"stopping {node} (pid {known['pid']}) first")
        stop_pid(int(known["pid"]), str(known["data_dir"]), timeout_s=NODE_STOP_TIMEOUT_S)
        was = "running"
    process = _node_process(record, known, log_level)
    process.ready_timeout_s = max(1.0, deadline - time.monotonic())
    try:
        process.start()
    except (RuntimeError, TimeoutError, OSError) as error:
        first = str(error).splitlines()[0] if str(error) else repr(error)
        raise click.ClickException(f"{node}: {first} (log {process.log_path})") from None
    record["nodes"] = [node_record(process) if n["name"] == node else n for n in record["nodes"]]
    write_record(directory, record)  # at once: `cluster stop` must know the new pid
    _say(f"{node} {process.address} (pid {process.pid}, log {process.log_path})")
    _say(f"waiting for {node} to register and serve")
    cluster_map = run(wait_until_up(endpoint, name, [process], deadline, tls))
    roles = _roles_of(cluster_map, node)
    outcome = {"node": node, "was": was, "pid": process.pid, "port": process.port,
               "rev": cluster_map.rev, **roles}  # fmt: skip
    if as_json:
        click.echo(json.dumps(outcome))
        return
    click.echo(
        f"{node} is back on {process.address} (pid {process.pid}): map rev {cluster_map.rev}, "
        f"{roles['actives']} actives and {roles['replicas']} replicas on it; it catches up "
        f"from the actives (changefeed cluster status --dir {directory})"
    )


def _recorded_node(record: Mapping[str, Any], directory: Path, node: str) -> dict[str, Any]:
    """NODE's entry in cluster.json.

    Raises:
        click.ClickException: cluster.json has no such node (naming those it has).
    """
    known = next((n for n in record["nodes"] if n["name"] == node), None)
    if known is None:
        names = ", ".join(n["name"] for n in record["nodes"]) or "none"
        raise click.ClickException(
            f"no node {node!r} in {_record_path(directory)} (nodes: {names}); "
            f"changefeed cluster add {node} --dir {directory} adds one"
        )
    return dict(known)


def _node_process(
    record: Mapping[str, Any], known: Mapping[str, Any], log_level: str | None
) -> NodeProcess:
    """A NodeProcess that starts the recorded node as it was started (records made before
    cluster.json kept the flags get the flags `start` gives)."""
    args = known.get("args")
    if not isinstance(args, list):
        args = node_args(
            str(record["etcd"]), str(record.get("cluster", "default")), str(known["name"]),
            len(record["nodes"]), int(record.get("replicas", 1)), "INFO",
        )  # fmt: skip
    args = [str(a) for a in args]
    if log_level is not None and "--log-level" in args:
        args[args.index("--log-level") + 1] = log_level
    process = NodeProcess(
        Path(known.get("root") or Path(known["data_dir"]).parent),
        vbuckets=int(record.get("vbuckets", 64)),
        args=args,
    )
    process.port = int(known["port"])  # the port the map names
    return process


def _roles_of(cluster_map: ClusterMap, node: str) -> dict[str, int]:
    index = cluster_map.node_index(node)
    chains = cluster_map.chains
    return {
        "actives": sum(1 for chain in chains if index is not None and chain[0] == index),
        "replicas": sum(1 for chain in chains if index is not None and index in chain[1:]),
    }


@cluster.command()
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    help="A directory `cluster start` made (reads its cluster.json).",
)
@click.option("--etcd", "etcd_url", help="Or the etcd endpoint (http://host:port)...")
@click.option("--cluster", "name", help="...and the cluster name (default 'default').")
@click.option("--user", default="Administrator", show_default=True, envvar="CHANGEFEED_USER")
@click.option(
    "--password", default="password", envvar="CHANGEFEED_PASSWORD", help="Or CHANGEFEED_PASSWORD."
)
@click.option("--bucket", default="default", show_default=True)
@click.option("--brief", is_flag=True, help="Only the summary (no per-vbucket lines).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def status(
    directory: Path | None,
    etcd_url: str | None,
    name: str | None,
    user: str,
    password: str,
    bucket: str,
    brief: bool,
    as_json: bool,
) -> None:
    """A summary first (nodes up and down, actives and replicas per node, replicas in sync,
    the worst lag), then the map (with its rev) and per vbucket each copy's high and persisted
    seqnos, replica lag in items, and what the active reports of its replicas. --json has the
    summary under "summary"."""
    etcd_url, name, tls = _where(directory, etcd_url, name)
    report = run(_status(etcd_url, name, tls, user, password, bucket))
    report["summary"] = summarize(report)
    if as_json:
        click.echo(json.dumps(report, indent=1))
    else:
        click.echo(_render(report, details=not brief))


async def _status(
    endpoint: str, name: str, tls: EtcdTls | None, user: str, password: str, bucket: str
) -> dict[str, Any]:
    md = await ClusterMetadata.connect(endpoint, name, tls=tls)
    try:
        stored = await md.read_map()
        live = await md.live_nodes()
        leader = await md.leader()
        statuses = await md.node_statuses()
        rebalance = await read_status(md)
    finally:
        await md.close()
    in_map = set() if stored is None else {n.name for n in stored[0].nodes}
    stale = await _stale_registrations(
        [node for node_name, node in live.items() if node_name not in in_map], user, password
    )
    report: dict[str, Any] = {
        "cluster": name,
        "etcd": endpoint,
        "orchestrator": None if leader is None else {"name": leader[0], "token": leader[1]},
        "live_nodes": sorted(set(live) - set(stale)),
        "stale_registrations": stale,
        "map": None,
        "nodes": [],
        "vbuckets": [],
        "rebalance": None,
    }
    if rebalance is not None:
        report["rebalance"] = {
            k: v for k, v in rebalance.to_json().items() if k != "target"
        }  # the target is one chain per vbucket: in etcd for whoever needs it
    if stored is None:
        return report
    cluster_map, revision = stored
    report["map"] = {
        "rev": cluster_map.rev,
        "etcd_mod_revision": revision,
        "replicas": cluster_map.replicas,
        "vbuckets": cluster_map.vbuckets,
    }
    stats = await asyncio.gather(
        *(_node_stats(n.host, n.port, user, password, bucket) for n in cluster_map.nodes)
    )
    for node, (_, _, error) in zip(cluster_map.nodes, stats, strict=True):
        report["nodes"].append(
            {
                "name": node.name,
                "address": node.server,
                "live": node.name in live,
                "reachable": error is None,
                "error": error,
                "status": statuses.get(node.name),
            }
        )
    report["vbuckets"] = _vbucket_rows(cluster_map, stats)
    return report


async def _stale_registrations(outside: list[NodeAddress], user: str, password: str) -> list[str]:
    """Of the registered nodes the map does not list, those that do not answer: a node that
    stopped (after `cluster remove`, say) keeps its registration until its lease runs out
    (``limits.ETCD_LEASE_TTL_S_DEFAULT``); it is not live. One that answers (a node started to
    be added) is, even if it refuses this login."""

    async def answers(node: NodeAddress) -> bool:
        try:
            await stat(node.host, node.port, "", STAT_TIMEOUT_S, user, password)
        except (AuthError, StatusError, click.ClickException):
            return True  # it answered, if only to refuse
        except (OSError, TimeoutError):
            return False
        return True

    answered = await asyncio.gather(*(answers(node) for node in outside))
    return sorted(node.name for node, up in zip(outside, answered, strict=True) if not up)


async def _node_stats(
    host: str, port: int, user: str, password: str, bucket: str
) -> tuple[dict[str, str], dict[str, str], str | None]:
    """(vbucket-seqno stats, replication stats, error): empty dicts and an error line when the
    node does not answer; replication is empty when the node has no such group."""
    try:
        seqnos = await stat(host, port, "vbucket-seqno", STAT_TIMEOUT_S, user, password, bucket)
    except (OSError, TimeoutError, StatusError, AuthError, click.ClickException) as error:
        message = error.format_message() if isinstance(error, click.ClickException) else str(error)
        return {}, {}, f"{type(error).__name__}: {message}".strip()
    try:
        replication = await stat(host, port, "replication", STAT_TIMEOUT_S, user, password, bucket)
    except (OSError, TimeoutError, StatusError, click.ClickException):
        replication = {}  # an older node, or one without replicas
    return seqnos, replication, None


async def stat(
    host: str,
    port: int,
    group: str,
    timeout_s: float,
    user: str = "Administrator",
    password: str = "password",
    bucket: str = "default",
) -> dict[str, str]:
    """STAT ``group`` of the node at host:port, as a dict (bounded by ``timeout_s``).

    Raises:
        click.ClickException: the node refused the group.
        OSError, TimeoutError, AuthError, StatusError: the node did not answer properly.
    """

    async def ask() -> dict[str, str]:
        conn = await connect(
            host, port, agent="changefeed-cluster", user=user, password=password, bucket=bucket
        )
        try:
            opaque = conn.next_opaque()
            request = encode_request(Opcode.STAT, opaque=opaque, key=group.encode())
            frames = await conn.request_many(
                request, opaque, lambda f: not f.key or f.status != Status.SUCCESS
            )
            if frames[-1].status != Status.SUCCESS:
                raise click.ClickException(
                    f"{host}:{port} refused STAT {group!r}: {Status.name_of(frames[-1].status)}"
                )
            return {f.key.decode(): f.value.decode() for f in frames if f.key}
        finally:
            await conn.close()

    async with asyncio.timeout(timeout_s):
        return await ask()


def _seqno(stats: Mapping[str, str], vb: int, field: str) -> int | None:
    value = stats.get(f"vb_{vb}:{field}")
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def _vbucket_rows(
    cluster_map: ClusterMap, stats: list[tuple[dict[str, str], dict[str, str], str | None]]
) -> list[dict[str, Any]]:
    """Per vbucket: each copy's seqnos; for replicas, the lag behind the active in items and
    whatever the active's STAT replication says of that replica."""
    reported: dict[tuple[int, str], dict[str, Any]] = {}  # (vb, replica node) -> fields
    for node_index in range(len(cluster_map.nodes)):
        for key, value in stats[node_index][1].items():
            match = REPLICATION_KEY.fullmatch(key)
            if match:
                vb, replica, field = int(match[1]), match[2], match[3]
                reported.setdefault((vb, replica), {})[field] = _typed(value)
    rows = []
    for vb, chain in enumerate(cluster_map.chains):
        copies: list[dict[str, Any]] = []
        active_high: int | None = None
        for position, index in enumerate(chain):
            if index == -1:
                copies.append({"node": None, "role": _role(position)})
                continue
            node = cluster_map.nodes[index]
            seqnos = stats[index][0]
            high = _seqno(seqnos, vb, "high_seqno")
            copy: dict[str, Any] = {
                "node": node.name,
                "role": _role(position),
                "high_seqno": high,
                "persisted_seqno": _seqno(seqnos, vb, "last_persisted_seqno"),
            }
            if position == 0:
                active_high = high
            else:
                copy["lag_items"] = (
                    active_high - high if active_high is not None and high is not None else None
                )
                if (vb, node.name) in reported:
                    copy["replication"] = reported[(vb, node.name)]
            copies.append(copy)
        rows.append({"vb": vb, "copies": copies})
    return rows


def _role(position: int) -> str:
    return "active" if position == 0 else f"replica{position}"


def _typed(value: str) -> Any:
    """A STAT value as JSON would have it: int, float, bool, else the string."""
    for parse in (int, float):
        with contextlib.suppress(ValueError):
            return parse(value)
    return {"true": True, "false": False}.get(value.lower(), value)


def summarize(report: Mapping[str, Any]) -> dict[str, Any]:
    """The summary `status` leads with, from its report: per node, up (registered and
    answering) or down, its actives and replicas, and how many of its replicas their active
    reports in sync; over the cluster, the worst replica lag in items and in seconds."""
    nodes: dict[str, dict[str, Any]] = {}
    for node in report["nodes"]:
        down = None if node["live"] else "not registered"
        if not node["reachable"]:
            down = "unreachable" if down is None else f"{down}, unreachable"
        nodes[node["name"]] = {
            "name": node["name"],
            "up": down is None,
            "down_because": down,
            "actives": 0,
            "replicas": 0,
            "replicas_in_sync": 0,
            "replicas_unknown": 0,  # no word from their active
        }
    worst_items: dict[str, Any] | None = None
    worst_s: dict[str, Any] | None = None
    without_active = 0
    for row in report["vbuckets"]:
        active, *replicas = row["copies"]
        if active["node"] is None:
            without_active += 1
        else:
            nodes[active["node"]]["actives"] += 1
        for copy in replicas:
            if copy["node"] is None:
                continue
            node = nodes[copy["node"]]
            node["replicas"] += 1
            replication = copy.get("replication", {})
            if "in_sync" not in replication:
                node["replicas_unknown"] += 1
            elif replication["in_sync"] in (1, True):
                node["replicas_in_sync"] += 1
            lag = copy.get("lag_items")
            if lag is not None and (worst_items is None or lag > worst_items["items"]):
                worst_items = {"items": lag, "vb": row["vb"], "node": copy["node"]}
            lag_s = replication.get("lag_s")
            if isinstance(lag_s, int | float) and (worst_s is None or lag_s > worst_s["s"]):
                worst_s = {"s": lag_s, "vb": row["vb"], "node": copy["node"]}
    per_node = list(nodes.values())
    return {
        "nodes_up": sum(1 for n in per_node if n["up"]),
        "nodes_down": sum(1 for n in per_node if not n["up"]),
        "nodes": per_node,
        "replicas": sum(n["replicas"] for n in per_node),
        "replicas_in_sync": sum(n["replicas_in_sync"] for n in per_node),
        "vbuckets_without_active": without_active,
        "worst_lag_items": worst_items,
        "worst_lag_s": worst_s,
    }


def _render(report: Mapping[str, Any], *, details: bool = True) -> str:
    """The summary (one screen whatever the vbucket count), then per vbucket its copies."""
    lines = [f"cluster {report['cluster']!r} on etcd {report['etcd']}"]
    leader = report["orchestrator"]
    lines.append(
        "orchestrator: "
        + ("none" if leader is None else f"{leader['name']} (token {leader['token']})")
    )
    cluster_map = report["map"]
    if cluster_map is None:
        lines.append("live nodes: " + (", ".join(report["live_nodes"]) or "none"))
        lines.append("no map yet (the orchestrator waits for the expected nodes)")
        return "\n".join(lines)
    lines.append(
        f"map rev {cluster_map['rev']}: {cluster_map['vbuckets']} vbuckets, "
        f"{cluster_map['replicas']} replicas"
    )
    lines.extend(_render_summary(report))
    rebalance = report.get("rebalance")
    if rebalance is not None:
        state = "done" if rebalance["done"] else rebalance["error"] or "in progress"
        lines.append(
            f"rebalance to {', '.join(rebalance['nodes'])}: {rebalance['moved']}/"
            f"{rebalance['total']} vbuckets moved ({state})"
        )
        lines.extend(f"  waiting: {w}" for w in rebalance["waiting"] if not rebalance["done"])
    if details:
        lines.append("")
        lines.extend(_render_details(report))
    return "\n".join(lines)


SUMMARY_WIDTH = 100  # a summary line is cut to this (the whole reason is in --json)


def _render_summary(report: Mapping[str, Any]) -> list[str]:
    summary = report.get("summary") or summarize(report)
    lines = [f"nodes: {summary['nodes_up']} up, {summary['nodes_down']} down"]
    lines.append(
        f"  {'node':10} {'address':21} {'state':6} {'actives':>7} {'replicas':>8} {'in sync':>8}"
    )
    addresses = {n["name"]: n for n in report["nodes"]}
    for node in summary["nodes"]:
        state = "up" if node["up"] else "DOWN"
        in_sync = f"{node['replicas_in_sync']}/{node['replicas']}"
        line = (
            f"  {node['name']:10} {addresses[node['name']]['address']:21} {state:6} "
            f"{node['actives']:>7} {node['replicas']:>8} {in_sync:>8}"
        )
        if not node["up"]:
            error = addresses[node["name"]]["error"]  # whole in --json
            line += f"  {node['down_because']}" + (f" ({error.split(':')[0]})" if error else "")
        elif node["replicas_unknown"]:
            line += f"  ({node['replicas_unknown']} unreported)"  # by their actives, yet
        lines.append(line if len(line) < SUMMARY_WIDTH else line[: SUMMARY_WIDTH - 2] + "…")
    for stale in report.get("stale_registrations", []):
        lines.append(f"  {stale:10} not in the map; registered but not answering (stopped)")
    outside = sorted(set(report["live_nodes"]) - set(addresses))
    if outside:
        lines.append(f"  live, not in the map: {', '.join(outside)}")
    if summary["vbuckets_without_active"]:
        lines.append(f"vbuckets with no active copy: {summary['vbuckets_without_active']}")
    worst, worst_s = summary["worst_lag_items"], summary["worst_lag_s"]
    lines.append(f"replicas in sync: {summary['replicas_in_sync']}/{summary['replicas']}")
    if worst is None:
        lag = "worst lag: unknown"
    elif worst["items"] == 0:
        lag = "worst lag: 0 items (all caught up)"
    else:
        lag = f"worst lag: {worst['items']} items (vb {worst['vb']} on {worst['node']})"
    if worst_s is not None and worst_s["s"] > 0:
        lag += f"; {worst_s['s']:.3f} s (vb {worst_s['vb']} on {worst_s['node']})"
    lines.append(lag)
    return lines


def _render_details(report: Mapping[str, Any]) -> list[str]:
    lines = ["vb    copy: node high/persisted [lag items (seconds, in sync per the active)]"]
    for row in report["vbuckets"]:
        parts = []
        for copy in row["copies"]:
            if copy["node"] is None:
                parts.append(f"{copy['role']}: -")
                continue
            seqnos = f"{_n(copy['high_seqno'])}/{_n(copy['persisted_seqno'])}"
            text = f"{copy['role']}: {copy['node']} {seqnos}"
            if copy["role"] != "active":
                text += f" lag {_n(copy.get('lag_items'))}"
                replication = copy.get("replication", {})
                if replication:
                    flags = [_seconds(replication.get("lag_s"))]
                    flags.append("in sync" if replication.get("in_sync") else "NOT IN SYNC")
                    if replication.get("connected") in (0, False):
                        flags.append("disconnected")
                    text += f" ({', '.join(flags)})"
            parts.append(text)
        lines.append(f"{row['vb']:<5} " + "  |  ".join(parts))
    return lines


def _seconds(value: object) -> str:
    return f"{value:.3f} s" if isinstance(value, int | float) else "? s"


def _n(value: object) -> str:
    return "?" if value is None else str(value)


@cluster.command()
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    required=True,
    help="The directory `cluster start` made.",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was stopped as JSON.")
def stop(directory: Path, as_json: bool) -> None:
    """Stop the nodes (SIGTERM: a clean shutdown; SIGKILL after 60 s), then etcd if `start`
    started it, by the pids in cluster.json."""
    record = _read_record(directory)
    stopped: dict[str, bool] = {}
    nodes = record.get("nodes", [])
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
        futures = {
            node["name"]: pool.submit(
                stop_pid, int(node["pid"]), str(node["data_dir"]), timeout_s=NODE_STOP_TIMEOUT_S
            )
            for node in nodes
            if node.get("pid")
        }
    for node_name, future in futures.items():
        stopped[node_name] = future.result()
    if record.get("etcd_pid"):
        stopped["etcd"] = stop_pid(int(record["etcd_pid"]), str(record["etcd_data_dir"]))
    record["stopped_at"] = time.time()
    write_record(directory, record)
    if as_json:
        click.echo(json.dumps({"stopped": stopped}))
        return
    for what, was_running in stopped.items():
        click.echo(f"{what}: {'stopped' if was_running else 'was not running'}")


@cluster.command()
@click.argument("node")
@click.option(
    "--dir",
    "directory",
    type=click.Path(path_type=Path, file_okay=False),
    help="A directory `cluster start` made (reads its cluster.json).",
)
@click.option("--etcd", "etcd_url", help="Or the etcd endpoint (http://host:port)...")
@click.option("--cluster", "name", help="...and the cluster name (default 'default').")
@click.option(
    "--force",
    is_flag=True,
    help="Promote a replica that was not in sync when no in-sync one is live (writes it never "
    "received are lost; consumers are rolled back).",
)
@click.option("--timeout-s", default=30.0, show_default=True, help="Wait this long for the map.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
def failover(
    node: str,
    directory: Path | None,
    etcd_url: str | None,
    name: str | None,
    force: bool,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Fail NODE over by hand: its active vbuckets move to their in-sync replicas (the highest
    seqno wins) and it stays a replica. Refused for a vbucket with no live in-sync replica
    unless --force."""
    etcd_url, name, tls = _where(directory, etcd_url, name)
    outcome = run(_failover(etcd_url, name, tls, node, force, timeout_s))
    if as_json:
        click.echo(json.dumps(outcome))
    else:
        for vb, target in sorted(outcome["promoted"].items(), key=lambda kv: int(kv[0])):
            click.echo(f"vb {vb}: active now on {target}")
        for reason in outcome["refused"]:
            click.echo(f"refused: {reason}", err=True)
        click.echo(f"map rev {outcome['rev']}")
    if outcome["refused"]:
        raise SystemExit(1)


async def _failover(
    endpoint: str, name: str, tls: EtcdTls | None, node: str, force: bool, timeout_s: float
) -> dict[str, Any]:
    """Plan it here first (the same rule the orchestrator applies) so a refusal is reported
    before anything changes, then hand the request to the orchestrator and wait for the map."""
    md = await ClusterMetadata.connect(endpoint, name, tls=tls)
    try:
        stored = await md.read_map()
        if stored is None:
            raise click.ClickException(f"cluster {name!r} has no map yet")
        current = stored[0]
        if current.node_index(node) is None:
            names = ", ".join(n.name for n in current.nodes)
            raise click.ClickException(f"node {node!r} is not in the map (nodes: {names})")
        live = set(await md.live_nodes())
        statuses = await md.node_statuses()
        highs = {
            n: {int(vb): int(h) for vb, h in s.get("high", {}).items()} for n, s in statuses.items()
        }
        plan = plan_failover(
            current, live, await md.in_sync_sets(), highs, failed={node}, force=force
        )
        refused = [r for vb, r in sorted(plan.refused.items()) if current.chains[vb][0] != -1]
        if refused and not force:
            return {"rev": current.rev, "promoted": {}, "refused": refused}
        await md.request_failover(node, force=force)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = await md.read_map()
            if found is not None and found[0].rev > current.rev:
                moved = found[0]
                index = moved.node_index(node)
                if all(chain[0] != index for chain in moved.chains):
                    promoted = {
                        str(vb): active.name
                        for vb in range(moved.vbuckets)
                        if current.chains[vb][0] == current.node_index(node)
                        and (active := moved.active(vb)) is not None
                    }
                    return {"rev": moved.rev, "promoted": promoted, "refused": refused}
            await asyncio.sleep(0.1)
        raise click.ClickException(f"no map without {node} as active after {timeout_s:g} s")
    finally:
        await md.close()


# -- rebalance: add and remove ---------------------------------------------------------------

REBALANCE_TIMEOUT_S = 600.0
REGISTER_WAIT_S = 30.0


def _rebalance_options(command: Any) -> Any:
    """The options `add` and `remove` share."""
    for option in reversed(
        [
            click.option(
                "--dir",
                "directory",
                type=click.Path(path_type=Path, file_okay=False),
                help="A directory `cluster start` made (reads and updates its cluster.json).",
            ),
            click.option("--etcd", "etcd_url", help="Or the etcd endpoint (http://host:port)..."),
            click.option("--cluster", "name", help="...and the cluster name (default 'default')."),
            click.option(
                "--timeout-s",
                type=float,
                default=REBALANCE_TIMEOUT_S,
                show_default=True,
                help="Wait this long for the rebalance (it goes on after; run again to wait).",
            ),
            click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON."),
        ]
    ):
        command = option(command)
    return command


@cluster.command()
@click.argument("node")
@_rebalance_options
@click.option("--log-level", default="INFO", show_default=True, help="The new node's log level.")
def add(
    node: str,
    directory: Path | None,
    etcd_url: str | None,
    name: str | None,
    timeout_s: float,
    as_json: bool,
    log_level: str,
) -> None:
    """Add NODE and rebalance: with --dir, start it there (like `start`; again if it stopped);
    with --etcd, NODE must be running already (`changefeed serve --etcd ... --node-name NODE`).
    Vbuckets move to it with a replica stream then a takeover; clients follow the map."""
    etcd_url, name, tls = _where(directory, etcd_url, name)
    if directory is not None:
        _start_added(directory.resolve(), node, log_level)
    outcome = run(_rebalance(etcd_url, name, tls, node, True, timeout_s))
    _report(outcome, as_json)


@cluster.command()
@click.argument("node")
@_rebalance_options
def remove(
    node: str,
    directory: Path | None,
    etcd_url: str | None,
    name: str | None,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Move everything off NODE (replica stream, then takeover, for each vbucket), drop it from
    the map, and stop it (it stops by itself once out of the map; with --dir this waits for
    its process and updates cluster.json)."""
    etcd_url, name, tls = _where(directory, etcd_url, name)
    outcome = run(_rebalance(etcd_url, name, tls, node, False, timeout_s))
    outcome["stopped"] = None
    if directory is not None:
        outcome["stopped"] = _stop_removed(directory.resolve(), node)
    _report(outcome, as_json)


def _report(outcome: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(outcome))
        return
    click.echo(
        f"rebalance done: {outcome['moved']}/{outcome['total']} vbuckets moved in "
        f"{outcome['seconds']:.1f} s; map rev {outcome['rev']} on {', '.join(outcome['nodes'])}"
    )
    if outcome.get("stopped"):
        click.echo(f"{outcome['node']} stopped")


def _start_added(directory: Path, node: str, log_level: str) -> None:
    """Start NODE under `directory` as `start` starts its nodes, unless it runs already, and
    record it in cluster.json.

    Raises:
        click.ClickException: no cluster there, or the node failed to start.
    """
    record = _read_record(directory)
    known = next((n for n in record["nodes"] if n["name"] == node), None)
    if (
        known is not None
        and known.get("pid")
        and process_runs(int(known["pid"]), known["data_dir"])
    ):
        _say(f"{node} runs already (pid {known['pid']})")
        return
    args = node_args(
        str(record["etcd"]),
        str(record.get("cluster", "default")),
        node,
        max(1, len(record["nodes"])),
        int(record.get("replicas", 1)),
        log_level,
        record.get("failover_timeout_s"),
    )
    if record.get("tls"):  # the new node gets its certificate from the cluster's CA
        certs = Path(str(record.get("certs") or directory / "certs"))
        ensure_node_certificates(certs, [node])
        args += tls_args(certs, node, 0, 0, 0, {"nodes": [known] if known else []})
    process = NodeProcess(directory / node, vbuckets=int(record.get("vbuckets", 64)), args=args)
    if known is not None:
        process.port = int(known["port"])  # a restart: the port the map names
    try:
        process.start()
    except (RuntimeError, TimeoutError, OSError) as error:
        first = str(error).splitlines()[0] if str(error) else repr(error)
        raise click.ClickException(f"{node}: {first} (log {process.log_path})") from None
    record["nodes"] = [n for n in record["nodes"] if n["name"] != node]
    record["nodes"].append(node_record(process))
    write_record(directory, record)
    _say(f"{node} {process.address} (pid {process.pid}, log {process.log_path})")


def _stop_removed(directory: Path, node: str) -> bool:
    """Make sure the removed node's process is stopped (it stops by itself once out of the
    map; SIGTERM, then SIGKILL, if it has not) and drop it from cluster.json. Returns whether
    it is stopped (False: cluster.json had no such process)."""
    record = _read_record(directory)
    known = next((n for n in record["nodes"] if n["name"] == node), None)
    if known is None or not known.get("pid"):
        return False
    pid, marker = int(known["pid"]), str(known["data_dir"])
    deadline = time.monotonic() + NODE_STOP_TIMEOUT_S
    while process_runs(pid, marker) and time.monotonic() < deadline:
        time.sleep(POLL_S)  # a clean stop of its own: it flushes first
    stop_pid(pid, marker, timeout_s=NODE_STOP_TIMEOUT_S)  # a no-op when it has stopped
    record["nodes"] = [n for n in record["nodes"] if n["name"] != node]
    write_record(directory, record)
    return not process_runs(pid, marker)


async def _rebalance(
    endpoint: str, name: str, tls: EtcdTls | None, node: str, adding: bool, timeout_s: float
) -> dict[str, Any]:
    """Request the map over the nodes there are (or a rebalance in progress asks for) plus or
    minus NODE, then follow ``rebalance/status`` until it is done.

    Raises:
        click.ClickException: no map, an unknown or unregistered node, the last node, a
            refusal by the orchestrator, or not done within `timeout_s` (one line each).
    """
    begun = time.monotonic()
    md = await ClusterMetadata.connect(endpoint, name, tls=tls)
    try:
        stored = await md.read_map()
        if stored is None:
            raise click.ClickException(f"cluster {name!r} has no map yet")
        current = stored[0]
        nodes = {n.name for n in current.nodes}
        request, status = await read_request(md), await read_status(md)
        in_progress = request is not None and not (
            status is not None and status.id == request[0] and (status.done or status.error)
        )
        if request is not None and in_progress:
            nodes = set(request[1])  # a rebalance in progress: build on what it asked for
        if adding:
            deadline = time.monotonic() + min(REGISTER_WAIT_S, timeout_s)
            while node not in await md.live_nodes():
                if time.monotonic() > deadline:
                    raise click.ClickException(
                        f"node {node!r} is not registered in cluster {name!r} (start it with "
                        f"changefeed serve --etcd {endpoint} --cluster {name} --node-name {node}, "
                        "or give --dir)"
                    )
                await asyncio.sleep(POLL_S)
            nodes.add(node)
        else:
            if node not in nodes:
                raise click.ClickException(
                    f"node {node!r} is not in cluster {name!r} (nodes: {', '.join(sorted(nodes))})"
                )
            if nodes == {node}:
                raise click.ClickException(f"{node} is the last node of cluster {name!r}")
            nodes.discard(node)
        if request is not None and in_progress and set(request[1]) == nodes:
            # The same rebalance is under way (this command was interrupted, or timed out, or
            # the orchestrator died): follow it to its end rather than plan it again.
            request_id = request[0]
            _say(f"rebalance to {', '.join(sorted(nodes))} in progress")
        else:
            request_id = await request_rebalance(md, sorted(nodes))
            _say(f"rebalance to {', '.join(sorted(nodes))} requested")
        deadline = begun + timeout_s
        shown: tuple[int, int] | None = None
        while True:  # bounded by the deadline
            status = await read_status(md)
            if status is not None and status.id == request_id:
                if status.error is not None:
                    raise click.ClickException(f"rebalance refused: {status.error}")
                if (status.moved, status.total) != shown:
                    shown = (status.moved, status.total)
                    _say(f"rebalance: {status.moved}/{status.total} vbuckets moved")
                if status.done:
                    break
            if time.monotonic() > deadline:
                progress = "not started" if shown is None else f"{shown[0]}/{shown[1]} moved"
                waits = "; ".join(status.waiting[:2]) if status and status.waiting else ""
                raise click.ClickException(
                    f"rebalance not done after {timeout_s:g} s ({progress}"
                    + (f"; {waits}" if waits else "")
                    + "): it goes on; run the command again to wait"
                )
            await asyncio.sleep(POLL_S * 2)
        final = await md.read_map()
        return {
            "node": node,
            "request": request_id,
            "nodes": sorted(nodes),
            "moved": status.moved,
            "total": status.total,
            "rev": final[0].rev if final is not None else None,
            "seconds": round(time.monotonic() - begun, 3),
        }
    finally:
        await md.close()
