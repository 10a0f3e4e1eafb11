"""WriteBatch: checks before it changes anything, works on copies, applies in one go."""

from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.storage import Op, Record, Store
from changefeed.storage.batch import WriteBatch
from changefeed.storage.vbmeta import VbState


def committed() -> dict[int, VbState]:
    return {0: VbState("active", ((7, 0),), high_seqno=10, snap_start=5, snap_end=10)}


def test_refused_calls_leave_the_batch_as_it_was() -> None:
    rows = committed()
    batch = WriteBatch(rows)
    batch.set(0, b"a", 11, b"v" * 10, cas=1)
    state = (dict(batch._records), dict(batch._keys), batch._bytes, batch._rows[0].high_seqno)
    for call in (
        lambda: batch.set(0, b"b", 11, b"v", cas=1),
        lambda: batch.set(0, b"b", 12, b"v", cas=-1),
        lambda: batch.set(0, b"b", 12, b"v", cas=1, expiry=2**32),
        lambda: batch.delete(0, b"b", 12, cas=1, rev_seqno=-1),
        lambda: batch.set(1, b"b", 1, b"v", cas=1),
        lambda: batch.put_record(Record.create(0, 11, b"b", Op.MUTATION, cas=1)),
    ):
        with pytest.raises(ValueError):
            call()
        assert (dict(batch._records), dict(batch._keys), batch._bytes) == state[:3]
        assert batch._rows[0].high_seqno == state[3]


def test_committed_rows_are_never_modified() -> None:
    rows = committed()
    batch = WriteBatch(rows)
    batch.set(0, b"a", 11, b"v", cas=1)
    batch.set_vbucket_meta(0, state="replica", failover_log=[(8, 11)], snap_start=11, snap_end=11)
    batch.set_vbucket_meta(3, state="pending")
    assert rows == committed()
    assert batch._rows[0] == VbState("replica", ((8, 11),), 11, 0, 11, 11, 0)
    assert batch._rows[3] == VbState("pending")


def test_partial_metadata_changes_keep_the_rest() -> None:
    batch = WriteBatch(committed())
    batch.set_vbucket_meta(0, snap_end=20)
    assert batch._rows[0] == VbState("active", ((7, 0),), 10, 0, 5, 20, 0)
    batch.set_vbucket_meta(0, failover_log=[])
    assert batch._rows[0].failover_log == ()


def test_rewriting_a_key_keeps_only_its_newest_version() -> None:
    batch = WriteBatch(committed())
    batch.set(0, b"a", 11, b"x" * 100, cas=1)
    first = batch._bytes
    batch.delete(0, b"a", 12, cas=1)
    batch.set(0, b"b", 13, b"y", cas=1)
    assert len(batch._records) == 2
    assert batch._bytes < first + 60  # the 100-byte version's bytes were released


def test_an_ended_batch_refuses_everything(tmp_path: Path) -> None:
    with Store(tmp_path / "s", durable=False) as store:
        with store.write_batch() as batch:
            batch.set_vbucket_meta(0, state="active")
        for call in (
            lambda: batch.set(0, b"a", 1, b"v", cas=1),
            lambda: batch.delete(0, b"a", 1, cas=1),
            lambda: batch.put_record(Record.create(0, 1, b"a", Op.MUTATION, cas=1)),
            lambda: batch.set_vbucket_meta(0, state="dead"),
            lambda: batch.apply(None, None, None, None),  # type: ignore[arg-type]
        ):
            with pytest.raises(RuntimeError, match="ended"):
                call()
