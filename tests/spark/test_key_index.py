"""``key_index``: key hashes computed over Arrow buffers, and the index the mirror writer uses to
append a batch of new keys instead of merging it.

The one property the writer's correctness rests on: the index never answers "absent" for a key
the table holds (false "present" only cost speed).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from changefeed.spark.key_index import KeyIndex, key_hashes


def random_keys(rng: random.Random, count: int) -> list[str]:
    """Keys of 1..40 characters, some non-ASCII (multi-byte UTF-8), some sharing prefixes."""
    alphabet = "abcxyz0129-_:é€😀"
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(count)]


def test_equal_keys_hash_equal_and_distinct_keys_do_not_collide(rng: random.Random) -> None:
    keys = random_keys(rng, 20_000)
    hashes = key_hashes(pa.array(keys, pa.string()))
    by_key: dict[str, int] = {}
    for key, value in zip(keys, hashes.tolist(), strict=True):
        assert by_key.setdefault(key, value) == value, key
    assert len(set(by_key.values())) == len(by_key), "a collision among random keys"


def test_every_byte_and_the_length_count() -> None:
    keys = ["", "a", "b", "ab", "ba", "a\x00", "\x00a", "abcdefgh", "abcdefgh\x00", "abcdefghi"]
    keys += ["x" * n for n in range(1, 30)]  # lengths around the 8-byte steps
    hashes = key_hashes(pa.array(keys, pa.string())).tolist()
    assert len(set(hashes)) == len(keys), list(zip(keys, hashes, strict=True))


def test_slices_chunks_and_binary_hash_like_the_whole(rng: random.Random) -> None:
    keys = random_keys(rng, 1000)
    whole = key_hashes(pa.array(keys, pa.string()))
    sliced = pa.array(keys, pa.string()).slice(17, 500)
    assert (key_hashes(sliced) == whole[17:517]).all()
    chunked = pa.chunked_array([pa.array(keys[:300], pa.string()), pa.array(keys[300:])])
    assert (key_hashes(chunked) == whole).all()
    binary = pa.array([k.encode() for k in keys], pa.binary())
    assert (key_hashes(binary) == whole).all()
    assert len(key_hashes(pa.array([], pa.string()))) == 0


def test_nulls_and_other_types_are_refused() -> None:
    with pytest.raises(ValueError, match="null"):
        key_hashes(pa.array(["a", None], pa.string()))
    with pytest.raises(ValueError, match="string or binary"):
        key_hashes(pa.array([1, 2], pa.int64()))


def test_an_index_never_misses_a_key_it_was_given(rng: random.Random) -> None:
    index = KeyIndex.empty(0)
    held: set[str] = set()
    for version in range(1, 30):  # batches of new and repeated keys, like a mirror's commits
        batch = random_keys(rng, rng.randint(0, 400)) + rng.sample(sorted(held), min(50, len(held)))
        batch = list(dict.fromkeys(batch))  # a merge source holds a key once
        hashes = key_hashes(pa.array(batch, pa.string()))
        found = index.may_hold(hashes)
        assert all(found[i] for i, key in enumerate(batch) if key in held), "a held key missed"
        index.add(hashes[~found], version)
        index.check_invariants()
        held.update(batch)
        assert index.version == version
    everything = key_hashes(pa.array(sorted(held), pa.string()))
    assert index.may_hold(everything).all()
    assert len(index) == len(held)  # no collisions among these, so one hash per key
    strangers = key_hashes(pa.array([f"stranger-{i}" for i in range(1000)], pa.string()))
    assert not index.may_hold(strangers).any()


def test_an_index_of_a_table_holds_its_keys(tmp_path: Path, rng: random.Random) -> None:
    keys = sorted(set(random_keys(rng, 3000)))
    vbuckets = np.array([rng.randrange(4) for _ in keys], np.int32)
    rows = pa.table({"key": pa.array(keys, pa.string()), "vbucket": pa.array(vbuckets)})
    write_deltalake(str(tmp_path), rows.slice(0, 1000), partition_by=["vbucket"])
    write_deltalake(str(tmp_path), rows.slice(1000), mode="append")
    table = DeltaTable(str(tmp_path))
    index = KeyIndex.of_table(table)
    index.check_invariants()
    assert index.version == table.version() == 1
    assert index.may_hold(key_hashes(rows.column("key"))).all()
    assert len(index) == len(keys)
