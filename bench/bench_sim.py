"""Cluster simulator benchmark (issue 24): seeds per second and simulated cluster-seconds per
wall second.

Runs the deterministic simulator (tests/sim/) over a range of seeds per cluster shape and
reports, per shape: seeds per wall second, CPU seconds per seed (this process's user +
system time: on this shared machine wall time moves with other load, CPU time much less),
simulated seconds of cluster time per wall second, scheduler events per seed and per CPU
second, and client operations acknowledged per seed. Each seed is a whole run: the nodes
start, elect, place the first map, work under faults from the seed, heal, settle and are
checked (tests/sim/cluster.py).

Usage::

    .venv/bin/python bench/bench_sim.py               # 200 seeds per shape
    .venv/bin/python bench/bench_sim.py --seeds 50    # a smoke run
    .venv/bin/python bench/bench_sim.py --no-faults   # the same seeds without faults

The table goes to stdout and, with ``--results PATH``, to a file (the figures of a full run
are kept in docs/simulator.md, "Cost").
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # tests.sim is imported as a package from the repository root

from tests.sim.cluster import SimConfig, run  # noqa: E402
from tests.sim.rules import rules_for_tree  # noqa: E402

SHAPES = {
    "3 nodes, 2 replicas, 4 vbuckets": SimConfig(),
    "3 nodes, 1 replica, 4 vbuckets": SimConfig(nodes=3, replicas=1, vbuckets=4),
    "5 nodes, 2 replicas, 5 vbuckets": SimConfig(nodes=5, replicas=2, vbuckets=5, clients=3),
}


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(config: SimConfig, seeds: range, faults: bool) -> dict[str, float]:
    wall, cpu = time.perf_counter(), _cpu_s()
    sim_s = events = acked = failed = 0.0
    for seed in seeds:
        result = run(seed, None if faults else [], config)
        sim_s += result.sim_s
        events += result.events
        acked += result.stats["durable_acked"] + result.stats["cas_acked"]
        acked += result.stats["plain_acked"]
        failed += not result.ok
    wall, cpu = time.perf_counter() - wall, _cpu_s() - cpu
    n = len(seeds)
    return {
        "seeds_per_s": n / wall,
        "cpu_ms_per_seed": 1000 * cpu / n,
        "sim_s_per_wall_s": sim_s / wall,
        "events_per_seed": events / n,
        "events_per_cpu_s": events / cpu,
        "acked_per_seed": acked / n,
        "failed": failed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200, help="seeds per shape")
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--results", default="-", help="also write the table here")
    args = parser.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    rows = [(name, measure(config, seeds, not args.no_faults)) for name, config in SHAPES.items()]
    lines = table(rows, args)
    print("\n".join(lines))
    if args.results != "-":
        Path(args.results).write_text("\n".join(lines) + "\n")


def table(rows: list[tuple[str, dict[str, float]]], args: argparse.Namespace) -> list[str]:
    load = os.getloadavg()[0]
    lines = [
        f"cluster simulator: {args.seeds} seeds per shape from {args.first_seed}, "
        f"faults {'off' if args.no_faults else 'from the seed'}, rules {rules_for_tree().name}",
        f"Python {platform.python_version()} ({platform.machine()}), {os.cpu_count()} CPUs, "
        f"load average {load:.1f} at the end",
        "",
    ]
    header = (
        f"{'shape':<34} {'seeds/s':>8} {'CPU ms/seed':>12} {'sim s/wall s':>13} "
        f"{'events/seed':>12} {'events/CPU s':>13} {'acked/seed':>11} {'failed':>7}"
    )
    lines += [header, "-" * len(header)]
    for name, m in rows:
        lines.append(
            f"{name:<34} {m['seeds_per_s']:>8.1f} {m['cpu_ms_per_seed']:>12.0f} "
            f"{m['sim_s_per_wall_s']:>13.1f} {m['events_per_seed']:>12.0f} "
            f"{m['events_per_cpu_s']:>13.0f} {m['acked_per_seed']:>11.0f} {m['failed']:>7.0f}"
        )
    flags = f" --seeds {args.seeds}" + (" --no-faults" if args.no_faults else "")
    lines += ["", f"command: .venv/bin/python bench/bench_sim.py{flags}"]
    return lines


if __name__ == "__main__":
    main()
