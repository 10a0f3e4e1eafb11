"""Replica streams over TLS, nodes authenticated by their certificates (issue 26, item 1).

A cluster whose nodes serve ``--tls-port`` with ``--tls-ca``: each replica feed dials its
active's TLS port (the map's ``kvSSL``) and presents its node certificate instead of the shared
password — the nodes here are started with a replication password that matches no user, so
only certificates can make them replicate. A node whose certificate the CRL lists is refused
by every active with one line per reason; a rotated certificate is served to new connections
while durable (majority) writes go on.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from changefeed.cli.certs import load_or_create_ca, revocation_list, write_file
from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.cluster.etcd_server import EtcdServer, stop_pid
from changefeed.consumer import KvClient
from changefeed.consumer.connection import client_tls_context
from changefeed.protocol.errors import DurabilityImpossibleError
from changefeed.server.users import Users
from support.clients import PASSWORD, USER, free_port, node_stats
from support.cluster import (
    assert_copies_equal,
    cluster_args,
    wait_for_map,
    wait_in_sync_published,
    wait_replicated,
)
from support.nodes import NodeFactory

pytestmark = pytest.mark.timeout(300)

# Replica feeds would authenticate with this if they used passwords: no node has it.
WRONG_REPLICATION_PASSWORD = "not-the-administrator-password"


def make_certs(directory: Path, *nodes: str) -> None:
    args = ["certs", "create", "--dir", str(directory), "--nodes", ",".join(nodes)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output


def start_tls_cluster(
    nodes: NodeFactory, etcd: EtcdServer, cluster: str, certs: Path, *, count: int = 3
) -> list[NodeProcess]:
    """n1..n<count> with TLS, the cluster CA and its CRL; their users files hold the test's
    admin password, their replication password is wrong (`WRONG_REPLICATION_PASSWORD`)."""
    started = []
    for i in range(1, count + 1):
        name = f"n{i}"
        tls = [
            "--tls-port", str(free_port()), "--tls-cert", str(certs / f"{name}.pem"),
            "--tls-key", str(certs / f"{name}.key"), "--tls-ca", str(certs / "ca.pem"),
            "--tls-crl", str(certs / "crl.pem"), "--failover-timeout-s", "3600",
            "--no-crash-failover", "--no-durable",
        ]  # fmt: skip
        node = nodes(
            start=False,
            name=name,
            vbuckets=8,
            args=cluster_args(etcd.endpoint, cluster, name, count=count, replicas=2, extra=tls),
            env={"CHANGEFEED_PASSWORD": WRONG_REPLICATION_PASSWORD},
        )
        node.data_dir.mkdir(parents=True)
        users = Users()
        users.add(USER, PASSWORD)
        users.save(node.data_dir / "users.json")
        started.append(node)
    for node in started:
        node.start()
    for node in started:
        asyncio.run(wait_for_map(node))
    return started


def served_serial(port: int, ca: Path) -> int:
    """The serial of the certificate a new TLS connection to ``port`` is shown."""
    context = client_tls_context(ca)
    with (
        socket.create_connection((HOST, port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=HOST) as secured,
    ):
        der = secured.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


async def write(node: NodeProcess, prefix: bytes, count: int) -> None:
    async with await KvClient.connect(HOST, node.port) as kv:
        await kv.upsert_many([(prefix + b"%05d" % i, b"v" * 50) for i in range(count)])


def test_replica_streams_run_over_tls_authenticated_by_node_certificates(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    make_certs(certs, "n1", "n2", "n3")
    cluster = start_tls_cluster(nodes, etcd, cluster_name, certs)
    asyncio.run(write(cluster[0], b"tls-repl:", 2000))
    asyncio.run(wait_replicated(cluster))
    assert asyncio.run(assert_copies_equal(cluster)) >= 2000
    for node in cluster:  # every node serves its replicas' feeds over TLS, by certificate
        counted = asyncio.run(node_stats(node, "connections"))
        assert int(counted["node_certificate_connections"]) >= 2, counted
        assert int(counted["tls_connections"]) >= 2, counted
        log = node.log_path.read_text()
        assert "authenticated as node" in log and "Traceback" not in log
        assert "authentication failed" not in log  # nobody tried the (wrong) password


def test_a_node_whose_certificate_is_revoked_is_refused_by_its_actives(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    make_certs(certs, "n1", "n2", "n3")
    result = CliRunner().invoke(cli, ["certs", "revoke", "--dir", str(certs), "n3"])
    assert result.exit_code == 0, result.output
    n1, n2, n3 = start_tls_cluster(nodes, etcd, cluster_name, certs)
    asyncio.run(write(n1, b"revoked:", 500))
    deadline = time.monotonic() + 30
    while True:  # n1 and n2 replicate each other; bounded by the deadline
        fed = asyncio.run(node_stats(n2, "replica-feeds"))
        if int(fed.get("n1:items", "0")) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert int(fed.get("n1:items", "0")) > 0, fed
    while True:  # bounded by the deadline
        refused = [x for x in n3.log_path.read_text().splitlines() if "certificate" in x]
        refused = [x for x in refused if "refused this node's certificate" in x]
        if len(refused) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert refused, n3.log_tail(30)
    time.sleep(3)  # feeds retry every ~2 s: the reason is still logged once per feed
    refused = [
        x for x in n3.log_path.read_text().splitlines() if "refused this node's certificate" in x
    ]
    warned = [x for x in refused if " WARNING " in x]
    assert len(refused) > len(warned) > 0, refused  # it went on trying
    assert len(warned) <= 2, warned  # one warning per active (n1, n2), not one per attempt
    for active in (n1, n2):
        lines = [x for x in active.log_path.read_text().splitlines() if "certificate revoked" in x]
        assert lines and len(lines) <= 2, lines  # one line per 10 s however often it trips
        assert "authenticated as node n3" not in active.log_path.read_text()
    counted = asyncio.run(node_stats(n3, "replica-feeds"))
    print("n3 replica feeds:", {k: v for k, v in counted.items() if "items" in k})
    assert all(v == "0" for k, v in counted.items() if k.endswith(":items")), counted


def test_a_certificate_rotated_under_durable_writes_loses_none_and_the_old_one_revoked(
    nodes: NodeFactory, etcd: EtcdServer, cluster_name: str, tmp_path: Path
) -> None:
    certs = tmp_path / "certs"
    make_certs(certs, "n1", "n2", "n3")
    cluster = start_tls_cluster(nodes, etcd, cluster_name, certs)
    n1 = cluster[0]
    asyncio.run(wait_in_sync_published(etcd.endpoint, cluster_name))  # every replica streams
    serials_before = [
        x509.load_pem_x509_certificate((certs / f"n{i}.pem").read_bytes()).serial_number
        for i in (1, 2, 3)
    ]

    async def scenario() -> tuple[int, int]:
        tls_port = int(n1.args[n1.args.index("--tls-port") + 1])
        first = await asyncio.to_thread(served_serial, tls_port, certs / "ca.pem")
        written = 0
        stop = asyncio.Event()
        async with await KvClient.connect(HOST, n1.port) as kv:

            async def writer() -> None:
                nonlocal written
                while not stop.is_set():  # bounded by the rotation below
                    await kv.upsert(b"rot:%06d" % written, b"v", durability="majority")
                    written += 1

            task = asyncio.create_task(writer())
            try:
                await asyncio.sleep(1.0)
                before = written
                make_certs(certs, "n1", "n2", "n3")  # every node: new certificates, same CA
                deadline = time.monotonic() + 15
                while await asyncio.to_thread(served_serial, tls_port, certs / "ca.pem") == first:
                    assert time.monotonic() < deadline, "n1 still serves its old certificate"
                    await asyncio.sleep(0.2)
                await asyncio.sleep(1.0)
                during = written - before
            finally:
                stop.set()
                await task  # raises if a durable write failed
        return written, during

    written, during = asyncio.run(scenario())
    print(f"rotation in a cluster: {written} majority writes, {during} across the rotation")
    assert during > 0
    asyncio.run(wait_replicated(cluster))
    assert asyncio.run(assert_copies_equal(cluster)) >= written
    for node in cluster:
        assert "reloaded: new connections use it" in node.log_path.read_text()

    # The old certificates revoked: every feed still open on one is closed, and the feeds come
    # back with the rotated certificates (which the CRL does not list); majority writes go on.
    old_serials = set(serials_before)  # `certs revoke NODE` lists a node's current one only
    ca, _ = load_or_create_ca(certs, days=1)
    write_file(certs / "crl.pem", revocation_list(ca, old_serials).public_bytes(Encoding.PEM))
    deadline = time.monotonic() + 15
    while not all("is revoked" in node.log_path.read_text() for node in cluster):
        assert time.monotonic() < deadline, "the old certificates' feeds were not closed"
        time.sleep(0.2)

    async def write_majority() -> None:
        async with await KvClient.connect(HOST, n1.port) as kv:
            for index in range(200):
                await _durable_when_possible(kv, b"after-revoke:%04d" % index)

    asyncio.run(write_majority())
    asyncio.run(wait_replicated(cluster))
    assert asyncio.run(assert_copies_equal(cluster)) >= written + 200


@pytest.mark.slow  # the default suite has it within test_etcd_tls.py (a --tls cluster, more)
def test_cluster_start_tls_makes_certificates_and_replicates_over_tls(tmp_path: Path) -> None:
    """`changefeed cluster start --tls`: certificates in DIR/certs, every node with a TLS port,
    its replicas streaming over TLS by certificate; `cluster stop` stops it."""
    directory = tmp_path / "cluster"
    try:
        result = subprocess.run(
            [sys.executable, "-m", "changefeed", "cluster", "start", "--nodes", "2",
             "--replicas", "1", "--vbuckets", "8", "--tls", "--dir", str(directory)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        record = json.loads((directory / "cluster.json").read_text())
        for name in ("ca.pem", "crl.pem", "node0.pem", "node1.key"):
            assert (directory / "certs" / name).exists(), name
        deadline = time.monotonic() + 30
        logs = [Path(node["log"]) for node in record["nodes"]]
        while not all("authenticated as node" in log.read_text() for log in logs):
            assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
            time.sleep(0.2)
        for node in record["nodes"]:
            assert "--tls-port" in node["args"] and "--tls-ca" in node["args"], node["args"]
    finally:
        if (directory / "cluster.json").exists():
            record = json.loads((directory / "cluster.json").read_text())
            for node in record["nodes"]:
                stop_pid(node["pid"], node["data_dir"], timeout_s=30)
            if record.get("etcd_pid"):
                stop_pid(record["etcd_pid"], record["etcd_data_dir"])


async def _durable_when_possible(kv: KvClient, key: bytes, timeout_s: float = 30.0) -> None:
    """A majority write, retried while a majority is not reachable: replicas whose old
    certificates were revoked reconnect with their new ones after a backoff, and until then
    the node answers DURABILITY_IMPOSSIBLE (nothing written), as it should."""
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline
        try:
            await kv.upsert(key, b"v", durability="majority")
            return
        except DurabilityImpossibleError:
            assert time.monotonic() < deadline, "replicas never came back after the revocation"
            await asyncio.sleep(0.1)
