"""Random seeds: 0-499 and the seeds that once failed, up to 51,999 under `-m slow`.

A seed draws its cluster shape, workload, network and faults (faults.py: swarm schedules
aimed at one vbucket's chain, and a fifth of them instances of known-dangerous patterns).
A failure prints its replay line (``.venv/bin/python -m tests.sim.run --seed N ...``, which
also shrinks it). Any failure fails the chunk: a lost write, an exception, an assert in
production code, copies that do not converge, a consumer seeing seqnos go backwards.

The default suite runs seeds 0-499 (`SIM_CI_SEEDS`) and `REGRESSION_SEEDS`, the random seeds
that failed on some build (docs/simulator.md): cheap, and a schedule that once found a loss.
The slow suite runs every other seed of 0-51,999 (`SIM_SLOW_SEEDS` past `SIM_CI_SEEDS`), so
the two together still cover the range CI ran before (0-1,999, about two minutes of the
suite's wall time) and more.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from collections.abc import Sequence

import pytest

from .cluster import RunResult, run

CI_SEEDS = int(os.environ.get("SIM_CI_SEEDS", "500"))
SLOW_SEEDS = int(os.environ.get("SIM_SLOW_SEEDS", str(52000 - CI_SEEDS)))
# Random seeds that lost a write or broke a rule on some build (docs/simulator.md, "What it
# found"): 211-1420 on the first fencing rules, 5789-15775 in the slow seeds; 379 is where
# the promote_out_of_sync mutant is caught (test_mutations.py).
REGRESSION_SEEDS = (211, 379, 425, 611, 1243, 1253, 1269, 1409, 1420, 5789, 8805, 11696, 15775)


def _results(seeds: Sequence[int]) -> list[RunResult]:
    """Every seed's run, in `SIM_WORKERS` processes (default: one per core, at most 4, when
    the suite runs in one process; one under pytest-xdist, whose workers use the cores
    already and whose threads make a forked pool's children crash)."""
    cores = 1 if os.environ.get("PYTEST_XDIST_WORKER") else min(4, os.cpu_count() or 1)
    workers = int(os.environ.get("SIM_WORKERS", str(cores)))
    if workers <= 1:
        return [run(seed) for seed in seeds]
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        return list(pool.map(run, seeds, chunksize=8))


def _run_seeds(seeds: Sequence[int]) -> None:
    began = time.perf_counter()
    failed: list[RunResult] = []
    for result in _results(seeds):
        if not result.ok:
            failed.append(result)
            print(result.report())
    wall = time.perf_counter() - began
    rate = len(seeds) / wall
    print(f"{len(seeds)} seeds in {wall:.0f} s ({rate:.1f} seeds/s), {len(failed)} failed")
    assert not failed, "\n".join(r.report() for r in failed[:5])


CHUNK_SEEDS = 250  # one test per chunk: each well inside the suite's 600 s timeout


def _chunks(first: int, count: int) -> list[range]:
    return [
        range(start, min(first + count, start + CHUNK_SEEDS))
        for start in range(first, first + count, CHUNK_SEEDS)
    ]


@pytest.mark.parametrize("seeds", _chunks(0, CI_SEEDS), ids=lambda r: f"{r.start}-{r.stop}")
def test_random_seeds_ci(seeds: range) -> None:
    _run_seeds(seeds)


def test_regression_seeds() -> None:
    _run_seeds([seed for seed in REGRESSION_SEEDS if seed >= CI_SEEDS])


@pytest.mark.slow
@pytest.mark.parametrize(
    "seeds", _chunks(CI_SEEDS, SLOW_SEEDS), ids=lambda r: f"{r.start}-{r.stop}"
)
def test_random_seeds_slow(seeds: range) -> None:
    _run_seeds(seeds)
