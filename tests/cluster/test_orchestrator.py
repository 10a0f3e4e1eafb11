"""The orchestrator against a real etcd: one initial map whoever races, waiting for nodes,
stepping down when the leadership is lost."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.cluster.orchestrator import Orchestrator
from changefeed.cluster.placement import initial_map
from changefeed.vbmap import ClusterMap, NodeAddress

T = TypeVar("T")
TEST_TIMEOUT_S = 30.0
TTL_S = 2
NODES = tuple(NodeAddress(f"node{i}", "127.0.0.1", 13000 + i) for i in range(3))


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a test body with a deadline, so a hang fails instead of blocking the suite; on a
    timeout, print where every task was stuck."""

    async def bounded() -> T:
        body = asyncio.ensure_future(coroutine)
        done, _ = await asyncio.wait({body}, timeout=TEST_TIMEOUT_S)
        if not done:
            for task in asyncio.all_tasks():
                task.print_stack(limit=12)
            body.cancel()
            raise TimeoutError(f"test body still running after {TEST_TIMEOUT_S} s")
        return body.result()

    return asyncio.run(bounded())


async def until(predicate: Any, timeout_s: float = 30.0) -> None:  # generous: CPU load
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks)
    for task in tasks:  # they end by cancellation, not by an error
        assert task.cancelled() or task.exception() is None, task.exception()


def test_racing_candidates_write_exactly_one_initial_map(
    etcd: EtcdServer, cluster_name: str
) -> None:
    async def body() -> None:
        clients = [await ClusterMetadata.connect(etcd.endpoint, cluster_name) for _ in range(3)]
        try:
            for md, node in zip(clients, NODES, strict=True):
                await md.register_node(node, ttl_s=TTL_S)
            written: list[ClusterMap] = []
            orchestrators = [
                Orchestrator(
                    md,
                    node.name,
                    vbuckets=16,
                    replicas=2,
                    expected_nodes=3,
                    lease_ttl_s=TTL_S,
                    on_change=written.append,
                )
                for md, node in zip(clients, NODES, strict=True)
            ]
            tasks = [asyncio.create_task(o.run()) for o in orchestrators]
            await until(lambda: written)
            stored = await clients[0].read_map()
            assert stored is not None
            assert stored[0] == initial_map(NODES, 2, 16) == written[0]
            leaders = [o for o in orchestrators if o.leading]
            assert len(leaders) == 1

            # The leader goes; another is elected, finds the map and writes nothing.
            old = tasks[orchestrators.index(leaders[0])]
            await stop([old])
            await until(lambda: sum(o.leading for o in orchestrators) == 1)
            await asyncio.sleep(0.3)
            assert len(written) == 1
            assert sum(o.maps_written for o in orchestrators) == 1
            kv = await clients[0].client.get(clients[0].key("map"))
            assert kv.version == 1  # the map key was written once, ever
            await stop([t for t in tasks if t is not old])
        finally:
            for md in clients:
                await md.close()

    run(body())


def test_waits_for_the_expected_nodes_and_names_the_missing(
    etcd: EtcdServer, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            orchestrator = Orchestrator(
                md,
                "node0",
                vbuckets=8,
                replicas=1,
                expected_nodes=2,
                expected_names=["node0", "node1"],
                lease_ttl_s=TTL_S,
                nodes_wait_log_s=0.2,
            )
            task = asyncio.create_task(orchestrator.run())
            await md.register_node(NODES[0], ttl_s=TTL_S)
            await until(lambda: "missing: node1" in caplog.text)
            assert await md.read_map() is None
            await md.register_node(NODES[1], ttl_s=TTL_S)

            async def has_map() -> bool:
                return await md.read_map() is not None

            deadline = time.monotonic() + 10
            while not await has_map():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            stored = await md.read_map()
            assert stored is not None and stored[0] == initial_map(NODES[:2], 1, 8)
            await stop([task])

    with caplog.at_level(logging.INFO, logger="changefeed.cluster"):
        run(body())
    assert "cluster map changed: rev 1, 2 nodes (node0, node1)" in caplog.text


def test_a_leader_that_loses_its_lease_steps_down_and_campaigns_again(
    etcd: EtcdServer, cluster_name: str
) -> None:
    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            planned: list[bool] = []
            orchestrator = Orchestrator(
                md, "node0", vbuckets=8, replicas=1, expected_nodes=5, lease_ttl_s=TTL_S
            )
            original_plan = orchestrator.plan

            def plan(live: Any, current: Any) -> Any:
                planned.append(orchestrator.leading)
                return original_plan(live, current)

            orchestrator.plan = plan  # type: ignore[method-assign]
            task = asyncio.create_task(orchestrator.run())
            await md.register_node(NODES[0], ttl_s=TTL_S)
            await until(lambda: orchestrator.leading and planned)
            first = orchestrator.leadership
            assert first is not None
            await md.client.revoke_lease(first.lease_id)  # as if it expired
            await until(lambda: first.lost.is_set(), TTL_S + 2)
            await until(lambda: orchestrator.terms == 2)
            second = orchestrator.leadership
            assert second is not None and second.token > first.token
            assert await md.leader() == ("node0", second.token)
            assert all(planned)  # it never planned while not leading
            await stop([task])
            assert await md.leader() is None  # cancelled: it resigned at once

    run(body())


def test_orchestrator_refuses_bad_arguments(etcd: EtcdServer, cluster_name: str) -> None:
    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            with pytest.raises(ValueError, match="expected nodes 0"):
                Orchestrator(md, "n", vbuckets=8, replicas=1, expected_nodes=0)
            with pytest.raises(ValueError, match="vbuckets 0"):
                Orchestrator(md, "n", vbuckets=0, replicas=1, expected_nodes=1)

    run(body())
