"""Clean runs a write batch holds as columns until it applies (batch.py's whole-run path).

Contract: a `StagedRun` is the stored form of one clean run (`WriteBatch._put_clean_columns`:
every check passed, its by_key keys distinct and new to the batch), kept as the lists it was
encoded into — `by_seqno` keys and stored records, `by_key` keys and values — so that `apply`
writes them to LMDB straight from those lists. Filling two dicts instead cost ~0.11 us per
version (two hashed inserts each) for a lookup that almost never happens: a later write of
one of the run's keys in the same batch. `StagedRuns` indexes the runs by vbucket with each
run's key set (built anyway, by the run's duplicate check) so that such a write finds the run
(`take_holding`), and the batch moves that run into its dicts before the write replaces the
key there. A by_key key is held once in the whole batch: in its dicts or in one run.

Not here: the checks and the encoding (batch.py), LMDB access.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import NamedTuple


class StagedRun(NamedTuple):
    """One clean run's stored form (columns of equal length, in seqno-key order)."""

    vbs: tuple[int, ...]  # the vbuckets the run covers, rising
    seqno_keys: list[bytes]
    stored: list[bytes]
    by_keys: list[bytes]
    by_key_values: list[bytes]
    key_set: set[bytes]  # by_keys, for a later write's duplicate check


class StagedRuns:
    """The runs of one batch, in the order staged, indexed by vbucket."""

    __slots__ = ("_of", "_runs", "_versions")

    def __init__(self) -> None:
        self._runs: list[StagedRun] = []
        self._of: dict[int, list[StagedRun]] = {}  # vb -> the runs that cover it
        self._versions = 0

    def __len__(self) -> int:
        """Versions held in all runs."""
        return self._versions

    def add(self, run: StagedRun) -> None:
        """Hold `run`, whose keys the caller found in no run of its vbuckets (`overlaps`)."""
        count = len(run.seqno_keys)
        assert len(run.stored) == len(run.by_keys) == len(run.by_key_values) == count, run.vbs
        assert len(run.key_set) == count, (run.vbs, len(run.key_set), count)
        self._runs.append(run)
        for vb in run.vbs:  # bounded by the run's vbuckets
            self._of.setdefault(vb, []).append(run)
        self._versions += count

    def overlaps(self, vbs: Iterable[int], key_set: set[bytes]) -> bool:
        """Whether a run of one of `vbs` holds one of `key_set` (by_key keys)."""
        of = self._of
        return any(not run.key_set.isdisjoint(key_set) for vb in vbs if vb in of for run in of[vb])

    def take_holding(self, vb: int, by_key_key: bytes) -> StagedRun | None:
        """Remove and return the run holding `by_key_key` of `vb`, if one does."""
        runs = self._of.get(vb)
        if not runs:
            return None
        for run in runs:  # bounded by the vbucket's runs in the batch
            if by_key_key in run.key_set:
                self._remove(run)
                return run
        return None

    def _remove(self, run: StagedRun) -> None:
        self._runs = [held for held in self._runs if held is not run]
        for vb in run.vbs:  # bounded by the run's vbuckets
            left = [held for held in self._of[vb] if held is not run]
            if left:
                self._of[vb] = left
            else:
                del self._of[vb]
        self._versions -= len(run.seqno_keys)

    def by_keys(self) -> Iterator[bytes]:
        """Every run's by_key keys."""
        return itertools.chain.from_iterable(run.by_keys for run in self._runs)

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        """(by_seqno key, stored record) of every run's versions."""
        return itertools.chain.from_iterable(
            zip(run.seqno_keys, run.stored, strict=True) for run in self._runs
        )

    def entries(self) -> Iterator[tuple[bytes, bytes]]:
        """(by_key key, by_key value) of every run's versions."""
        return itertools.chain.from_iterable(
            zip(run.by_keys, run.by_key_values, strict=True) for run in self._runs
        )

    def clear(self) -> None:
        """Hold nothing (the batch ended)."""
        self._runs.clear()
        self._of.clear()
        self._versions = 0
