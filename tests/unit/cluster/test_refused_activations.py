"""A node's refusal of a vbucket is judged per activation (`NodeAgent._refuses`,
rules.refuses_activation): a later map's activation decided on this very process stands,
although an earlier one was refused; one decided before this process is refused again.

The agent is built without a node (its judgement reads only the applied map's activations,
this process's registration and what its disk vouched for): no server is involved."""

from __future__ import annotations

import types

from changefeed.cluster.metadata import Activation
from changefeed.cluster.node_agent import NodeAgent


def _agent(registration: int) -> NodeAgent:
    agent = NodeAgent.__new__(NodeAgent)
    agent.config = types.SimpleNamespace(node_name="n2")  # type: ignore[assignment]
    agent.registration = registration
    agent.holds_branch = {}
    agent.refused_activations = {}
    agent.activations = {}
    agent.applied_revision = 0
    return agent


def _apply(agent: NodeAgent, revision: int, activation: Activation) -> bool:
    agent.applied_revision = revision
    agent.activations = {0: activation}
    return agent._refuses(0)


def test_a_refusal_is_judged_again_when_a_later_map_changes_the_activation() -> None:
    agent = _agent(registration=12)
    assert _apply(agent, 20, Activation("n2", 7))  # decided on an earlier process
    assert agent.refused_activations == {0: 7}
    assert _apply(agent, 21, Activation("n2", 7))  # the same activation: still refused
    # A later map makes it active again, judged on this process: it takes it (it stayed
    # refused forever before, and its request was never put again).
    assert not _apply(agent, 30, Activation("n2", 12))
    assert agent.refused_activations == {}
    # The map does not say (an older map format): its own revision stands for the decision.
    agent.activations = {}
    agent.applied_revision = 11
    assert agent._refuses(0) and agent.refused_activations == {0: 11}
    agent.applied_revision = 31
    assert not agent._refuses(0) and agent.refused_activations == {}


def test_a_copy_its_disk_vouches_for_is_never_refused() -> None:
    agent = _agent(registration=12)
    agent.holds_branch = {0: True}
    assert not _apply(agent, 20, Activation("n2", 7))
    assert agent.refused_activations == {}
