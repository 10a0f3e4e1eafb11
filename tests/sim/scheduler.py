"""The simulator's one source of time and order: a seeded heap of events on a simulated clock.

Every event is `(time_s, seq, callback, args)`; `seq` breaks ties in the order events were
scheduled, so a run depends only on its seed. Nothing in the simulator reads real time or the
global `random`: each part draws from its own `random.Random` stream derived from the seed
(`stream`), so adding draws to one part (a fault dropped while shrinking) disturbs the others
as little as possible.

A trace hash (`record`) folds every message delivered and every client outcome; two runs of one
seed must end with the same hash (tests/sim/test_replay.py).
"""

from __future__ import annotations

import hashlib
import heapq
import os
import random
import sys
from collections.abc import Callable
from typing import Any

_PRINT_TRACE = os.environ.get("SIM_TRACE") == "1"  # print each traced step (debugging a seed)
EPOCH_S = 1_800_000_000.0  # the simulated wall clock's zero (CAS clocks need a plausible epoch)


class SimulationError(Exception):
    """The simulation itself broke a rule it checks (a bug in tests/sim, not in the node)."""


class Scheduler:
    """A min-heap of events; `run_until` pops them in (time, seq) order and runs them.

    Args:
        seed: the run's seed; `stream(name)` derives the per-part generators from it.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self._trace = hashlib.blake2b(digest_size=16)
        self.events_run = 0

    def stream(self, name: str) -> random.Random:
        """A generator of its own for one part of the simulation (network, workload...)."""
        return random.Random(f"{self.seed}:{name}")

    def wall_clock(self) -> float:
        """Simulated seconds since the epoch (VBucket CAS and delete times)."""
        return EPOCH_S + self.now

    def monotonic(self) -> float:
        """Simulated monotonic seconds (trackers, producers)."""
        return self.now

    def at(self, time_s: float, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback(*args)` at simulated `time_s` (never in the past)."""
        assert time_s >= self.now, (time_s, self.now)
        self._seq += 1
        heapq.heappush(self._heap, (time_s, self._seq, callback, args))

    def after(self, delay_s: float, callback: Callable[..., None], *args: Any) -> None:
        assert delay_s >= 0, delay_s
        self.at(self.now + delay_s, callback, *args)

    def run_until(self, end_s: float) -> None:
        """Run every event due at or before `end_s`; the clock ends at `end_s`."""
        heap = self._heap
        while heap and heap[0][0] <= end_s:
            time_s, _, callback, args = heapq.heappop(heap)
            assert time_s >= self.now, (time_s, self.now)
            self.now = time_s
            self.events_run += 1
            callback(*args)
        self.now = max(self.now, end_s)

    def record(self, *parts: object) -> None:
        """Fold one observable step into the trace hash."""
        line = repr((round(self.now, 9), *parts))
        self._trace.update(line.encode())
        if _PRINT_TRACE:
            print(line, file=sys.stderr)

    @property
    def trace_hash(self) -> str:
        return self._trace.hexdigest()
