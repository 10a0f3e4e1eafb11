"""SASL payloads (dcp-wire.md §3): PLAIN ``authzid \\0 user \\0 password`` inside SASL_AUTH,
and the LIST_MECHS answer."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import (
    MECHANISMS,
    SCRAMP_NAMES,
    PlainCredentials,
    decode_mechanisms,
    decode_plain,
    encode_plain,
)
from changefeed.protocol.status import Status

from .helpers import SETTINGS, expect_error, feed_three_ways

no_nul = st.text(max_size=30).filter(lambda s: "\0" not in s)


def test_plain_layout() -> None:
    assert encode_plain("user", "pw") == b"\x00user\x00pw"
    assert encode_plain("u", "p", authzid="z") == b"z\x00u\x00p"


@SETTINGS
@given(no_nul.filter(bool), no_nul, no_nul)
def test_plain_round_trip_in_sasl_auth(user: str, password: str, authzid: str) -> None:
    # dcp-wire.md §3: SASL_AUTH carries the mechanism name as key and the payload as value.
    wire = encode_request(
        Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=encode_plain(user, password, authzid)
    )
    expected = (b"PLAIN", PlainCredentials(authzid, user, password))
    feed_three_ways(wire, [expected], decode=lambda f: (f.key, decode_plain(f.value)))


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"user", id="no-nul"),
        pytest.param(b"\x00user", id="one-nul"),
        pytest.param(b"\x00user\x00pw\x00", id="three-nuls"),
        pytest.param(b"\x00\x00pw", id="empty-user"),
        pytest.param(b"\x00\xff\x00pw", id="user-not-utf8"),
        pytest.param(b"\x00u\x00\xc3", id="password-not-utf8"),
    ],
)
def test_plain_hostile_is_auth_error(payload: bytes) -> None:
    expect_error(lambda: decode_plain(payload), Status.AUTH_ERROR)


@pytest.mark.parametrize(
    ("user", "password", "authzid"), [("a\0", "p", ""), ("a", "\0", ""), ("a", "p", "\0")]
)
def test_plain_encoder_refuses_nul(user: str, password: str, authzid: str) -> None:
    with pytest.raises(ValueError):
        encode_plain(user, password, authzid)


def test_mechanisms_round_trip() -> None:
    request = Frame(0x80, Opcode.SASL_LIST_MECHS, opaque=4)
    wire = encode_response(request, value=" ".join(MECHANISMS).encode())
    feed_three_ways(wire, [list(MECHANISMS)], decode=lambda f: decode_mechanisms(f.value))
    assert decode_mechanisms(b"  PLAIN\tSCRAM-SHA512 \n") == ["PLAIN", "SCRAM-SHA512"]
    assert decode_mechanisms(b"") == []
    assert decode_mechanisms(b"\xff PLAIN") == ["\ufffd", "PLAIN"]


def test_scramp_names_cover_scram_mechanisms() -> None:
    scram = [m for m in MECHANISMS if m.startswith("SCRAM")]
    assert sorted(SCRAMP_NAMES) == sorted(scram)
    assert all(v.startswith("SCRAM-SHA-") for v in SCRAMP_NAMES.values())
