"""The official SDK over TLS: ``couchbases://`` to the node's TLS port, trusting the CA that
``changefeed certs create`` made (issue 26, item 1). The SDK takes the KV port for each node from
the map's ``nodesExt`` ``kvSSL`` when it connects with TLS (without it, the C++ SDK 1.3 crashed
opening the bucket), so this also checks what the node advertises.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.exceptions import (
    CouchbaseException,
    DocumentExistsException,
    DocumentNotFoundException,
)
from couchbase.options import ClusterOptions, ClusterTimeoutOptions

from changefeed.cli.main import cli
from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.consumer.handshake import call
from changefeed.protocol.opcode import Opcode
from support.clients import PASSWORD, USER, free_port, raw_connection
from support.nodes import node_factory

from .conftest import CONNECT_TIMEOUT, KV_TIMEOUT, VBUCKETS


def make_certs(directory: Path) -> None:
    result = CliRunner().invoke(
        cli, ["certs", "create", "--dir", str(directory), "--nodes", "n0", "--json"]
    )
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeProcess, int, Path]]:
    root = tmp_path_factory.mktemp("sdk-tls")
    make_certs(root / "certs")
    tls_port = free_port()
    args = ["--no-durable", "--tls-port", str(tls_port)]
    args += ["--tls-cert", str(root / "certs/n0.pem"), "--tls-key", str(root / "certs/n0.key")]
    with node_factory(root) as factory:
        yield factory(vbuckets=VBUCKETS, args=args), tls_port, root / "certs/ca.pem"


def connect_tls(tls_port: int, ca: Path) -> Cluster:
    options = ClusterOptions(
        PasswordAuthenticator(USER, PASSWORD, cert_path=str(ca)),
        timeout_options=ClusterTimeoutOptions(
            connect_timeout=CONNECT_TIMEOUT, kv_timeout=KV_TIMEOUT
        ),
    )
    cluster = Cluster.connect(f"couchbases://{HOST}:{tls_port}", options)
    cluster.wait_until_ready(CONNECT_TIMEOUT)
    return cluster


def test_the_map_advertises_the_tls_port(tls: tuple[NodeProcess, int, Path]) -> None:
    node, tls_port, _ = tls

    async def read() -> dict[str, object]:
        conn = await raw_connection(node)
        try:
            config: dict[str, object] = json.loads(
                (await call(conn, Opcode.GET_CLUSTER_CONFIG)).value
            )
            return config
        finally:
            await conn.close()

    config = asyncio.run(read())
    (entry,) = config["nodesExt"]  # type: ignore[misc]
    assert entry["services"] == {"kv": node.port, "kvSSL": tls_port}


def test_sdk_kv_over_tls_with_a_ca_file(tls: tuple[NodeProcess, int, Path]) -> None:
    _, tls_port, ca = tls
    cluster = connect_tls(tls_port, ca)
    try:
        collection = cluster.bucket("default").default_collection()
        for index in range(200):
            collection.upsert(f"tls-sdk:{index}", {"n": index})
        assert collection.get("tls-sdk:42").content_as[dict] == {"n": 42}
        with pytest.raises(DocumentExistsException):
            collection.insert("tls-sdk:42", {"n": 0})
        collection.remove("tls-sdk:42")
        with pytest.raises(DocumentNotFoundException):
            collection.get("tls-sdk:42")
        assert collection.exists("tls-sdk:41").exists
    finally:
        cluster.close()


def test_sdk_refuses_a_node_whose_certificate_another_ca_signed(
    tls: tuple[NodeProcess, int, Path], tmp_path: Path
) -> None:
    _, tls_port, _ = tls
    make_certs(tmp_path / "other")
    options = ClusterOptions(
        PasswordAuthenticator(USER, PASSWORD, cert_path=str(tmp_path / "other/ca.pem")),
        timeout_options=ClusterTimeoutOptions(connect_timeout=timedelta(seconds=2)),
    )
    with pytest.raises(CouchbaseException):
        cluster = Cluster.connect(f"couchbases://{HOST}:{tls_port}", options)
        cluster.wait_until_ready(timedelta(seconds=2))
