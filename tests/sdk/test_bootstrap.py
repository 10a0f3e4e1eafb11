"""Bootstrap with the SDK's defaults: SCRAM with the SDK's nonces (SHA-512 by default,
SHA-256 and PLAIN when asked), GET_ERROR_MAP, SELECT_BUCKET and GET_CLUSTER_CONFIG; the errors
a new user meets first (a wrong password, a bucket that does not exist) raised quickly as the
SDK's own exception classes."""

from __future__ import annotations

import time

import pytest
from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.exceptions import AuthenticationException, BucketNotFoundException
from couchbase.options import ClusterOptions, ClusterTimeoutOptions

from changefeed.cli.node_process import NodeProcess
from support.clients import PASSWORD, USER

from .conftest import CONNECT_TIMEOUT, connect, connection_string

# An error a user meets at connect comes well before the timeout a retried one would run into:
# half of it (generous for a node behind CPU load; 2 s was within reach there).
FAST_S = CONNECT_TIMEOUT.total_seconds() / 2


def test_connect_with_the_sdk_defaults_then_write_and_read(cluster: Cluster, key: str) -> None:
    collection = cluster.bucket("default").default_collection()
    written = collection.upsert(key, {"hello": "changefeed"})
    token = written.mutation_token()
    assert token is not None and token.sequence_number >= 1 and token.partition_uuid > 0
    read = collection.get(key)
    assert read.content_as[dict] == {"hello": "changefeed"}
    assert read.cas == written.cas


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA512", "SCRAM-SHA256", "PLAIN"])
def test_each_sasl_mechanism_the_sdk_offers_logs_in(node: NodeProcess, mechanism: str) -> None:
    options = ClusterOptions(
        PasswordAuthenticator(USER, PASSWORD, allowed_sasl_mechanisms=[mechanism]),
        timeout_options=ClusterTimeoutOptions(connect_timeout=CONNECT_TIMEOUT),
    )
    cluster = Cluster.connect(connection_string(node), options)
    try:
        cluster.wait_until_ready(CONNECT_TIMEOUT)
        collection = cluster.bucket("default").default_collection()
        collection.upsert(f"login-{mechanism}", [mechanism])
        assert collection.get(f"login-{mechanism}").content_as[list] == [mechanism]
    finally:
        cluster.close()


def test_a_wrong_password_raises_authentication_exception(node: NodeProcess) -> None:
    started = time.monotonic()
    with pytest.raises(AuthenticationException):
        connect(node, password="not-the-password")
    assert time.monotonic() - started < FAST_S


def test_an_unknown_user_raises_authentication_exception(node: NodeProcess) -> None:
    with pytest.raises(AuthenticationException):
        connect(node, user="nobody")


def test_an_unknown_bucket_raises_bucket_not_found_at_once(cluster: Cluster) -> None:
    started = time.monotonic()
    with pytest.raises(BucketNotFoundException):
        cluster.bucket("no-such-bucket").default_collection().get("x", timeout=CONNECT_TIMEOUT)
    assert time.monotonic() - started < FAST_S
