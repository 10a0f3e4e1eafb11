"""The client's TLS helpers: one line per refused handshake, and TLS addresses from a map."""

from __future__ import annotations

import ssl

from changefeed.consumer.connection import TlsError, client_tls_context, tls_failure
from changefeed.consumer.kv_client import _tls_addresses


def verify_error(code: int, message: str) -> ssl.SSLCertVerificationError:
    error = ssl.SSLCertVerificationError(1, f"[SSL: CERTIFICATE_VERIFY_FAILED] {message}")
    error.verify_code = code
    error.verify_message = message
    return error


def test_an_untrusted_certificate_is_one_line_with_what_to_do() -> None:
    expired = tls_failure("127.0.0.1", 11207, verify_error(10, "certificate has expired"))
    assert isinstance(expired, TlsError)
    assert str(expired) == (
        "TLS: 127.0.0.1:11207 refused: its certificate is not trusted: certificate has expired "
        "(renew the node's certificate (changefeed certs create))"
    )
    other_ca = tls_failure("h", 1, verify_error(20, "unable to get local issuer certificate"))
    assert "does not hold the CA that signed" in str(other_ca)
    unknown = tls_failure("h", 1, verify_error(999, "something new"))
    assert str(unknown).endswith("not trusted: something new")
    for error in (expired, other_ca, unknown):
        assert "\n" not in str(error)


def test_a_client_context_checks_the_certificate_and_the_host_name() -> None:
    context = client_tls_context()
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2


def test_tls_addresses_come_from_nodes_ext_kvssl() -> None:
    config = {
        "nodesExt": [
            {"hostname": "10.0.0.1", "services": {"kv": 11210, "kvSSL": 11207}, "thisNode": True},
            {"hostname": "10.0.0.2", "services": {"kv": 11210}},  # advertises no TLS port
            "not an entry",
            {"services": {"kv": 1, "kvSSL": 2}},  # no hostname
        ]
    }
    assert _tls_addresses(config) == {"10.0.0.1:11210": ("10.0.0.1", 11207)}
    assert _tls_addresses({}) == {}
    assert _tls_addresses([]) == {}
