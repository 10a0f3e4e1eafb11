"""Run, replay and shrink simulator seeds from the command line.

.venv/bin/python -m tests.sim.run --seed 1234                 # one seed, faults from it
.venv/bin/python -m tests.sim.run --seed 1234 --faults 'crash:n1@1.00+2.00'
.venv/bin/python -m tests.sim.run --seeds 0:500               # a range; shrinks failures
.venv/bin/python -m tests.sim.run --scenario split --seed 7    # a scenario of issue 25
.venv/bin/python -m tests.sim.run --seeds 0:500 --rules fenced-unaware  # other rules

A range ends with its totals: what clients were acknowledged (the availability a rule set
keeps) and the failures by kind.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

from .cluster import SimConfig, run, shrink
from .faults import Fault
from .rules import rule_sets
from .scenarios import SCENARIOS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.sim.run")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--seeds", help="start:stop, a range of seeds")
    parser.add_argument("--faults", nargs="*", help="a fault schedule (text forms)")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--replicas", type=int)
    parser.add_argument("--vbuckets", type=int)
    parser.add_argument("--clients", type=int)
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--rules", choices=sorted(rule_sets()), help="default: the tree's")
    args = parser.parse_args(argv)
    rules = rule_sets()[args.rules]() if args.rules else None
    if args.seeds:
        first, stop = (int(x) for x in args.seeds.split(":"))
        seeds = range(first, stop)
    else:
        seeds = range(args.seed or 0, (args.seed or 0) + 1)
    failed = 0
    began = time.perf_counter()
    totals: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    for seed in seeds:
        config, faults = _plan(args, seed)
        result = run(seed, faults, config, rules)
        totals.update({k: v for k, v in result.stats.items() if k != "map_rev"})
        if result.ok:
            if len(seeds) == 1:
                print(result.report())
            continue
        failed += 1
        kinds.update({_kind(line) for line in result.failures})
        print(result.report(), flush=True)
        if not args.no_shrink and result.faults:
            small = shrink(result, rules)
            print(f"shrunk to {len(small.faults)} faults:")
            print(small.report())
    wall = time.perf_counter() - began
    print(f"{len(seeds)} seeds, {failed} failed, {wall:.1f} s ({len(seeds) / wall:.1f} seeds/s)")
    if len(seeds) > 1:
        print("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(totals.items())))
        print("failures: " + (", ".join(f"{k} {v}" for k, v in sorted(kinds.items())) or "none"))
    return 1 if failed else 0


def _kind(failure: str) -> str:
    """A failure line's kind, without its particulars."""
    for kind in (
        "durable write lost",
        "CAS updates of",
        "is down at the end",
        "differs",
        "no copy",
    ):
        if kind in failure:
            return kind
    return failure.split(":")[0][:40]


def _plan(args: argparse.Namespace, seed: int) -> tuple[SimConfig, list[Fault] | None]:
    if args.scenario:
        config, faults = SCENARIOS[args.scenario]()
    else:
        config, faults = SimConfig.for_seed(seed), None
    overrides = {
        k: getattr(args, k)
        for k in ("nodes", "replicas", "vbuckets", "clients")
        if getattr(args, k) is not None
    }
    if overrides:
        config = SimConfig(**{**_fields(config), **overrides})
    if args.faults is not None:
        faults = [Fault.parse(text) for text in args.faults]
    elif args.no_faults:
        faults = []
    return config, faults


def _fields(config: SimConfig) -> dict[str, object]:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}


if __name__ == "__main__":
    sys.exit(main())
