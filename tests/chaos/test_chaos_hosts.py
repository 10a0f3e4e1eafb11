"""The chaos suite on test hosts (issue 25, item 4): each node and etcd member in a network
namespace of its own (``support.hosts``, a 3-member etcd), a seeded nemesis of partitions
(a full partition of one node; a split of a minority of the nodes and one etcd member from the
rest, the client reaching both sides), one-way loss in either direction, a node cut from etcd
only, etcd member kills (the leader or another), kill -9 and SIGSTOP of nodes
(``nemesis.network``), while the loader writes at a durability level, the official SDK makes
CAS read-modify-writes, and a consumer streams; the checker's counts must all be zero
(``nemesis.checker``, ``nemesis.host_harness``).

* ``test_chaos_hosts_short`` (default suite): 3 nodes, 2 replicas, lease 3 s,
  ``CHANGEFEED_CHAOS_SHORT_S`` (default 30) seconds of faults from a fixed seed whose schedule
  holds one of each network and etcd fault; no mirror (the JVM would not fit the time).
* ``test_chaos_hosts_long`` (``-m slow``): ``CHANGEFEED_CHAOS_S`` (default 120) seconds on 3
  nodes and on 5 (where a split's minority holds an active and one of its replicas, so both
  sides could acknowledge), a fresh seed each time; the Spark mirror with
  ``CHANGEFEED_CHAOS_MIRROR=1``.

Every report prints its seed and the command that replays it (``CHANGEFEED_CHAOS_SEED``).
Needs root (network namespaces) and ``ip``; skipped otherwise.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from nemesis.harness import DurabilityUnsupportedError, env_durability, env_seed
from nemesis.history import Outcome
from nemesis.host_harness import HostChaosConfig, run_host_chaos, schedule
from nemesis.network import HOST_KINDS, NETWORK_KINDS

from support.hosts import HostCluster, leftovers

needs_hosts = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="test hosts need root (network namespaces) and iproute2's ip",
)
SHORT_SEED = 20261157  # 6 steps, one of each network and etcd fault, 3 of them past the lease
LEASE_S = 3


def replay_command(request: pytest.FixtureRequest, seed: int, extra: str = "") -> str:
    return (
        f"CHANGEFEED_CHAOS_SEED={seed}{extra} .venv/bin/pytest "
        f"'{request.node.nodeid}' -s" + (" -m slow" if request.node.get_closest_marker("slow")
                                         else "")
    )  # fmt: skip


def play(config: HostChaosConfig, nodes: int, tmp: Path, request: pytest.FixtureRequest) -> None:
    replay = replay_command(request, config.seed)
    with HostCluster(tmp, nodes=nodes, replicas=2, failover_timeout_s=LEASE_S) as cluster:
        prefix = cluster.prefix
        try:
            report = run_host_chaos(config, cluster, tmp, replay)
        except DurabilityUnsupportedError as error:
            pytest.fail(f"{error} (CHANGEFEED_CHAOS_DURABILITY=none runs without durability)")
        except BaseException as error:
            error.add_note(f"chaos seed {config.seed}; replay: {replay}")
            raise
    print(report.render())
    assert leftovers(prefix) == [], leftovers(prefix)
    assert report.operations()[Outcome.OK.value] > 0, "no write was acknowledged: nothing tested"
    assert not report.failed, f"chaos checker failed:\n{report.render()}"


def short_config() -> HostChaosConfig:
    return HostChaosConfig(
        seed=env_seed(SHORT_SEED),
        durability=env_durability(),
        duration_s=float(os.environ.get("CHANGEFEED_CHAOS_SHORT_S", "30")),
        kinds=NETWORK_KINDS,
        down_s=(1.5, 5.0),  # some past the 3 s lease (a failover), some not
        gap_s=(1.5, 3.0),
    )


def test_the_short_schedule_holds_each_network_fault() -> None:
    config = short_config()
    steps = schedule(config, 3, 3)
    if config.seed == SHORT_SEED and config.duration_s >= 30:
        assert set(NETWORK_KINDS) <= {s.kind for s in steps}, steps
        assert any(s.down_s > LEASE_S + 1 for s in steps if s.kind == "isolate"), steps
    assert steps == schedule(config, 3, 3)  # a seed replays its schedule


@needs_hosts
@pytest.mark.timeout(300)
def test_chaos_hosts_short(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    play(short_config(), 3, tmp_path, request)


@needs_hosts
@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("nodes", [3, 5])
def test_chaos_hosts_long(tmp_path: Path, request: pytest.FixtureRequest, nodes: int) -> None:
    config = HostChaosConfig(
        seed=env_seed(),
        durability=env_durability(),
        duration_s=float(os.environ.get("CHANGEFEED_CHAOS_S", "120")),
        kinds=HOST_KINDS,
        mirror=os.environ.get("CHANGEFEED_CHAOS_MIRROR", "0") == "1",
        keys=1000,
    )
    play(config, nodes, tmp_path, request)
