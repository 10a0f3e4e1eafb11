"""Item locks, TOUCH and GET_META on a bucket whose clock the test moves (kv_engine's rules:
a locked document shows CAS 0xffff...ff to readers, takes writes with the lock's CAS only, and
keeps the lock's CAS once unlocked or timed out, until rewritten)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed import limits
from changefeed.protocol.errors import (
    KeyExistsError,
    KeyNotFoundError,
    LockedError,
    NotLockedError,
    TemporaryFailureError,
)
from changefeed.protocol.kv import StoreCommand
from changefeed.protocol.kv_ops import LOCKED_CAS
from changefeed.protocol.opcode import Opcode
from changefeed.server.bucket import Bucket
from support.buckets import ManualClock, open_bucket

VB = 1


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def bucket(tmp_path: Path, clock: ManualClock) -> Iterator[Bucket]:
    with open_bucket(tmp_path, clock, vbuckets=4) as opened:
        yield opened


def put(bucket: Bucket, key: bytes, value: bytes = b"v", *, cas: int = 0, expiry: int = 0) -> int:
    command = StoreCommand(Opcode.SET, VB, 0, key, value, expiry=expiry, cas=cas)
    return bucket.store_command(command).cas


def test_a_lock_hides_the_cas_and_needs_its_cas_to_write(bucket: Bucket) -> None:
    stored = put(bucket, b"k")
    locked = bucket.get_locked(VB, b"k", 10)
    assert locked.cas > stored and locked.value == b"v"
    assert bucket.get(VB, b"k").cas == LOCKED_CAS
    with pytest.raises(LockedError):
        put(bucket, b"k")
    with pytest.raises(LockedError):
        put(bucket, b"k", cas=stored)
    with pytest.raises(LockedError):
        bucket.delete(VB, b"k")
    with pytest.raises(LockedError):
        bucket.touch(VB, b"k", 60)
    with pytest.raises(LockedError):
        bucket.get_locked(VB, b"k", 10)
    with pytest.raises(KeyExistsError):  # ADD of an existing document, locked or not
        bucket.store_command(StoreCommand(Opcode.ADD, VB, 0, b"k", b"x"))
    high = bucket.vbucket(VB).high_seqno
    written = put(bucket, b"k", b"w", cas=locked.cas)  # the holder writes, and unlocks
    assert bucket.vbucket(VB).high_seqno == high + 1  # the lock itself was no change
    assert bucket.get(VB, b"k").cas == written
    put(bucket, b"k", b"x")  # anyone may write now


def test_unlock_rules(bucket: Bucket) -> None:
    put(bucket, b"k")
    with pytest.raises(NotLockedError):
        bucket.unlock(VB, b"k", 1)
    locked = bucket.get_locked(VB, b"k", 10)
    with pytest.raises(LockedError):
        bucket.unlock(VB, b"k", locked.cas + 1)
    bucket.unlock(VB, b"k", locked.cas)
    with pytest.raises(NotLockedError):
        bucket.unlock(VB, b"k", locked.cas)
    # Unlocked, the document shows the lock's CAS, and a CAS write with it succeeds.
    assert bucket.get(VB, b"k").cas == locked.cas
    with pytest.raises(KeyExistsError):
        put(bucket, b"k", cas=locked.cas + 1)
    put(bucket, b"k", cas=locked.cas)
    with pytest.raises(KeyNotFoundError):
        bucket.unlock(VB, b"missing", 5)
    with pytest.raises(KeyNotFoundError):
        bucket.get_locked(VB, b"missing", 5)


def test_a_lock_times_out_on_the_buckets_clock(bucket: Bucket, clock: ManualClock) -> None:
    put(bucket, b"k")
    locked = bucket.get_locked(VB, b"k", 5)
    clock.now += 4.9
    with pytest.raises(LockedError):
        put(bucket, b"k")
    clock.now += 0.2
    assert bucket.get(VB, b"k").cas == locked.cas  # timed out: the lock's CAS shows
    with pytest.raises(NotLockedError):
        bucket.unlock(VB, b"k", locked.cas)
    bucket.get_locked(VB, b"k", 5)  # and it can be locked again


@pytest.mark.parametrize(
    ("asked", "held"),
    [
        (0, limits.ITEM_LOCK_DEFAULT_S),
        (7, 7),
        (limits.ITEM_LOCK_MAX_S + 1, limits.ITEM_LOCK_DEFAULT_S),
    ],
)
def test_lock_times_default_and_cap(
    bucket: Bucket, clock: ManualClock, asked: int, held: int
) -> None:
    put(bucket, b"k")
    bucket.get_locked(VB, b"k", asked)
    clock.now += held - 0.01
    with pytest.raises(LockedError):
        put(bucket, b"k")
    clock.now += 0.02
    put(bucket, b"k")


def test_the_lock_table_is_bounded(
    bucket: Bucket, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(limits, "ITEM_LOCKS_PER_VBUCKET_MAX", 2)
    for key in (b"a", b"b", b"c"):
        put(bucket, key)
    first = bucket.get_locked(VB, b"a", 5)
    bucket.get_locked(VB, b"b", 5)
    with pytest.raises(TemporaryFailureError):
        bucket.get_locked(VB, b"c", 5)
    bucket.unlock(VB, b"a", first.cas)
    bucket.get_locked(VB, b"c", 5)  # the unlocked entry was forgotten to make room
    assert bucket.get(VB, b"a").cas != first.cas  # its CAS reverted to the stored one


def test_touch_writes_a_new_version_with_the_new_expiry(bucket: Bucket, clock: ManualClock) -> None:
    stored = put(bucket, b"k", b"value")
    high = bucket.vbucket(VB).high_seqno
    touched = bucket.touch(VB, b"k", 100)
    assert touched.seqno == high + 1 and touched.cas > stored
    document = bucket.get(VB, b"k")
    assert document.value == b"value" and document.expiry == int(clock.now) + 100
    bucket.touch(VB, b"k", 0)
    assert bucket.get(VB, b"k").expiry == 0
    with pytest.raises(KeyExistsError):
        bucket.touch(VB, b"k", 5, cas=stored)
    bucket.touch(VB, b"k", 5)
    clock.now += 6
    with pytest.raises(KeyNotFoundError):
        bucket.touch(VB, b"k", 5)


def test_get_meta_of_live_expired_and_deleted_documents(bucket: Bucket, clock: ManualClock) -> None:
    stored = put(bucket, b"k", b"{}", expiry=50)
    meta = bucket.get_meta(VB, b"k")
    assert not meta.deleted and meta.cas == stored and meta.expiry == int(clock.now) + 50
    assert meta.rev_seqno == 1
    clock.now += 51
    expired = bucket.get_meta(VB, b"k")  # the access queues the expiration
    assert expired.deleted and expired.rev_seqno == 2
    put(bucket, b"k")
    deleted = bucket.delete(VB, b"k")
    meta = bucket.get_meta(VB, b"k")
    assert meta.deleted and meta.cas == deleted.cas and meta.expiry == int(clock.now)
    with pytest.raises(KeyNotFoundError):
        bucket.get_meta(VB, b"never")
