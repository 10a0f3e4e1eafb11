"""A node's TLS settings as files (server/node.py NodeTls): the cluster CA and CRL keys, reloads
that keep the old settings when the new files cannot be used, the revoked serials, and the
identity a node certificate gives (server/authenticator.py)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
from click.testing import CliRunner

from changefeed.cli.certs import revoked_serials
from changefeed.cli.main import cli
from changefeed.server.authenticator import NODE_PRIVILEGES, SaslAuthenticator, node_identity
from changefeed.server.config import ConfigError, load_config
from changefeed.server.node import NodeTls
from changefeed.server.privileges import Privilege
from changefeed.server.users import Users


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    directory = tmp_path / "certs"
    args = ["certs", "create", "--dir", str(directory), "--nodes", "n1,n2"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return directory


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_ca": "ca.pem"}, "tls_ca needs tls_port"),
        (
            {"tls_port": 11207, "tls_cert": "n.pem", "tls_key": "n.key", "tls_crl": "crl.pem"},
            "tls_crl needs tls_ca",
        ),
    ],
)
def test_ca_and_crl_keys_need_what_they_work_with(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, **overrides)


def test_node_tls_asks_for_client_certificates_only_with_a_ca(certs: Path) -> None:
    plain = NodeTls(certs / "n1.pem", certs / "n1.key", None, None)
    assert plain.server.verify_mode == ssl.CERT_NONE and not plain.authenticates_nodes
    with_ca = NodeTls(certs / "n1.pem", certs / "n1.key", certs / "ca.pem", certs / "crl.pem")
    assert with_ca.server.verify_mode == ssl.CERT_OPTIONAL  # SDKs without one still connect
    assert with_ca.server.verify_flags & ssl.VERIFY_CRL_CHECK_LEAF
    assert with_ca.authenticates_nodes and with_ca.client().verify_mode == ssl.CERT_REQUIRED
    assert with_ca.revoked == frozenset()


def test_a_reload_that_cannot_use_the_files_keeps_the_current_settings(certs: Path) -> None:
    tls = NodeTls(certs / "n1.pem", certs / "n1.key", certs / "ca.pem", certs / "crl.pem")
    server, client = tls.server, tls.client()
    assert not tls.changed()
    (certs / "n1.key").write_bytes((certs / "n2.key").read_bytes())  # half a rotation
    assert tls.changed()
    assert not tls.reload()
    assert tls.server is server and tls.client() is client and tls.reloads == 0
    result = CliRunner().invoke(cli, ["certs", "create", "--dir", str(certs), "--nodes", "n1"])
    assert result.exit_code == 0, result.output
    heard: list[int] = []
    tls.reloaded.append(lambda: heard.append(tls.reloads))
    assert tls.reload()  # the whole rotation: in use now
    assert tls.server is not server and tls.client() is not client and heard == [1]


def test_certs_revoke_lists_a_nodes_current_serial_and_keeps_earlier_ones(certs: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(cli, ["certs", "revoke", "--dir", str(certs), "n1"]).exit_code == 0
    assert runner.invoke(cli, ["certs", "revoke", "--dir", str(certs), "n2"]).exit_code == 0
    serials = revoked_serials(certs / "crl.pem")
    assert len(serials) == 2
    tls = NodeTls(certs / "n1.pem", certs / "n1.key", certs / "ca.pem", certs / "crl.pem")
    assert tls.revoked == serials
    missing = runner.invoke(cli, ["certs", "revoke", "--dir", str(certs), "n9"])
    assert missing.exit_code == 1 and "cannot read n9's certificate" in missing.output


def test_a_node_certificate_identity_streams_but_does_not_write() -> None:
    users = Users()
    users.add("Administrator", "password")
    sasl = SaslAuthenticator(users)
    sasl.authenticate_node("n2")
    assert sasl.user == node_identity("n2") == "@node:n2"
    assert sasl.privileges == NODE_PRIVILEGES
    assert Privilege.DCP_STREAM in sasl.privileges and Privilege.ADMIN in sasl.privileges
    assert Privilege.WRITE not in sasl.privileges
