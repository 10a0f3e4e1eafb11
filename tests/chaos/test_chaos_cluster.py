"""The Jepsen-style chaos suite (issue 12, "Chaos suite"): a cluster with automatic failover
under a nemesis (kill -9 and restart, clean restart, SIGSTOP/SIGCONT pause) while a loader
writes at a durability level, a consumer streams and the Spark mirror mirrors; the checker's
counts must all be zero (``nemesis.checker``).

* ``test_chaos_short`` (default suite, CI): 3 nodes, 2 replicas, schedule A (one node at a
  time), ``CHANGEFEED_CHAOS_SHORT_S`` (default 20) seconds of faults, with the mirror. Its
  default seed is fixed (SHORT_SEED), so a CI run is one known schedule: in 20 s a pause
  past the lease (a failover, and the paused active's return as a replica), a clean restart,
  a short pause and a kill; the long runs draw a fresh seed each time.
* ``test_chaos_short_full`` (``-m slow``): the same seed's 40 s schedule (the default suite's
  until 28 November: two more kills, a restart and a pause).
* ``test_chaos_long`` (``-m slow``): ``CHANGEFEED_CHAOS_S`` (default 120) seconds per
  schedule: A on 3 nodes, B (a minority together: 2 of 5) on 5 nodes; with the mirror.

``CHANGEFEED_CHAOS_SEED`` replays a run's schedule (the report prints it);
``CHANGEFEED_CHAOS_DURABILITY`` (default ``majority``; ``none``, ``majorityAndPersistActive``,
``persistToMajority``) sets the loader's level. With ``none`` acknowledged writes may be lost
on failover: the report counts those as information only. A healthy cluster that refuses the
level (DURABILITY_IMPOSSIBLE before any fault) fails the test at once, saying so.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from nemesis.harness import (
    FAILOVER_TIMEOUT_S,
    ChaosConfig,
    DurabilityUnsupportedError,
    env_durability,
    env_seed,
    run_chaos,
)
from nemesis.history import Outcome
from nemesis.schedule import Targets, describe, make_schedule

from changefeed.cluster.etcd_server import EtcdServer
from support.etcd import cluster_name, etcd
from support.nodes import NodeFactory

__all__ = ["cluster_name", "etcd"]  # the cluster tests' fixtures, used here too
SHORT_SEED = 766956336
SHORT_S = "20"  # the default suite's seconds of faults (CHANGEFEED_CHAOS_SHORT_S)


def play(
    config: ChaosConfig,
    nodes: NodeFactory,
    etcd: EtcdServer,
    name: str,
    tmp: Path,
    request: pytest.FixtureRequest,
) -> None:
    slow = " -m slow" if request.node.get_closest_marker("slow") else ""
    replay = (
        f"CHANGEFEED_CHAOS_SEED={config.seed} .venv/bin/pytest '{request.node.nodeid}' -s{slow}"
    )
    try:
        report = run_chaos(config, nodes, etcd, name, tmp)
    except DurabilityUnsupportedError as error:  # SyncWrites are built: refusing is a bug
        pytest.fail(f"{error} (CHANGEFEED_CHAOS_DURABILITY=none runs without durability)")
    except BaseException as error:
        error.add_note(f"chaos seed {config.seed}; replay: {replay}")
        raise
    report.replay = replay
    print(report.render())
    assert report.operations()[Outcome.OK.value] > 0, "no write was acknowledged: nothing tested"
    assert not report.failed, f"chaos checker failed:\n{report.render()}"


def short_config(duration_s: float) -> ChaosConfig:
    return ChaosConfig(
        seed=env_seed(SHORT_SEED),
        durability=env_durability(),
        duration_s=duration_s,
        targets="one",
        nodes=3,
        replicas=2,
        mirror=os.environ.get("CHANGEFEED_CHAOS_MIRROR", "1") != "0",
    )


def test_the_short_schedule_has_every_kind_of_fault() -> None:
    """What the default suite's short run plays (the seed is fixed): each kind of fault, and
    a pause longer than the lease, so a failover happens and the old active rejoins."""
    steps = make_schedule(SHORT_SEED, nodes=3, duration_s=float(SHORT_S), targets="one")
    assert {step.kind for step in steps} == {"kill", "restart", "pause"}, describe(steps)
    assert any(step.kind == "pause" and step.down_s > FAILOVER_TIMEOUT_S for step in steps), (
        describe(steps)
    )


@pytest.mark.timeout(600)
def test_chaos_short(
    nodes: NodeFactory,
    etcd: EtcdServer,
    cluster_name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    duration_s = float(os.environ.get("CHANGEFEED_CHAOS_SHORT_S", SHORT_S))
    play(short_config(duration_s), nodes, etcd, cluster_name, tmp_path, request)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_chaos_short_full(
    nodes: NodeFactory,
    etcd: EtcdServer,
    cluster_name: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    play(short_config(40.0), nodes, etcd, cluster_name, tmp_path, request)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("targets", "count"), [("one", 3), ("minority", 5)])
def test_chaos_long(
    nodes: NodeFactory,
    etcd: EtcdServer,
    cluster_name: str,
    tmp_path: Path,
    targets: Targets,
    count: int,
    request: pytest.FixtureRequest,
) -> None:
    config = ChaosConfig(
        seed=env_seed(),
        durability=env_durability(),
        duration_s=float(os.environ.get("CHANGEFEED_CHAOS_S", "120")),
        targets=targets,
        nodes=count,
        replicas=2,
        keys=1000,
    )
    play(config, nodes, etcd, cluster_name, tmp_path, request)
