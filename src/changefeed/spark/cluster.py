"""Reaching a cluster from the Spark source: bootstrap from any reachable seed node.

The ``cluster`` option lists seed nodes, as a Couchbase connection string does. Every piece of
the source that talks to the cluster (planning in ``node_state.py``, reading in ``reading.py``,
the lag in ``lag.py``) starts from the first seed that answers: a seed that is down (killed, or
failed over and not back yet) must not stop a query while another seed can give the map. From
there the cluster map decides where each vbucket is read (the ``DcpClient`` routes streams by
it; the planner asks each vbucket's active).

A seed that refuses us for a reason retrying elsewhere cannot fix (wrong password, no such
bucket) fails at once: every node of a cluster shares users and buckets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

from changefeed.consumer import ClientConfig, DcpClient
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import connect
from changefeed.protocol.errors import StatusError
from changefeed.spark.options import SourceOptions

SEED_CONNECT_TIMEOUT_S: Final = 5.0  # per seed: a dead host must not hold the others up long


class SeedsUnreachableError(ConnectionError):
    """No seed node answered; the message names each seed and why."""


def retriable(error: BaseException) -> bool:
    """A node that may answer later or elsewhere: unreachable, gone, slow, or answering a
    retriable status (TMPFAIL while it warms up). Auth errors and the like are not."""
    if isinstance(error, StatusError):
        return error.retriable
    return isinstance(error, OSError | TimeoutError)


def client_config(options: SourceOptions, name: str, **overrides: object) -> ClientConfig:
    """A ``ClientConfig`` for the options' credentials and bucket, bootstrapping from the
    first seed (``dcp_client`` replaces the seed when that one is down)."""
    config = ClientConfig(
        host=options.host,
        port=options.port,
        bucket=options.bucket,
        user=options.user,
        password=options.password,
        name=name,
    )
    return dataclasses.replace(config, **overrides)  # type: ignore[arg-type]


async def dial_seed(
    options: SourceOptions, agent: str, *, timeout_s: float = SEED_CONNECT_TIMEOUT_S
) -> tuple[Connection, tuple[str, int]]:
    """A ready KV connection (HELLO, auth, bucket) to the first seed that answers, and that
    seed's address.

    Raises:
        SeedsUnreachableError: no seed answered (each one's error is named).
        StatusError: a seed refused us for good (e.g. authentication).
    """
    failures = []
    for host, port in options.seed_nodes:
        try:
            conn = await connect(
                host, port, agent=agent, user=options.user, password=options.password,
                bucket=options.bucket, timeout_s=timeout_s,
            )  # fmt: skip
        except Exception as error:
            if not retriable(error):
                raise
            failures.append(f"{host}:{port} ({error!r})")
            continue
        return conn, (host, port)
    raise _unreachable(options, failures)


async def reachable_config(options: SourceOptions, config: ClientConfig) -> ClientConfig:
    """``config`` bootstrapping from the first seed that answers now, for code that builds
    its own ``DcpClient`` from a ``ClientConfig`` (e.g. ``consumer.current_state``).

    Raises:
        SeedsUnreachableError: no seed answered.
        StatusError: a seed refused us for good.
    """
    conn, (host, port) = await dial_seed(options, config.name or "changefeed-spark")
    await conn.close()
    return dataclasses.replace(config, host=host, port=port)


@asynccontextmanager
async def dcp_client(options: SourceOptions, config: ClientConfig) -> AsyncIterator[DcpClient]:
    """A connected ``DcpClient`` (``config``, bootstrapped from the first seed that answers);
    it streams each vbucket from its active node by the map, and closes on exit.

    Raises:
        SeedsUnreachableError: no seed answered.
        StatusError: a seed refused us for good.
    """
    failures = []
    for host, port in options.seed_nodes:
        client = DcpClient(dataclasses.replace(config, host=host, port=port))
        try:
            await client.connect()
        except Exception as error:
            await client.close()
            if not retriable(error):
                raise
            failures.append(f"{host}:{port} ({error!r})")
            continue
        try:
            yield client
        finally:
            await client.close()
        return
    raise _unreachable(options, failures)


def _unreachable(options: SourceOptions, failures: list[str]) -> SeedsUnreachableError:
    return SeedsUnreachableError(
        f"no seed node of {options.cluster_text} answered: {', '.join(failures)}"
    )
