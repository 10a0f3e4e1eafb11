"""The map's activations and the per-vbucket failover requests in etcd (`ClusterMetadata`:
`write_map`, `read_map_activations`, `request_vbucket_failover`; rules.refuses_activation).

Real etcd on loopback. An activation records the registration the active had when a map first
made it the vbucket's active; it carries over while the active stays (a later registration of
that node does not refresh it: the orchestrator never judged that process for this vbucket),
and is judged anew when the active changes. A map that answers a request deletes it."""

from __future__ import annotations

import asyncio
import types

from changefeed.cluster.etcd_server import EtcdServer
from changefeed.cluster.metadata import Activation, ClusterMetadata
from changefeed.cluster.node_agent import NodeAgent
from changefeed.cluster.rules import refuses_activation
from changefeed.vbmap import ClusterMap, NodeAddress

NODES = tuple(NodeAddress(f"n{i}", "127.0.0.1", 1 + i) for i in range(3))


def _map(rev: int, chains: tuple[tuple[int, ...], ...]) -> ClusterMap:
    return ClusterMap(rev, NODES, chains, 2)


def test_activations_are_judged_when_the_active_changes_and_carried_over_otherwise(
    etcd: EtcdServer, cluster_name: str
) -> None:
    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            leadership = await md.campaign("orch", ttl_s=5)
            for node in NODES:
                await md.register_node(node, 30)
            first_regs = await md.registrations()
            rev1 = await md.write_map(_map(1, ((0, 1, 2), (1, 2, 0))), None, leadership)
            assert rev1 is not None
            stored = await md.read_map_activations()
            assert stored is not None and stored.revision == rev1
            assert stored.activations == {
                0: Activation("n0", first_regs["n0"]),
                1: Activation("n1", first_regs["n1"]),
            }
            # n0 restarts (registers again): the map still makes it vb 0's active, on the
            # registration judged before, which its new process refuses (unless its disk
            # vouches for the copy).
            again = await md.register_node(NODES[0], 30)
            assert again.registration > first_regs["n0"]
            rev2 = await md.write_map(_map(2, ((0, 1, 2), (2, 1, 0))), rev1, leadership)
            assert rev2 is not None
            stored = await md.read_map_activations()
            assert stored is not None
            assert stored.activations[0] == Activation("n0", first_regs["n0"])
            assert stored.activations[1] == Activation("n2", first_regs["n2"])
            kept = stored.activations[0].registration
            assert refuses_activation(kept, rev2, again.registration, holds_branch=False)
            assert not refuses_activation(kept, rev2, again.registration, holds_branch=True)

            # It refuses and asks; the map that moves vb 0 away answers (deletes) the request,
            # and vb 0's new active is judged on its current registration.
            await md.request_vbucket_failover(0, "n0", again.registration)
            assert await md.vbucket_failover_requests() == {0: "n0"}
            rev3 = await md.write_map(
                _map(3, ((1, 2, 0), (2, 1, 0))), rev2, leadership, answered=[0]
            )
            assert rev3 is not None
            assert await md.vbucket_failover_requests() == {}
            stored = await md.read_map_activations()
            assert stored is not None
            assert stored.activations[0] == Activation("n1", first_regs["n1"])
            # An activation set explicitly (a record's writer reinstated on the record's
            # revision: its own disk decides) is stored as given.
            rev4 = await md.write_map(
                _map(4, ((1, 2, 0), (0, 1, 2))), rev3, leadership,
                reinstated={1: Activation("n0", rev3)},
            )  # fmt: skip
            assert rev4 is not None
            stored = await md.read_map_activations()
            assert stored is not None and stored.activations[1] == Activation("n0", rev3)

    asyncio.run(body())


def test_a_request_is_deleted_only_if_still_the_one_read_and_by_the_term_that_leads(
    etcd: EtcdServer, cluster_name: str
) -> None:
    """The orchestrator deletes a request it finds stale; one the node put again since (a
    later map made the vbucket its again) must survive, and a deposed term deletes nothing."""

    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            leadership = await md.campaign("orch", ttl_s=5)
            await md.request_vbucket_failover(3, "n1", 40)
            read = (await md.stored_vbucket_failover_requests())[3]
            assert (read.node, read.registration) == ("n1", 40)
            await md.request_vbucket_failover(3, "n1", 40)  # put again after the read
            assert not await md.clear_vbucket_failover_request(3, read.revision, leadership)
            assert await md.vbucket_failover_requests() == {3: "n1"}
            again = (await md.stored_vbucket_failover_requests())[3]
            await leadership.resign()
            assert not await md.clear_vbucket_failover_request(3, again.revision, leadership)
            assert await md.vbucket_failover_requests() == {3: "n1"}
            assert await md.clear_vbucket_failover_request(3, again.revision)  # the node's own
            assert await md.vbucket_failover_requests() == {}

    asyncio.run(body())


def test_a_node_keeps_a_request_per_refused_vbucket_and_deletes_the_others_it_left(
    etcd: EtcdServer, cluster_name: str
) -> None:
    """`NodeAgent._ask_failovers` against real etcd (the agent built without a node: the
    round reads only its refusals and etcd). A request an earlier process of the node left
    is deleted (the orchestrator would fail that vbucket over although this process took
    it); one the orchestrator deleted while the vbucket is still refused is put again (it
    was put once only before); another node's request is left alone."""

    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            agent = NodeAgent.__new__(NodeAgent)
            agent.metadata = md
            agent.config = types.SimpleNamespace(node_name="n1")  # type: ignore[assignment]
            agent.registration = 50
            agent.refused_activations = {}
            agent._swept = False
            await md.request_vbucket_failover(2, "n1", 40)  # an earlier process's
            await md.request_vbucket_failover(3, "n0", 45)
            await agent._ask_failovers()
            assert await md.vbucket_failover_requests() == {3: "n0"}
            agent.refused_activations = {4: 7}
            await agent._ask_failovers()
            assert await md.vbucket_failover_requests() == {3: "n0", 4: "n1"}
            stored = (await md.stored_vbucket_failover_requests())[4]
            assert stored.registration == 50
            assert await md.clear_vbucket_failover_request(4, stored.revision)  # found stale
            await agent._ask_failovers()
            assert await md.vbucket_failover_requests() == {3: "n0", 4: "n1"}
            agent.refused_activations = {}  # a later map's activation was taken
            await agent._ask_failovers()
            assert await md.vbucket_failover_requests() == {3: "n0"}

    asyncio.run(body())
