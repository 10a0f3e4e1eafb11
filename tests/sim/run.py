"""Run, replay and shrink simulator seeds from the command line.

.venv/bin/python -m tests.sim.run --seed 1234                 # one seed, faults from it
.venv/bin/python -m tests.sim.run --seed 1234 --faults 'crash:n1@1.00+2.00'
.venv/bin/python -m tests.sim.run --seeds 0:500               # a range; shrinks failures
.venv/bin/python -m tests.sim.run --scenario split --seed 7    # a scenario of issue 25
"""

from __future__ import annotations

import argparse
import sys
import time

from .cluster import SimConfig, run, shrink
from .faults import Fault
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
    args = parser.parse_args(argv)
    if args.seeds:
        first, stop = (int(x) for x in args.seeds.split(":"))
        seeds = range(first, stop)
    else:
        seeds = range(args.seed or 0, (args.seed or 0) + 1)
    failed = 0
    began = time.perf_counter()
    for seed in seeds:
        config, faults = _plan(args, seed)
        result = run(seed, faults, config)
        if result.ok:
            if len(seeds) == 1:
                print(result.report())
            continue
        failed += 1
        print(result.report())
        if not args.no_shrink and result.faults:
            small = shrink(result)
            print(f"shrunk to {len(small.faults)} faults:")
            print(small.report())
    wall = time.perf_counter() - began
    print(f"{len(seeds)} seeds, {failed} failed, {wall:.1f} s ({len(seeds) / wall:.1f} seeds/s)")
    return 1 if failed else 0


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
