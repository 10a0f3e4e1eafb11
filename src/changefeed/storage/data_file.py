"""Checks on an LMDB data file before the store maps it, and setting a damaged one aside.

LMDB maps `data.mdb` into memory and trusts its size: a file truncated below what its meta page
records makes the first read past the end kill the process with SIGBUS, and a deleted or emptied
file silently becomes a new, empty store. Both lose acknowledged data without a word. So before
opening, the store reads the two meta pages itself (layout below, LMDB's `MDB_meta` on a 64-bit
little-endian build) and refuses a file that is missing, empty or shorter than the newest meta
page says, unless the operator asked to start fresh; then the damaged files are moved aside,
never deleted.

    page header (16 bytes) | mm_magic u32 @16 | mm_version u32 @20 | mm_address u64 @24
    | mm_mapsize u64 @32 | mm_dbs[0] (free db, 48 bytes; md_pad u32 @40 = page size)
    | mm_dbs[1] (main db, 48 bytes) | mm_last_pg u64 @136 | mm_txnid u64 @144

Meta page 0 sits at offset 0 and meta page 1 at offset page size; the one with the higher
txnid is current. Its data needs (mm_last_pg + 1) * page size bytes.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path
from typing import Final

from changefeed.storage.errors import StorageError

DATA_FILE: Final = "data.mdb"
LOCK_FILE: Final = "lock.mdb"
STORE_MARKER_FILE: Final = "store-created"  # written once, when the store is first created

_LMDB_MAGIC: Final = 0xBEEFC0DE
_MAGIC_VERSION = struct.Struct("<II")
_PAGE_SIZE = struct.Struct("<I")
_LAST_PAGE_TXNID = struct.Struct("<QQ")
_MAGIC_OFFSET: Final = 16
_PAGE_SIZE_OFFSET: Final = 40
_LAST_PAGE_OFFSET: Final = 136
_META_BYTES: Final = _LAST_PAGE_OFFSET + _LAST_PAGE_TXNID.size
_PAGE_SIZES: Final = (4096, 8192, 16384, 32768, 65536)  # what LMDB may have been built with


class DamagedStoreError(StorageError):
    """The data file is missing, empty, truncated or not LMDB while the store held data.

    The message names the file and the choice: restore it from a backup, or start fresh (which
    moves the damaged files aside and starts an empty store with new vbucket histories).
    """


def check_data_file(path: Path) -> None:
    """Refuse to open a store whose data file lost data; a new directory passes.

    Raises:
        DamagedStoreError: see the class.
    """
    data = path / DATA_FILE
    existed = (path / STORE_MARKER_FILE).exists() or (path / LOCK_FILE).exists()
    if not data.exists():
        if existed:
            raise _damaged(path, f"{data} is missing")
        return
    size = data.stat().st_size
    if size == 0:
        if existed:
            raise _damaged(path, f"{data} is empty")
        return
    required = _required_size(data, size)
    if size < required:
        raise _damaged(path, f"{data} is truncated: {size} bytes, its meta page needs {required}")


def mark_created(path: Path) -> None:
    """Record that a store was created here, so a later missing data file is noticed."""
    marker = path / STORE_MARKER_FILE
    if not marker.exists():
        marker.write_text(f"created {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")


def set_aside(path: Path) -> Path:
    """Move the store's files into a sibling directory and return it (start fresh)."""
    target = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
    target.mkdir()
    for name in (DATA_FILE, LOCK_FILE, STORE_MARKER_FILE, "clean-shutdown"):
        if (path / name).exists():
            os.replace(path / name, target / name)
    return target


def _required_size(data: Path, size: int) -> int:
    """Bytes the newest meta page says the file holds."""
    with open(data, "rb") as handle:
        first = handle.read(_META_BYTES)
        if len(first) < _META_BYTES or _magic(first) != _LMDB_MAGIC:
            raise _damaged(data.parent, f"{data} is not an LMDB data file")
        page_size = int(_PAGE_SIZE.unpack_from(first, _PAGE_SIZE_OFFSET)[0])
        if page_size not in _PAGE_SIZES:
            raise _damaged(data.parent, f"{data} records page size {page_size}")
        metas = [_LAST_PAGE_TXNID.unpack_from(first, _LAST_PAGE_OFFSET)]
        if size >= page_size + _META_BYTES:
            handle.seek(page_size)
            second = handle.read(_META_BYTES)
            if _magic(second) == _LMDB_MAGIC:
                metas.append(_LAST_PAGE_TXNID.unpack_from(second, _LAST_PAGE_OFFSET))
    last_page, _ = max(metas, key=lambda meta: meta[1])
    required = (int(last_page) + 1) * page_size
    assert required >= page_size, (last_page, page_size)
    return max(required, 2 * page_size)  # the two meta pages exist in any LMDB file


def _magic(page: bytes) -> int:
    magic: int = _MAGIC_VERSION.unpack_from(page, _MAGIC_OFFSET)[0]
    return magic


def _damaged(path: Path, what: str) -> DamagedStoreError:
    return DamagedStoreError(
        f"{what}, but {path} held a store: restore the file from a backup, or start with "
        "--start-fresh to set the damaged files aside and begin an empty store "
        "(consumers then roll back to 0)"
    )
