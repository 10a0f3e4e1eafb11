"""errors: messages name the setting to change and the place of corruption."""

from __future__ import annotations

from changefeed.storage import CorruptRecordError, StorageError, StorageFullError


def test_storage_full_names_the_setting() -> None:
    error = StorageFullError(1 << 20)
    assert isinstance(error, StorageError)
    assert "map_size_bytes=1048576" in str(error)
    assert "Store(map_size_bytes=...)" in str(error)
    assert error.map_size_bytes == 1 << 20
    assert not error.retriable


def test_corrupt_record_names_vb_and_seqno() -> None:
    error = CorruptRecordError(3, 9, "bad tag")
    assert isinstance(error, StorageError)
    assert str(error) == "corrupt stored data at vb 3 seqno 9: bad tag"
    assert (error.vb, error.seqno, error.reason) == (3, 9, "bad tag")
    assert str(CorruptRecordError(3, None, "x")) == "corrupt stored data at vb 3: x"
