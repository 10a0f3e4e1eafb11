"""Added latency (``Network.slow``, ``docs/test-hosts.md``) on the active of vbucket 0: every
packet between it and its peers, etcd and the client is held ``delay`` each way while the
official SDK writes at durability MAJORITY. Every acknowledged write must survive (the checker,
``workload.check``) and the cluster must go on acknowledging writes while the delay lasts.

The orchestrator fails over a node whose NOOP probes go unanswered for 0.6 s (a probe counts as
unanswered after 0.3 s, ``cluster/rules.py``): a round trip well below that (the default test,
2 x 40 ms) leaves the node in place; near or above it (the slow tests, 2 x 80 and 2 x 250 ms)
the node may be failed over as silent and rejoin after the heal, and the outcome must be just as
correct. Either way there is no failover loop: a failover writes a new map, so the map's
revision grows by a few at most, not once per probe round.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

from support.hosts import HostCluster, leftovers

from .test_faults import chain_of
from .workload import run_scenario

pytestmark = pytest.mark.timeout(240)

LEASE_S = 3
FAULT_S = 5.0
MAP_REVS_MAX = 3  # a failover (and a rejoin, a re-placement): a loop would write one a round


def acked(workdir: Path, seed: int) -> int:
    """Writes the SDK writer has recorded as acknowledged so far."""
    path = workdir / f"writes-{seed}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(json.loads(line)["outcome"] == "ok" for line in lines if line.endswith("}"))


def run_with_latency(workdir: Path, seed: int, delay_s: float) -> None:
    seen: dict[str, int] = {}
    with HostCluster(workdir, nodes=3, replicas=2, failover_timeout_s=LEASE_S) as hosts:

        def slow_active(cluster: HostCluster) -> None:
            active, _ = chain_of(cluster, 0)
            seen["rev_before"] = cluster.run(cluster.newest_map()).rev
            cluster.network.slow(active, delay_s)
            [delayer] = cluster.network.delayers
            before = acked(workdir, seed)
            time.sleep(FAULT_S)
            seen["acked_during"] = acked(workdir, seed) - before
            seen["forwarded"] = delayer.forwarded
            cluster.network.heal()

        report = run_scenario(hosts, workdir, slow_active, seed=seed)
        seen["rev_after"] = hosts.run(hosts.newest_map()).rev
        print(f"latency {delay_s} s each way: {seen}")
        assert report.acked > 0, report
        assert report.ok, report
        assert seen["forwarded"], seen  # the node's traffic really went through the delay
        assert seen["acked_during"], seen  # the cluster kept acknowledging under latency
        assert seen["rev_after"] - seen["rev_before"] <= MAP_REVS_MAX, seen
        prefix = hosts.prefix
    assert leftovers(prefix) == []


@pytest.fixture
def seed(rng: random.Random) -> int:
    return rng.randrange(1, 10**6)


def test_latency_below_the_silence_rule_loses_no_acknowledged_write(
    workdir: Path, seed: int
) -> None:
    run_with_latency(workdir, seed, 0.04)


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.08, 0.25])
def test_latency_near_and_above_the_silence_rule_loses_no_acknowledged_write(
    workdir: Path, seed: int, delay_s: float
) -> None:
    run_with_latency(workdir, seed, delay_s)
