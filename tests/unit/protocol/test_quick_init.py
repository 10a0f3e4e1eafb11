"""`quick_init` against the dataclass's own generated ``__init__``: same fields, same defaults,
same errors for bad calls, still frozen and hashable; classes it cannot serve are refused."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from changefeed.protocol.dcp_items import Commit, Prepare
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import MutationResult, StoreCommand
from changefeed.protocol.quick_init import quick_init


@dataclasses.dataclass(frozen=True, slots=True)
class _Plain:
    a: int
    b: bytes
    c: int = 7
    d: bytes = b"d"
    e: int | None = None
    f: int = dataclasses.field(default=3, kw_only=True)
    g: bytes = dataclasses.field(kw_only=True)


@quick_init
@dataclasses.dataclass(frozen=True, slots=True)
class _Quick:
    a: int
    b: bytes
    c: int = 7
    d: bytes = b"d"
    e: int | None = None
    f: int = dataclasses.field(default=3, kw_only=True)
    g: bytes = dataclasses.field(kw_only=True)


def _fields(value: Any) -> tuple[Any, ...]:
    return tuple(getattr(value, f.name) for f in dataclasses.fields(value))


# Positional values for a..e (a prefix: the rest take defaults), keywords for f and g.
_calls = st.tuples(
    st.lists(st.one_of(st.integers(), st.binary(max_size=8), st.none()), max_size=6),
    st.dictionaries(st.sampled_from(["c", "d", "e", "f", "g", "h"]), st.integers(), max_size=3),
)


@given(_calls)
def test_quick_init_builds_what_the_generated_init_builds(
    call: tuple[list[Any], dict[str, Any]],
) -> None:
    args, kwargs = call
    try:
        expected: Any = _Plain(*args, **kwargs)
    except TypeError as error:
        with pytest.raises(TypeError):
            _Quick(*args, **kwargs)
        assert str(error)  # both refuse a call missing or repeating a field
        return
    got = _Quick(*args, **kwargs)
    assert _fields(got) == _fields(expected)
    assert repr(got).removeprefix("_Quick") == repr(expected).removeprefix("_Plain")


def test_quick_init_keeps_the_instance_frozen_and_hashable() -> None:
    value = _Quick(1, b"x", g=b"g")
    with pytest.raises(dataclasses.FrozenInstanceError):
        value.a = 2  # type: ignore[misc]
    assert value == _Quick(1, b"x", g=b"g") and hash(value) == hash(_Quick(1, b"x", g=b"g"))
    assert value != _Quick(1, b"y", g=b"g")


@given(
    st.integers(0, 255), st.integers(0, 255), st.integers(0, 0xFFFF), st.binary(max_size=40),
    st.binary(max_size=20), st.binary(max_size=40),
)  # fmt: skip
def test_protocol_values_keep_their_fields(
    magic: int, opcode: int, vb: int, extras: bytes, key: bytes, value: bytes
) -> None:
    frame = Frame(magic, opcode, 1, vb, 9, 10, extras, key, value)
    assert _fields(frame) == (magic, opcode, 1, vb, 9, 10, extras, key, value, b"")
    assert Frame(magic, opcode) == Frame(magic, opcode, 0, 0, 0, 0, b"", b"", b"", b"")
    result = MutationResult(vbucket=vb, seqno=5, cas=6, vb_uuid=7)
    assert _fields(result) == (vb, 5, 6, 7)
    with pytest.raises(TypeError):
        MutationResult(vb, 5, 6, 7)  # type: ignore[misc]  # keyword-only, as generated
    commit = Commit(vb, 1, key, 2, 3)
    assert (commit.vbucket, commit.key, commit.prepared_seqno, commit.commit_seqno) == (
        vb, key, 2, 3,
    )  # fmt: skip
    prepare = Prepare(vb, 1, 2, key, value, 4, 5, 6, 7, False, 1)
    assert prepare == dataclasses.replace(prepare) and prepare.delete_time == 0
    assert _fields(prepare)[5:] == (4, 5, 6, 7, False, 1, 0, 0)
    store = StoreCommand(1, vb, 2, key, value, flags=3)
    assert _fields(store) == (1, vb, 2, key, value, 3, 0, 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        frame.key = b""  # type: ignore[misc]


def test_classes_it_cannot_serve_are_refused() -> None:
    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Hook:
        a: int

        def __post_init__(self) -> None:
            raise AssertionError("skipped by a quick init")

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: dataclasses.InitVar[int]

    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    for cls in (NotFrozen, Factory, Hook, WithInitVar, NoSlots):
        with pytest.raises(TypeError, match=cls.__qualname__):
            quick_init(cls)
