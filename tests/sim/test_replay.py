"""Every run replays bit for bit from its seed; a failure prints its replay line and shrinks."""

from __future__ import annotations

from .cluster import SimConfig, run, shrink
from .faults import Fault
from .scenarios import split


def test_a_seed_replays_bit_for_bit() -> None:
    for seed in (3, 7):
        first, second = run(seed), run(seed)
        assert first.trace_hash == second.trace_hash, seed
        assert first.failures == second.failures
        assert first.stats == second.stats
        assert first.events == second.events
        assert first.stats["durable_acked"] > 0, first.stats


def test_seeds_differ() -> None:
    assert run(3).trace_hash != run(4).trace_hash


def test_a_fault_schedule_prints_and_parses() -> None:
    faults = [
        Fault("split", 0.5, 4.5, ("c0", "n0", "n1")),
        Fault("slow_link", 1.25, 2.0, ("n0", "etcd"), 0.05),
        Fault("crash", 2.0, 1.0, ("n2",)),
    ]
    assert [Fault.parse(str(f)) for f in faults] == faults


def test_a_failure_prints_its_replay_command_and_shrinks() -> None:
    """The split of issue 25 plus a fault it does not need: shrinking drops the noise, and
    the replay line names the seed and the schedule that is left."""
    config, faults = split()
    noise = Fault("slow_disk", 0.2, 0.5, ("n4",), 0.05)
    result = run(1, [*faults, noise], config)
    if result.ok:  # the rules no longer lose writes in this split: nothing to shrink
        return
    small = shrink(result)
    assert small.faults == faults, small.faults
    assert not small.ok
    command = small.replay_command()
    assert command.startswith(".venv/bin/python -m tests.sim.run --seed 1 ")
    assert str(faults[0]) in command
    assert small.replay_command() in small.report()


def test_a_quiet_cluster_is_correct() -> None:
    result = run(11, [], SimConfig())
    assert result.ok, result.report()
    assert result.stats["map_rev"] == 1


def test_a_seed_replays_in_another_process() -> None:
    """Nothing depends on the process: another interpreter, with another string-hash seed
    (set iteration order), ends with the same trace hash."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    here = run(7).trace_hash
    code = "from tests.sim.cluster import run; print(run(7).trace_hash)"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    there = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert there == here
