"""The official SDK against a node that asks for client certificates (``--tls-ca``, issue 26
item 1): the request is optional, as Couchbase's ``ssl.CERT_OPTIONAL``, so an SDK that presents
no certificate authenticates with its password as before."""

from __future__ import annotations

from pathlib import Path

from support.clients import free_port
from support.nodes import node_factory

from .conftest import VBUCKETS
from .test_tls_sdk import connect_tls, make_certs


def test_sdk_without_a_certificate_uses_its_password_on_a_node_asking_for_one(
    tmp_path: Path,
) -> None:
    certs = tmp_path / "certs"
    make_certs(certs)
    tls_port = free_port()
    args = [
        "--no-durable", "--tls-port", str(tls_port), "--tls-cert", str(certs / "n0.pem"),
        "--tls-key", str(certs / "n0.key"), "--tls-ca", str(certs / "ca.pem"),
        "--tls-crl", str(certs / "crl.pem"),
    ]  # fmt: skip
    with node_factory(tmp_path) as factory:
        node = factory(vbuckets=VBUCKETS, args=args)
        cluster = connect_tls(tls_port, certs / "ca.pem")
        try:
            collection = cluster.bucket("default").default_collection()
            for index in range(100):
                collection.upsert(f"ca-sdk:{index}", {"n": index})
            assert collection.get("ca-sdk:7").content_as[dict] == {"n": 7}
        finally:
            cluster.close()
        log = node.log_path.read_text()
        assert "client certificate is not accepted" not in log and "Traceback" not in log
