"""`qualify_set_run` (server/collection_commands.py) against the per-request path: a run of a
collections connection's SETs gets, key by key, the stored key and expiry `qualify` gives the
same SET alone, or is refused whole when one of its keys would be refused alone. Runs all in
the default collection (the usual SDK run, a fast path) and mixed ones alike, with the keys
that must leave the fast path: a default key starting with 0xff (stored marked), an id with
no key, an unknown or malformed id."""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.collections import encode_leb128
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.errors import ProtocolError, StatusError
from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.set_run import SetRun
from changefeed.server.collection_commands import qualify, qualify_set_run
from changefeed.server.manifest import ManifestStore

NOW = 1_800_000_000.0
MAX_TTL_S = 600


def manifests() -> ManifestStore:
    manifest = Manifest.default().with_scope("s").with_collection("s", "c", max_ttl=MAX_TTL_S)
    return ManifestStore(None, manifest)


wire_keys = st.one_of(
    st.binary(min_size=1, max_size=8).map(lambda k: b"\x00" + k),  # default collection
    st.binary(max_size=6).map(lambda k: b"\x00\xff" + k),  # default, starts with 0xff
    st.just(b"\x00"),  # an id and no key
    st.binary(min_size=1, max_size=8).map(lambda k: encode_leb128(8) + k),  # s.c
    st.binary(min_size=1, max_size=8).map(lambda k: encode_leb128(300) + k),  # unknown
    st.just(b"\x80"),  # a malformed id
)
default_keys = st.binary(min_size=1, max_size=8).map(lambda k: b"\x00" + k)


@settings(deadline=None, max_examples=300)
@given(
    keys=st.one_of(st.lists(default_keys, min_size=1, max_size=12),
                   st.lists(wire_keys, min_size=1, max_size=12)),
    expiry=st.sampled_from([0, 5, 3 * 3600, 2_000_000_000]),
)  # fmt: skip
def test_a_run_is_qualified_as_each_set_alone(keys: list[bytes], expiry: int) -> None:
    store = manifests()
    count = len(keys)
    run = SetRun([0] * count, list(range(count)), list(keys), [b"v"] * count, [0] * count,
                 [expiry] * count, [0] * count, checked=True)  # fmt: skip
    alone: list[tuple[bytes, int]] = []
    refused = False
    for key in keys:
        frame = Frame(Magic.REQUEST, Opcode.SET, extras=struct.pack(">II", 0, expiry), key=key)
        try:
            done = qualify(store, frame, NOW)
        except (ProtocolError, StatusError):
            refused = True
            continue
        alone.append((done.key, struct.unpack(">II", done.extras)[1]))
    if qualify_set_run(run, store, NOW):
        assert not refused
        assert list(zip(run.keys, run.expiries, strict=True)) == alone
    else:
        assert refused
        assert run.keys == keys and run.expiries == [expiry] * count  # untouched
