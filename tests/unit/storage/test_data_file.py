"""A store whose data file lost data refuses to open (never SIGBUS, never silently empty);
`start_fresh` sets the damaged files aside. Opens that could crash run in a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from changefeed.storage import Store
from changefeed.storage.data_file import DamagedStoreError, check_data_file

OPEN_SCRIPT = """
import sys
from changefeed.storage import Store
from changefeed.storage.data_file import DamagedStoreError
try:
    with Store(sys.argv[1], durable=False) as store:
        print("opened", store.high_seqno(0))
except DamagedStoreError as error:
    print("refused:", error)
    sys.exit(3)
"""


def make_store(path: Path, items: int = 3000) -> None:
    with Store(path, durable=False) as store, store.write_batch() as batch:
        batch.set_vbucket_meta(0, state="active", failover_log=[(7, 0)])
        for seqno in range(1, items + 1):
            batch.set(0, b"key%06d" % seqno, seqno, b"v" * 200, cas=seqno)


def open_in_child(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", OPEN_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_new_directory_and_a_healthy_store_pass(tmp_path: Path) -> None:
    check_data_file(tmp_path / "new")
    make_store(tmp_path / "s")
    check_data_file(tmp_path / "s")
    with Store(tmp_path / "s", durable=False) as store:
        assert store.high_seqno(0) == 3000


@pytest.mark.parametrize("damage", ["delete", "empty"])
def test_a_missing_or_empty_data_file_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "s"
    make_store(path)
    data = path / "data.mdb"
    if damage == "delete":
        data.unlink()
    else:
        data.write_bytes(b"")
    with pytest.raises(DamagedStoreError) as refused:
        Store(path, durable=False)
    message = str(refused.value)
    assert str(data) in message
    assert ("missing" if damage == "delete" else "empty") in message
    assert "--start-fresh" in message


def test_a_truncated_data_file_is_refused_not_a_sigbus(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make_store(path)
    data = path / "data.mdb"
    size = data.stat().st_size
    assert size > 64 * 1024, size
    os.truncate(data, size // 2)
    result = open_in_child(path)
    assert result.returncode != -signal.SIGBUS, result.stderr[-2000:]
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr[-2000:])
    assert f"truncated: {size // 2} bytes" in result.stdout
    assert f"needs {size}" in result.stdout


def test_start_fresh_sets_the_damaged_files_aside_and_opens_empty(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make_store(path)
    data = path / "data.mdb"
    half = data.stat().st_size // 2
    os.truncate(data, half)
    with Store(path, durable=False, start_fresh=True) as store:
        assert store.set_aside_to is not None
        assert store.vbucket_meta(0) is None  # empty: the old history is not pretended
        aside = store.set_aside_to
    assert (aside / "data.mdb").stat().st_size == half  # kept, not deleted
    with Store(path, durable=False) as reopened:  # the fresh store is healthy from now on
        assert reopened.set_aside_to is None


def test_start_fresh_leaves_a_healthy_store_alone(tmp_path: Path) -> None:
    path = tmp_path / "s"
    make_store(path)
    with Store(path, durable=False, start_fresh=True) as store:
        assert store.set_aside_to is None
        assert store.high_seqno(0) == 3000
