"""Fixtures of the official Couchbase SDK tests: one node per module, one SDK cluster object on
it, connected as a new user would (``couchbase://host:port``, a user and password, every other
option the SDK's default) but with short timeouts, so that a wrong answer fails in seconds.

The SDK's C++ core logs nothing unless PYCBC_LOG_LEVEL is set (set it to debug to see the
wire exchange of a failing test).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Protocol

import pytest
from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.collection import Collection
from couchbase.options import ClusterOptions, ClusterTimeoutOptions

from changefeed.cli.node_process import HOST, NodeProcess
from support.clients import PASSWORD, USER
from support.nodes import node_factory

VBUCKETS = 16
# Generous enough for a node behind CPU load (two workers beside other work on two cores: a
# 2 s KV timeout was within reach there), short enough that a wrong answer fails in seconds.
CONNECT_TIMEOUT = timedelta(seconds=20)
KV_TIMEOUT = timedelta(seconds=10)
# Operations the SDK retries until their timeout (a locked document) get this one.
SHORT_TIMEOUT = timedelta(milliseconds=300)


class Listening(Protocol):
    """A node process, or a node in this process: what the SDK needs is its port."""

    @property
    def port(self) -> int: ...


def connection_string(node: Listening) -> str:
    return f"couchbase://{HOST}:{node.port}"


def connect(
    node: Listening,
    *,
    user: str = USER,
    password: str = PASSWORD,
    config_poll_interval: timedelta | None = None,
) -> Cluster:
    """The SDK's Cluster.connect with its default options, but short timeouts (and the
    config poll's interval if given)."""
    extra = {} if config_poll_interval is None else {"config_poll_interval": config_poll_interval}
    options = ClusterOptions(
        PasswordAuthenticator(user, password),
        timeout_options=ClusterTimeoutOptions(
            connect_timeout=CONNECT_TIMEOUT, kv_timeout=KV_TIMEOUT
        ),
        **extra,
    )
    cluster = Cluster.connect(connection_string(node), options)
    cluster.wait_until_ready(CONNECT_TIMEOUT)
    return cluster


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with node_factory(tmp_path_factory.mktemp("sdk")) as factory:
        yield factory(vbuckets=VBUCKETS, args=["--no-durable"])


@pytest.fixture(scope="module")
def cluster(node: NodeProcess) -> Iterator[Cluster]:
    cluster = connect(node)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def collection(cluster: Cluster) -> Collection:
    return cluster.bucket("default").default_collection()


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A document key of this test's own."""
    return f"{request.node.name}:doc"
