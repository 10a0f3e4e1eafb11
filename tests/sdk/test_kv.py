"""The KV operations of a collection through the official SDK, with Couchbase's semantics: each
result, and each error raised as the SDK's own exception class."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from couchbase.collection import Collection
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.exceptions import (
    CasMismatchException,
    DeltaInvalidException,
    DocumentExistsException,
    DocumentLockedException,
    DocumentNotFoundException,
    DocumentNotLockedException,
)
from couchbase.options import (
    DecrementOptions,
    DeltaValue,
    GetOptions,
    IncrementOptions,
    ReplaceOptions,
    SignedInt64,
    UpsertOptions,
)
from couchbase.transcoder import RawBinaryTranscoder, RawStringTranscoder

from .conftest import SHORT_TIMEOUT

LOCKED_CAS = 0xFFFF_FFFF_FFFF_FFFF
U64_MAX = 2**64 - 1
BINARY = RawBinaryTranscoder()


def test_insert_replace_remove_and_their_errors(collection: Collection, key: str) -> None:
    inserted = collection.insert(key, {"v": 1})
    with pytest.raises(DocumentExistsException):
        collection.insert(key, {"v": 2})
    with pytest.raises(CasMismatchException):
        collection.replace(key, {"v": 2}, ReplaceOptions(cas=inserted.cas + 1))
    replaced = collection.replace(key, {"v": 2}, ReplaceOptions(cas=inserted.cas))
    assert replaced.cas > inserted.cas
    collection.remove(key)
    with pytest.raises(DocumentNotFoundException):
        collection.get(key)
    with pytest.raises(DocumentNotFoundException):
        collection.replace(key, {"v": 3})
    with pytest.raises(DocumentNotFoundException):
        collection.remove(key)


def test_exists_tells_live_missing_and_removed_documents_apart(
    collection: Collection, key: str
) -> None:
    assert not collection.exists(key).exists
    written = collection.upsert(key, "here")
    found = collection.exists(key)
    assert found.exists and found.cas == written.cas
    collection.remove(key)
    assert not collection.exists(key).exists  # a tombstone is not a document


def expiry_of(collection: Collection, key: str) -> datetime | None:
    expiry: datetime | None = collection.get(key, GetOptions(with_expiry=True)).expiry_time
    return expiry


def test_touch_and_get_and_touch_set_the_expiry(collection: Collection, key: str) -> None:
    collection.upsert(key, {"v": 1})
    assert expiry_of(collection, key) is None
    written = collection.get(key).cas
    touched = collection.touch(key, timedelta(seconds=100))
    assert touched.cas != written  # a new version
    expiry = expiry_of(collection, key)
    assert expiry is not None
    assert abs(expiry.timestamp() - (time.time() + 100)) < 5
    got = collection.get_and_touch(key, timedelta(seconds=1000))
    assert got.content_as[dict] == {"v": 1}
    expiry = expiry_of(collection, key)
    assert expiry is not None and abs(expiry.timestamp() - (time.time() + 1000)) < 5
    with pytest.raises(DocumentNotFoundException):
        collection.touch(f"{key}-missing", timedelta(seconds=10))


def test_upsert_preserve_expiry_keeps_the_documents_expiry(
    collection: Collection, key: str
) -> None:
    collection.upsert(key, {"v": 1}, UpsertOptions(expiry=timedelta(seconds=500)))
    before = expiry_of(collection, key)
    collection.upsert(key, {"v": 2}, UpsertOptions(preserve_expiry=True))
    assert expiry_of(collection, key) == before
    collection.upsert(key, {"v": 3})
    assert expiry_of(collection, key) is None


def test_a_locked_document_hides_its_cas_and_takes_writes_with_the_lock_cas_only(
    collection: Collection, key: str
) -> None:
    collection.upsert(key, {"v": 1})
    locked = collection.get_and_lock(key, timedelta(seconds=10))
    assert locked.content_as[dict] == {"v": 1}
    assert collection.get(key).cas == LOCKED_CAS  # others see the lock's marker
    # The SDK retries LOCKED until the operation's timeout, then raises DocumentLocked.
    with pytest.raises(DocumentLockedException):
        collection.upsert(key, {"v": 2}, UpsertOptions(timeout=SHORT_TIMEOUT))
    with pytest.raises(DocumentLockedException):
        collection.get_and_lock(key, timedelta(seconds=10), timeout=SHORT_TIMEOUT)
    with pytest.raises(CasMismatchException):  # UNLOCK with another CAS: LOCKED, read so
        collection.unlock(key, locked.cas + 1)
    replaced = collection.replace(key, {"v": 3}, ReplaceOptions(cas=locked.cas))
    assert collection.get(key).cas == replaced.cas  # the write unlocked it
    with pytest.raises(DocumentNotLockedException):
        collection.unlock(key, replaced.cas)


def test_unlock_frees_the_document_and_a_lock_times_out(collection: Collection, key: str) -> None:
    collection.upsert(key, {"v": 1})
    locked = collection.get_and_lock(key, timedelta(seconds=30))
    collection.unlock(key, locked.cas)
    assert collection.get(key).cas == locked.cas  # it keeps the lock's CAS, as Couchbase
    collection.upsert(key, {"v": 2})
    collection.get_and_lock(key, timedelta(seconds=1))
    time.sleep(1.2)
    collection.upsert(key, {"v": 3})  # the lock timed out
    assert collection.get(key).content_as[dict] == {"v": 3}


def test_counters_create_wrap_and_stop_at_zero(collection: Collection, key: str) -> None:
    binary = collection.binary()
    options = IncrementOptions(initial=SignedInt64(10), delta=DeltaValue(5))
    assert binary.increment(key, options).content == 10  # created with the initial value
    assert binary.increment(key, options).content == 15
    assert binary.decrement(key, DecrementOptions(delta=DeltaValue(100))).content == 0
    assert collection.get(key).content_as[int] == 0
    with pytest.raises(DocumentNotFoundException):  # a negative initial: do not create
        binary.increment(f"{key}-missing", IncrementOptions(initial=SignedInt64(-1)))
    wrap = f"{key}-wrap"
    collection.upsert(wrap, str(U64_MAX), UpsertOptions(transcoder=RawStringTranscoder()))
    assert binary.increment(wrap, IncrementOptions(delta=DeltaValue(2))).content == 1
    collection.upsert(f"{key}-json", {"not": "a number"})
    with pytest.raises(DeltaInvalidException):
        binary.increment(f"{key}-json")


def test_append_and_prepend_need_the_document(collection: Collection, key: str) -> None:
    binary = collection.binary()
    collection.upsert(key, b"middle", UpsertOptions(transcoder=BINARY))
    binary.append(key, b">")
    binary.prepend(key, b"<")
    assert collection.get(key, GetOptions(transcoder=BINARY)).value == b"<middle>"
    with pytest.raises(DocumentNotFoundException):
        binary.append(f"{key}-missing", b"x")


MAJORITY = ServerDurability(DurabilityLevel.MAJORITY)


@pytest.mark.parametrize(
    ("write", "after"),
    [
        (lambda c, k: c.upsert(k, {"v": 2}, UpsertOptions(durability=MAJORITY)), {"v": 2}),
        (lambda c, k: c.replace(k, {"v": 2}, ReplaceOptions(durability=MAJORITY)), {"v": 2}),
        (lambda c, k: c.remove(k, durability=MAJORITY), None),
    ],
    ids=["upsert", "replace", "remove"],
)
def test_durable_writes_on_one_node_are_honoured(
    collection: Collection,
    key: str,
    write: Callable[[Collection, str], object],
    after: dict[str, int] | None,
) -> None:
    """Alone, a node is its vbuckets' whole chain: a majority is the node, and the write is
    acknowledged once it has persisted it (docs/sdk.md)."""
    written = collection.upsert(key, {"v": 1})
    result = write(collection, key)
    assert result.cas != written.cas  # type: ignore[attr-defined]
    if after is None:
        assert not collection.exists(key).exists
    else:
        current = collection.get(key)
        assert current.cas == result.cas and current.content_as[dict] == after  # type: ignore[attr-defined]


def test_durable_read_modify_writes_on_one_node_are_honoured(
    collection: Collection, key: str
) -> None:
    collection.upsert(key, "ab", UpsertOptions(transcoder=RawStringTranscoder()))
    appended = collection.binary().append(key, b"c", durability=MAJORITY)
    assert collection.get(key, transcoder=RawStringTranscoder()).cas == appended.cas
    assert collection.get(key, transcoder=RawStringTranscoder()).value == "abc"
    counted = collection.binary().increment(f"{key}-counter", durability=MAJORITY)
    assert counted.content == 0  # created with the initial value
    counted = collection.binary().increment(f"{key}-counter", durability=MAJORITY)
    assert counted.content == 1
