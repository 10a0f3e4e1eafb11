"""etcd over TLS with client certificates, and a metadata client that fails over between
etcd members (issue 26's leftovers; cluster/etcd_server.py, cluster/metadata.py).

``changefeed cluster start --tls`` starts its etcd with TLS only and client certificates
required: a client without a certificate, with one of another CA, or speaking plain gRPC is
refused, while the nodes (their own certificates) and the CLI (``admin``) run the cluster end
to end — a map, replica streams over TLS authenticated by node certificates, majority
writes, ``cluster status``, and ``cluster add`` of a node that gets its certificate from the
cluster's CA.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from changefeed.cli.main import cli
from changefeed.cluster.etcd_server import EtcdServer, free_port, stop_pid
from changefeed.cluster.metadata import ClusterMetadata, EtcdTls, MetadataUnavailableError
from changefeed.consumer import KvClient
from changefeed.vbmap import ClusterMap, NodeAddress

pytestmark = pytest.mark.timeout(300)
CLI_TIMEOUT_S = 180.0


def changefeed(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command in its own process (the nodes outlive it, as a user's would)."""
    return subprocess.run(
        [sys.executable, "-m", "changefeed", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,
    )


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for `cluster start`; what it recorded is stopped by pid at the end."""
    directory = tmp_path / "cluster"
    yield directory
    record_path = directory / "cluster.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        for node in record["nodes"]:
            stop_pid(node["pid"], node["data_dir"], timeout_s=30)
        if record.get("etcd_pid"):
            stop_pid(record["etcd_pid"], record["etcd_data_dir"])


def refused_over_https(url: str, context: ssl.SSLContext) -> str | None:
    """Why an https GET of ``url`` failed (None: it was answered)."""
    try:
        with urllib.request.urlopen(url, timeout=10, context=context) as reply:
            reply.read()
    except (OSError, urllib.error.URLError) as error:  # a refused handshake, a reset
        return str(error)
    return None


async def read_map_rev(endpoint: str, cluster: str, tls: EtcdTls | None) -> int:
    async with await ClusterMetadata.connect(endpoint, cluster, tls=tls, timeout_s=5) as md:
        stored = await md.read_map()
        assert stored is not None
        return stored[0].rev


async def majority_writes(port: int, count: int) -> None:
    async with await KvClient.connect("127.0.0.1", port) as kv:
        for index in range(count):
            await kv.upsert(b"etcd-tls:%04d" % index, b"v", durability="majority")


def test_tls_etcd_refuses_clients_without_a_cluster_certificate_and_the_cluster_works(
    cluster_dir: Path, tmp_path: Path
) -> None:
    started = changefeed(
        "cluster", "start", "--nodes", "2", "--replicas", "1", "--vbuckets", "8", "--tls",
        "--dir", str(cluster_dir), "--json",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    record = json.loads(started.stdout)
    endpoint, name = str(record["etcd"]), str(record["cluster"])
    certs = cluster_dir / "certs"
    assert endpoint.startswith("https://127.0.0.1:"), endpoint
    for node in record["nodes"]:  # the nodes were given https and their certificates
        assert endpoint in node["args"] and "--tls-cert" in node["args"], node["args"]
    logs = [Path(node["log"]) for node in record["nodes"]]
    deadline = time.monotonic() + 60
    while not all("authenticated as node" in log.read_text() for log in logs):
        # replica streams over TLS, each node authenticated by its certificate
        assert time.monotonic() < deadline, [log.read_text()[-2000:] for log in logs]
        time.sleep(0.2)

    # Refused: no certificate, a certificate of another CA, plain gRPC.
    no_certificate = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    assert refused_over_https(f"{endpoint}/health", no_certificate) is not None
    ours = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ours.load_cert_chain(certs / "admin.pem", certs / "admin.key")
    assert refused_over_https(f"{endpoint}/health", ours) is None  # the same probe, with one
    other = tmp_path / "other-ca"
    made = CliRunner().invoke(cli, ["certs", "create", "--dir", str(other), "--nodes", "admin"])
    assert made.exit_code == 0, made.output
    foreign = EtcdTls(certs / "ca.pem", other / "admin.pem", other / "admin.key")
    with pytest.raises(MetadataUnavailableError, match=endpoint):
        asyncio.run(read_map_rev(endpoint, name, foreign))
    plain = endpoint.replace("https://", "http://")
    with pytest.raises(MetadataUnavailableError, match=plain):
        asyncio.run(read_map_rev(plain, name, None))
    admin = EtcdTls(certs / "ca.pem", certs / "admin.pem", certs / "admin.key")
    assert asyncio.run(read_map_rev(endpoint, name, admin)) >= 1

    # End to end: majority writes, status through the CLI's certificate, a node added.
    asyncio.run(majority_writes(int(record["nodes"][0]["port"]), 100))
    added = changefeed("cluster", "add", "node2", "--dir", str(cluster_dir), "--json")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["nodes"] == ["node0", "node1", "node2"]
    assert (certs / "node2.pem").exists()
    status = changefeed("cluster", "status", "--dir", str(cluster_dir), "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["summary"]["nodes_up"] == 3, report["summary"]
    new_node = json.loads((cluster_dir / "cluster.json").read_text())["nodes"][-1]
    assert new_node["name"] == "node2" and "--tls-cert" in new_node["args"], new_node
    log = Path(new_node["log"]).read_text()
    assert "Traceback" not in log
    assert changefeed("cluster", "stop", "--dir", str(cluster_dir)).returncode == 0


@pytest.fixture
def three_members(tmp_path: Path) -> Iterator[list[EtcdServer]]:
    """A 3-member etcd on loopback (ports picked free), stopped at the end."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    members = [
        EtcdServer(
            tmp_path / f"m{i}",
            name=f"m{i}",
            client_port=client,
            peer_port=peer,
            initial_cluster=initial,
            cluster_token="failover-test",
        )
        for i, (client, peer) in enumerate(ports)
    ]
    try:
        for member in members:
            member.start(wait=False)
        for member in members:
            deadline = time.monotonic() + 60
            while not member._healthy(1.0):
                assert time.monotonic() < deadline, member.log_tail()
                time.sleep(0.1)
        yield members
    finally:
        for member in members:
            member.stop()


def is_leader(member: EtcdServer) -> bool:
    """Whether ``member`` leads the etcd cluster now (its maintenance status says so)."""
    request = urllib.request.Request(
        f"{member.endpoint}/v3/maintenance/status", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        status = json.loads(reply.read())
    return bool(status["leader"] == status["header"]["member_id"])


def test_the_metadata_client_moves_to_another_member_when_its_own_stops_answering(
    three_members: list[EtcdServer],
) -> None:
    """A node's membership and map watch live through a pause of the member it talks to: the
    lease's keep-alive and the watch go on through the next endpoint.

    The paused member is a follower, so the other two keep their leader: a paused leader
    costs an election first, and under CPU load (a CI-like run with two busy loops) that
    election outlasted the lease's 3 s TTL and the membership was lost, which is etcd's
    availability, not the client's failover."""
    # A follower first: the client talks to the first endpoint it is given.
    own, *others = sorted(three_members, key=is_leader)
    endpoints = ",".join(member.endpoint for member in (own, *others))

    async def scenario() -> dict[str, Any]:
        node = NodeAddress("n0", "127.0.0.1", 12000)
        async with (
            await ClusterMetadata.connect(endpoints, "c", timeout_s=2) as md,
            await ClusterMetadata.connect(others[0].endpoint, "c") as writer,
        ):
            membership = await md.register_node(node, ttl_s=3)
            leadership = await writer.campaign("w")
            first = ClusterMap.single_node(node, vbuckets=4, rev=1)
            revision = await writer.write_map(first, None, leadership)
            maps = md.watch_map()
            assert (await anext(maps))[0].rev == 1
            used = md.endpoint
            assert used == own.endpoint
            # Paused, not killed: requests to it time out (a silent member, as in a
            # partition) rather than being refused at once.
            os.kill(own.pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(4)  # more than the lease's TTL: only keep-alives keep it
            finally:
                os.kill(own.pid, signal.SIGCONT)
            second = ClusterMap.single_node(node, vbuckets=4, rev=2)
            assert await writer.write_map(second, revision, leadership)
            async with asyncio.timeout(20):
                seen = (await anext(maps))[0].rev
            live = await writer.live_nodes()
            outcome = {
                "lost": membership.lost.is_set(),
                "seen": seen,
                "live": sorted(live),
                "switches": md.switches,
                "now": md.endpoint,
            }
            await maps.aclose()
            return outcome

    outcome = asyncio.run(scenario())
    print(outcome)
    assert outcome["lost"] is False
    assert outcome["seen"] == 2
    assert outcome["live"] == ["n0"]
    assert outcome["switches"] >= 1 and outcome["now"] != own.endpoint
