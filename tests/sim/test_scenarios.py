"""The losses of issue 25 ("Partitions") as regression seeds, and the one the simulator found
on the fencing rules that fixed them.

Recorded 2026-11-28 (docs/simulator.md): on the rules as they were before the partition
fixes (`TodayRules`), the `split` and `etcd_cut` scenarios lose acknowledged durable writes
or CAS updates with the seeds below; on the fencing rules of fae8c28 (`FencedRules`) they
lose nothing. `restart_before_map` (random seed 611's one short crash) lost durable writes
on those first fencing rules (`FencedRulesFirstCut`: a restarted active served its recovered
vbuckets before it had read a map) and loses nothing since `cluster.rules.recovered_state`.
"""

from __future__ import annotations

import pytest

from .cluster import run
from .rules import FencedRulesFirstCut, TodayRules
from .scenarios import SCENARIOS

# Seeds whose run lost acknowledged writes on the rules named.
LOST_ON_TODAYS_RULES = {"split": (1, 5, 6, 8, 9, 10), "etcd_cut": (1, 3, 4, 8)}
LOST_ON_FENCED_RULES = {"restart_before_map": (3, 8, 9, 611)}


@pytest.mark.parametrize("seed", LOST_ON_TODAYS_RULES["split"])
def test_split_of_an_active_and_a_replica_loses_nothing(seed: int) -> None:
    config, faults = SCENARIOS["split"]()
    result = run(seed, faults, config)
    assert result.ok, result.report()


@pytest.mark.parametrize("seed", LOST_ON_TODAYS_RULES["etcd_cut"])
def test_an_active_cut_from_etcd_loses_nothing(seed: int) -> None:
    config, faults = SCENARIOS["etcd_cut"]()
    result = run(seed, faults, config)
    assert result.ok, result.report()


@pytest.mark.parametrize("seed", LOST_ON_FENCED_RULES["restart_before_map"])
def test_a_restarted_active_acknowledges_nothing_before_its_map(seed: int) -> None:
    config, faults = SCENARIOS["restart_before_map"]()
    result = run(seed, faults, config)
    assert result.ok, result.report()


def test_the_first_fencing_rules_lose_writes_when_a_restarted_active_serves_before_its_map() -> (
    None
):
    """The loss the simulator found in fae8c28 (a recovered active served with no map, so a
    durable write counted a chain of one), kept as a regression: the seeds still find it on
    those rules, and pass on `cluster.rules.recovered_state`."""
    config, faults = SCENARIOS["restart_before_map"]()
    for seed in LOST_ON_FENCED_RULES["restart_before_map"]:
        result = run(seed, faults, config, FencedRulesFirstCut())
        assert not result.ok, result.report()


@pytest.mark.parametrize("name", sorted(LOST_ON_TODAYS_RULES))
def test_todays_rules_lose_writes_in_the_scenario(name: str) -> None:
    """The simulator finds each loss of issue 25 on the rules it was reported against."""
    config, faults = SCENARIOS[name]()
    for seed in LOST_ON_TODAYS_RULES[name]:
        result = run(seed, faults, config, TodayRules())
        assert not result.ok, result.report()
        assert all(" lost" in line for line in result.failures), result.report()
