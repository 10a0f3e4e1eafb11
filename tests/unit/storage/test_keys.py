"""keys: index layouts sort in scan order; malformed by_key values are corrupt."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.storage import CorruptRecordError
from changefeed.storage.keys import BY_KEY_VALUE, by_key_key, decode_by_key_value, seqno_key

vbs = st.integers(0, 1023)
seqnos = st.integers(0, 2**64 - 1)


@given(st.tuples(vbs, seqnos), st.tuples(vbs, seqnos))
def test_seqno_keys_sort_like_vb_then_seqno(a: tuple[int, int], b: tuple[int, int]) -> None:
    assert (seqno_key(*a) < seqno_key(*b)) == (a < b)


@given(vbs, st.binary(min_size=1, max_size=255))
def test_by_key_keys_group_by_vb(vb: int, key: bytes) -> None:
    encoded = by_key_key(vb, key)
    assert encoded[2:] == key
    assert by_key_key(vb, b"") < encoded < by_key_key(vb + 1, b"")


def test_by_key_value() -> None:
    assert decode_by_key_value(1, BY_KEY_VALUE.pack(7, 2)) == (7, 2)
    with pytest.raises(CorruptRecordError, match="8 bytes") as caught:
        decode_by_key_value(1, b"\x00" * 8)
    assert (caught.value.vb, caught.value.seqno) == (1, None)
