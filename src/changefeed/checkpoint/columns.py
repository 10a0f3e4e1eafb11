"""A run of received mutations as columns, and the checkpoint slot that stands for one of
its items until something reads it (issue 29 item 2: a replica's run is queued with no
per-item object; the `Item`s are built when a reader, a lookup or a deduplication first
needs them, all of a checkpoint's at once by one `map`).

Not here: where such runs are queued and read (checkpoint.py, manager.py).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import Final, NamedTuple, Protocol

from changefeed.checkpoint.item import Item
from changefeed.checkpoint.memory import ITEM_OVERHEAD_BYTES, MUTATION_BODY_OVERHEAD_BYTES
from changefeed.storage import Op

_MUTATION: Final = Op.MUTATION


class ColumnRun(Protocol):
    """A run of plain mutations of one vbucket as columns, seqnos rising; each body is the
    item's DCP body (extras | key | value, as `Item.of_body` takes it). The replica role's
    `ReplicatedColumns` is one."""

    @property
    def seqnos(self) -> Sequence[int]: ...
    @property
    def keys(self) -> Sequence[bytes]: ...
    @property
    def bodies(self) -> Sequence[bytes]: ...
    @property
    def cases(self) -> Sequence[int]: ...
    @property
    def flags(self) -> Sequence[int]: ...
    @property
    def expiries(self) -> Sequence[int]: ...
    @property
    def datatypes(self) -> Sequence[int]: ...
    @property
    def rev_seqnos(self) -> Sequence[int]: ...


class Lazy:
    """The slot of an item of a column run not built yet (one shared instance, `LAZY`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LAZY"


LAZY: Final = Lazy()


class LazyRun(NamedTuple):
    """A checkpoint's segment of `LAZY` slots: they stand for `run[start:stop]`, the first
    at index `first` of the checkpoint's items."""

    first: int
    run: ColumnRun
    start: int
    stop: int

    @property
    def end(self) -> int:
        """The index just past the segment's last slot."""
        return self.first + self.stop - self.start


def charged_prefix(run: ColumnRun, start: int, stop: int, bytes_max: int) -> tuple[int, int]:
    """How many of `run[start:stop]` (at least one) a byte-bounded take holds: up to the one
    whose running charge (`item_size_bytes`, from the body lengths) reaches `bytes_max`, as
    `add_run` and `next_run` cut. Returns (that count, their charge).

    Only the items that can be reached are measured: each is charged more than
    ITEM_OVERHEAD_BYTES (its body holds its extras and key)."""
    end = min(stop, start + max(bytes_max, 0) // ITEM_OVERHEAD_BYTES + 1)
    overheads = itertools.repeat(MUTATION_BODY_OVERHEAD_BYTES)
    sizes = map(operator.add, map(len, run.bodies[start:end]), overheads)
    charged = list(itertools.accumulate(sizes))  # rising: every size is positive
    taken = min(len(charged), bisect.bisect_left(charged, bytes_max) + 1)
    return taken, charged[taken - 1]


def items_of(run: ColumnRun, start: int, stop: int) -> list[Item]:
    """The `Item`s of `run[start:stop]`, built by one `map` (each body taken as is)."""
    return list(
        map(Item.of_body, run.seqnos[start:stop], run.keys[start:stop],
            itertools.repeat(_MUTATION), run.bodies[start:stop], run.cases[start:stop],
            run.flags[start:stop], run.expiries[start:stop], run.datatypes[start:stop],
            run.rev_seqnos[start:stop], itertools.repeat(0))
    )  # fmt: skip
