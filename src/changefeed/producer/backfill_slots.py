"""How many disk backfills may run at once: per connection and per node.

A backfill holds up to BACKFILL_QUEUE_BYTES_MAX of records read from disk and not yet sent.
Without a bound on how many run at once, a DCP connection that opens 64 streams from seqno 0
and never reads made the node read ahead for all of them (measured +245 MiB). kv_engine bounds
the same thing (a per-connection backfill buffer and a limit on running backfills). A stream
that must read from disk takes a slot before it reads and gives it back once it reads from
memory again or ends; a stream without a slot waits, and is woken when one is given back.
"""

from __future__ import annotations

from collections.abc import Callable

from changefeed import limits


class BackfillSlots:
    """The node's running-backfill slots, shared by every producer connection."""

    def __init__(self, slots_max: int = limits.BACKFILLS_PER_NODE_MAX) -> None:
        assert slots_max > 0, slots_max
        self.slots_max = slots_max
        self.in_use = 0
        self.taken_total = 0  # slots ever taken: disk backfills started (stats, tests)
        self._waiters: list[Callable[[], None]] = []

    @property
    def available(self) -> bool:
        return self.in_use < self.slots_max

    def take(self) -> bool:
        """Take a slot if one is free."""
        if self.in_use >= self.slots_max:
            return False
        self.in_use += 1
        self.taken_total += 1
        return True

    def give_back(self) -> None:
        """Return a slot and wake whoever waits for one."""
        assert self.in_use > 0, self.in_use
        self.in_use -= 1
        for waiter in tuple(self._waiters):
            waiter()

    def add_waiter(self, callback: Callable[[], None]) -> None:
        """Call `callback` (it must not raise) whenever a slot is given back."""
        self._waiters.append(callback)

    def remove_waiter(self, callback: Callable[[], None]) -> None:
        if callback in self._waiters:
            self._waiters.remove(callback)
