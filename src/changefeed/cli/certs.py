"""``changefeed certs create``: a certificate authority and node certificates for the TLS port.

One directory holds a cluster's certificates::

    ca.pem          the CA certificate: give it to clients (``--tls-ca``, the SDK's
                    ``trust_store_path``) so they can check any node
    ca.key          the CA's private key (0600): keep it off the nodes; it issues certificates
    <node>.pem      a node's certificate followed by the CA's (the chain ``serve --tls-cert`` reads)
    <node>.key      the node's private key (0600, ``serve --tls-key``)

A directory that already has ``ca.pem`` and ``ca.key`` keeps its CA: running the command again
issues certificates for more nodes, or new ones for the same nodes (rotation), all trusted by
the clients that trust the CA. Keys are ECDSA P-256 (fast handshakes; every TLS 1.2+ client
takes them), signed with SHA-256. A node's certificate names the node, ``localhost``,
127.0.0.1 and the ``--hosts`` given, so clients that check host names accept it on those.

    crl.pem         the certificates revoked (``certs revoke``): a CRL the CA signed, read by
                    every node's ``serve --tls-crl``; a node certificate listed there is refused
                    when it dials another node

Nodes authenticate to each other by these certificates (``serve --tls-ca ca.pem``): every
certificate the CA signs is a node certificate, so issue no client certificates for
applications from it (they authenticate with a password).

The cluster's etcd uses the same CA (``cluster start --tls``; ``cluster/etcd_server.py``):
``etcd.pem``/``etcd.key`` is the certificate it serves with (``--hosts`` must name its
addresses), and it accepts clients that present a certificate the CA signed: nodes present
their own, the CLI ``admin.pem`` (``--nodes etcd,admin`` issues both). Like any certificate of
this CA, these two are node identities too: keep them with the operator and the etcd members.

What it does not do: distribute files or touch a running node (a node reloads its
certificate, key, CA and CRL when the files change or on SIGHUP).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
from dataclasses import dataclass
from pathlib import Path

import click
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from changefeed import limits

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
CRL = "crl.pem"
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
ETCD_NAME = "etcd"  # the certificate the cluster's etcd serves (and its members peer) with
ADMIN_NAME = "admin"  # the certificate the CLI presents to the cluster's etcd
# A certificate is valid from a little before it is made: clocks of a cluster differ a bit.
CLOCK_SKEW_S = 300
# Node certificates serve clients and will authenticate nodes to each other (issue 26).
NODE_KEY_USES = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]


@dataclass(frozen=True, slots=True)
class Issued:
    """A key and its certificate, as objects (tests build their own, e.g. expired ones)."""

    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate


def create_ca(
    name: str = "changefeed CA", *, days: int = limits.TLS_CA_CERT_DAYS_DEFAULT
) -> Issued:
    """A self-signed CA that may sign node certificates (and no further CAs)."""
    assert days > 0, days
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    public = key.public_key()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(seconds=CLOCK_SKEW_S))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(key, certificate)


def issue_node_certificate(
    ca: Issued,
    node: str,
    hosts: tuple[str, ...] = DEFAULT_HOSTS,
    *,
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> Issued:
    """A certificate for ``node``, signed by ``ca``, for the names in ``hosts`` (IP addresses
    or DNS names) and the node's own name; valid for server and client use (nodes will
    authenticate to each other with it).

    Args:
        not_before, not_after: the validity (default: from now, for
            TLS_NODE_CERT_DAYS_DEFAULT days).
    """
    now = datetime.datetime.now(datetime.UTC)
    start = not_before or now - datetime.timedelta(seconds=CLOCK_SKEW_S)
    end = not_after or now + datetime.timedelta(days=limits.TLS_NODE_CERT_DAYS_DEFAULT)
    assert start < end, (start, end)
    key = ec.generate_private_key(ec.SECP256R1())
    public = key.public_key()
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys((node, *hosts)):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    ca_public = ca.certificate.public_key()
    assert isinstance(ca_public, ec.EllipticCurvePublicKey), type(ca_public)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca.certificate.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(NODE_KEY_USES),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
        )
        .sign(ca.key, hashes.SHA256())
    )
    return Issued(key, certificate)


def certificate_pem(issued: Issued) -> bytes:
    return issued.certificate.public_bytes(serialization.Encoding.PEM)


def key_pem(issued: Issued) -> bytes:
    return issued.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_file(path: Path, data: bytes, *, private: bool = False) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed over it); a
    private file is created 0600, never readable by others even for a moment."""
    temporary = path.with_name(f".{path.name}.tmp")
    mode = 0o600 if private else 0o644
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)
    os.replace(temporary, path)


def write_node(directory: Path, ca: Issued, node: str, issued: Issued) -> tuple[Path, Path]:
    """Write ``node``'s chain and key; returns their paths."""
    chain, key = directory / f"{node}.pem", directory / f"{node}.key"
    write_file(key, key_pem(issued), private=True)
    write_file(chain, certificate_pem(issued) + certificate_pem(ca))
    return chain, key


def load_or_create_ca(directory: Path, *, days: int) -> tuple[Issued, bool]:
    """The CA in ``directory`` (created there if it has none); True if it was created.

    Raises:
        click.ClickException: only one of ca.pem / ca.key is there, or they cannot be read.
    """
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if cert_path.exists() != key_path.exists():
        there, missing = (cert_path, key_path) if cert_path.exists() else (key_path, cert_path)
        raise click.ClickException(
            f"{there} exists but {missing} does not: restore it or remove both"
        )
    if cert_path.exists():
        try:
            certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as error:
            raise click.ClickException(f"cannot read the CA in {directory}: {error}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise click.ClickException(f"{key_path} is not an ECDSA key (made by another tool?)")
        return Issued(key, certificate), False
    ca = create_ca(days=days)
    write_file(key_path, key_pem(ca), private=True)
    write_file(cert_path, certificate_pem(ca))
    return ca, True


def _names(value: str, what: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in value.split(",") if part.strip())
    for name in names:
        if not name.isprintable() or " " in name or "/" in name or name.startswith("."):
            raise click.BadParameter(f"{name!r} is not a usable name", param_hint=what)
    return names


@click.group()
def certs() -> None:
    """TLS certificates: a CA, node certificates (serve --tls-port, --tls-ca), revocations."""


@certs.command("create")
@click.option(
    "--dir", "directory", type=click.Path(path_type=Path), required=True,
    help="Where the CA and node files go; an existing CA there is kept and signs.",
)  # fmt: skip
@click.option("--nodes", required=True, help="Node names, comma-separated (n1,n2,...).")
@click.option(
    "--hosts",
    default=",".join(DEFAULT_HOSTS),
    show_default=True,
    help="Host names and addresses every node certificate is valid for, comma-separated.",
)
@click.option(
    "--days",
    type=click.IntRange(1),
    default=limits.TLS_NODE_CERT_DAYS_DEFAULT,
    show_default=True,
    help="How long node certificates are valid.",
)
@click.option(
    "--ca-days",
    type=click.IntRange(1),
    default=limits.TLS_CA_CERT_DAYS_DEFAULT,
    show_default=True,
    help="How long a new CA is valid.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the paths as JSON.")
def create(directory: Path, nodes: str, hosts: str, days: int, ca_days: int, as_json: bool) -> None:
    """Create a CA (unless DIR has one) and a certificate and key for each node."""
    node_names = _names(nodes, "'--nodes'")
    host_names = _names(hosts, "'--hosts'")
    if not node_names:
        raise click.BadParameter("name at least one node", param_hint="'--nodes'")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        ca, created = load_or_create_ca(directory, days=ca_days)
        if not (directory / CRL).exists():  # empty: so that serve --tls-crl works from the start
            empty = revocation_list(ca, set())
            write_file(directory / CRL, empty.public_bytes(serialization.Encoding.PEM))
        now = datetime.datetime.now(datetime.UTC)
        end = now + datetime.timedelta(days=days)
        written = {}
        for node in node_names:
            issued = issue_node_certificate(ca, node, host_names, not_after=end)
            chain, key = write_node(directory, ca, node, issued)
            written[node] = {"cert": str(chain), "key": str(key)}
    except OSError as error:
        where = error.filename or directory
        raise click.ClickException(f"cannot write {where}: {error.strerror}") from None
    ca_path = directory / CA_CERT
    if as_json:
        crl = str(directory / CRL)
        answer = {"ca": str(ca_path), "ca_created": created, "crl": crl, "nodes": written}
        click.echo(json.dumps(answer))
        return
    click.echo(f"{'created' if created else 'using'} CA {ca_path} (its key: {directory / CA_KEY})")
    click.echo(f"nodes: --tls-ca {ca_path} --tls-crl {directory / CRL}")
    for node, paths in written.items():
        click.echo(
            f"{node}: --tls-cert {paths['cert']} --tls-key {paths['key']} "
            f"(valid until {end:%Y-%m-%d})"
        )


def revocation_list(ca: Issued, serials: set[int]) -> x509.CertificateRevocationList:
    """A CRL of ``serials`` signed by ``ca``, valid as long as the CA is (a node refuses every
    node certificate once its CRL is past its next update: OpenSSL's "CRL has expired")."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca.certificate.subject)
        .last_update(now - datetime.timedelta(seconds=CLOCK_SKEW_S))
        .next_update(ca.certificate.not_valid_after_utc)
    )
    for serial in sorted(serials):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        )
    return builder.sign(ca.key, hashes.SHA256())


def revoked_serials(path: Path) -> set[int]:
    """The serials a CRL file lists (none if there is no file)."""
    if not path.exists():
        return set()
    crl = x509.load_pem_x509_crl(path.read_bytes())
    return {entry.serial_number for entry in crl}


@certs.command("revoke")
@click.option(
    "--dir", "directory", type=click.Path(path_type=Path), required=True,
    help="The directory of the CA (certs create --dir); crl.pem is written there.",
)  # fmt: skip
@click.argument("nodes", nargs=-1)
def revoke(directory: Path, nodes: tuple[str, ...]) -> None:
    """Revoke the current certificate of each of NODES (DIR/<node>.pem): add it to DIR/crl.pem,
    which nodes read with serve --tls-crl (and reload when it changes). Without NODES, write
    the CRL again with what it lists (a new CRL for a new CA's lifetime)."""
    names = _names(",".join(nodes), "NODES") if nodes else ()
    if not (directory / CA_CERT).exists():
        raise click.ClickException(f"{directory / CA_CERT} does not exist: no CA there")
    ca, _created = load_or_create_ca(directory, days=limits.TLS_CA_CERT_DAYS_DEFAULT)
    crl_path = directory / CRL
    try:
        serials = revoked_serials(crl_path)
    except ValueError as error:
        raise click.ClickException(f"cannot read {crl_path}: {error}") from None
    for node in names:
        try:
            certificate = x509.load_pem_x509_certificate((directory / f"{node}.pem").read_bytes())
        except (OSError, ValueError) as error:
            raise click.ClickException(f"cannot read {node}'s certificate: {error}") from None
        serials.add(certificate.serial_number)
        click.echo(f"{node}: certificate {certificate.serial_number:x} revoked")
    crl = revocation_list(ca, serials)
    try:
        write_file(crl_path, crl.public_bytes(serialization.Encoding.PEM))
    except OSError as error:
        raise click.ClickException(f"cannot write {crl_path}: {error.strerror}") from None
    click.echo(f"{crl_path}: {len(serials)} revoked (serve --tls-crl {crl_path})")


def ensure_node_certificates(directory: Path, nodes: list[str]) -> None:
    """The CA (made if missing), its CRL and a certificate for each of ``nodes`` that has none
    in ``directory`` (``cluster start --tls``; a restart keeps the ones there).

    Raises:
        click.ClickException: the directory cannot be written, or holds half a CA.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        ca, _created = load_or_create_ca(directory, days=limits.TLS_CA_CERT_DAYS_DEFAULT)
        if not (directory / CRL).exists():
            empty = revocation_list(ca, set())
            write_file(directory / CRL, empty.public_bytes(serialization.Encoding.PEM))
        for node in nodes:
            if not (directory / f"{node}.pem").exists():
                write_node(directory, ca, node, issue_node_certificate(ca, node))
    except OSError as error:
        raise click.ClickException(f"cannot write {error.filename or directory}: {error}") from None
