"""Which keys the mirror table may hold: 64-bit hashes of its keys, in memory, so a micro-batch
of new keys is appended instead of merged (``mirror.py``).

A merge must find each source key in the target, which for delta-rs means scanning the target's
files, so its cost grows with the table. Most batches of a change stream create keys; when none
of a batch's keys is in the index, none is in the table, and a plain append does the same as the
merge at a cost that does not depend on the table's size.

Contract (what makes the append path correct):

- Never a false "absent": the index holds the hash of every key of the table at ``version``.
  It is built from the table's key column, and every key a commit may insert is added with the
  version of that commit. A table at any other version (another writer, a restore) means the
  index is rebuilt before use.
- False "present" are allowed and cost only speed (the batch takes the merge path): hash
  collisions, and keys deleted since the index was built (their hashes stay; removing one could
  drop a colliding live key's hash).

Hashes: a polynomial hash of the key's UTF-8 bytes, 8 bytes a term, modulo 2**64, with its
length and a splitmix64 finalizer, computed with numpy over the Arrow buffers (no per-key
Python). Known colliding inputs exist
(Thue-Morse strings); they only send a batch to the merge path. Memory: 8 bytes a key (40 MB for
5M keys); a batch costs O(batch log table) to look up, and adding its new keys one linear
merge of the array (~13 ms at 5M keys).
Not here: what the table looks like or how a batch is written (``mirror.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt
import pyarrow as pa

if TYPE_CHECKING:  # the batch read's workers hash keys too, and need no deltalake import
    from deltalake import DeltaTable

Hashes = npt.NDArray[np.uint64]

_BASE: Final = np.uint64(0x100000001B3)  # the FNV-1 64-bit prime: odd, so it never vanishes
_MIX_1: Final = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64's finalizer constants
_MIX_2: Final = np.uint64(0x94D049BB133111EB)


def key_hashes(keys: pa.Array | pa.ChunkedArray) -> Hashes:
    """One 64-bit hash per key of a ``string`` (or ``binary``) array without nulls.

    Raises:
        ValueError: the array holds nulls or is of another type.
    """
    array = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    if array.type not in (pa.string(), pa.binary()):
        raise ValueError(f"keys must be string or binary, not {array.type}")
    if array.null_count:
        raise ValueError(f"{array.null_count} null keys")
    count = len(array)
    if count == 0:
        return np.empty(0, np.uint64)
    _, offsets_buffer, data_buffer = array.buffers()
    offsets = np.frombuffer(offsets_buffer, np.int32, count + 1, array.offset * 4)
    first, last = int(offsets[0]), int(offsets[-1])
    starts = (offsets[:-1] - first).astype(np.int64)
    lengths = np.diff(offsets).astype(np.int64)
    # The keys' bytes and 8 zero bytes, seen as one little-endian uint64 starting at each byte:
    # a key is hashed 8 bytes a step, all keys at once (steps = longest key / 8).
    padded = np.zeros(last - first + 8, np.uint8)
    if last > first:
        assert data_buffer is not None, (first, last)
        padded[: last - first] = np.frombuffer(data_buffer, np.uint8, last - first, first)
    words = np.ndarray((last - first + 1,), "<u8", padded, 0, (1,))  # unaligned windows
    sums = np.zeros(count, np.uint64)
    for step in range(0, int(lengths.max(initial=0)), 8):  # bounded by the longest key
        active = np.flatnonzero(lengths > step)
        left = lengths[active] - step  # bytes of the key from here on, >= 1
        keep = np.where(
            left >= 8, ~np.uint64(0), (np.uint64(1) << (8 * np.minimum(left, 7)).astype(np.uint64))
            - np.uint64(1),
        )  # fmt: skip
        sums[active] = sums[active] * _BASE + (words[starts[active] + step] & keep)
    hashes: Hashes = sums ^ (lengths.astype(np.uint64) * _MIX_2)
    hashes ^= hashes >> np.uint64(30)
    hashes *= _MIX_1
    hashes ^= hashes >> np.uint64(27)
    hashes *= _MIX_2
    hashes ^= hashes >> np.uint64(31)
    assert hashes.shape == (count,), (hashes.shape, count)
    return hashes


@dataclass
class KeyIndex:
    """Hashes of every key a Delta table held at ``version`` (and maybe of a few more).

    Attributes:
        version: the table version the index describes.
        hashes: sorted, without duplicates.
    """

    version: int
    hashes: Hashes

    @classmethod
    def of_table(cls, table: DeltaTable) -> KeyIndex:
        """Read the ``key`` column of every file of ``table`` (O(table), once per query or after
        a change by someone else)."""
        keys = table.to_pyarrow_dataset().to_table(columns=["key"]).column("key")
        index = cls(table.version(), _sorted_unique(key_hashes(keys)))
        assert len(index.hashes) <= len(keys), (len(index.hashes), len(keys))
        return index

    @classmethod
    def empty(cls, version: int) -> KeyIndex:
        return cls(version, np.empty(0, np.uint64))

    def __len__(self) -> int:
        return len(self.hashes)

    def may_hold(self, hashes: Hashes) -> npt.NDArray[np.bool_]:
        """Per hash: False only if no key of the table has it."""
        found = np.zeros(len(hashes), np.bool_)
        if len(self.hashes) == 0:
            return found
        # Searched in sorted order: random probes into a large array miss the cache (~15x).
        order = np.argsort(hashes)
        wanted = hashes[order]
        at = np.minimum(np.searchsorted(self.hashes, wanted), len(self.hashes) - 1)
        found[order] = self.hashes[at] == wanted
        return found

    def add(self, absent: Hashes, version: int) -> None:
        """Record keys a commit may have inserted; the table is now at ``version``.

        Args:
            absent: hashes ``may_hold`` answered False for at this version (repeats allowed).
            version: the version of the commit.
        """
        assert version >= self.version, (version, self.version)
        new = _sorted_unique(absent)
        count = len(self.hashes)
        merged = np.concatenate([self.hashes, new])
        merged.sort(kind="stable")  # timsort: two sorted runs merge in one linear pass
        self.hashes = merged
        self.version = version
        assert len(self.hashes) == count + len(new), (count, len(new), len(self.hashes))

    def check_invariants(self) -> None:
        """O(n): sorted and without duplicates (the tests call it)."""
        assert self.hashes.dtype == np.uint64, self.hashes.dtype
        assert bool(np.all(self.hashes[1:] > self.hashes[:-1])), "hashes not strictly sorted"


def _sorted_unique(hashes: Hashes) -> Hashes:
    # np.unique of numpy 2.4 hashes first: ~100x slower than this sort for 5M uint64.
    ordered = np.sort(hashes)
    if len(ordered) < 2:
        return ordered
    first: Hashes = ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]
    return first
