"""``ProtocolError`` (the peer's fault, with the status to answer) and the ``StatusError``
registry (a response status turned into an exception whose class carries retry policy)."""

from __future__ import annotations

import pytest

from changefeed.protocol import errors
from changefeed.protocol.errors import (
    BusyError,
    NotMyVbucketError,
    ProtocolError,
    RollbackRequiredError,
    StatusError,
    error_for_status,
)
from changefeed.protocol.status import Status


def _all_subclasses() -> list[type[StatusError]]:
    out = []
    pending = list(StatusError.__subclasses__())
    while pending:  # bounded: the class tree is finite
        cls = pending.pop()
        out.append(cls)
        pending.extend(cls.__subclasses__())
    return out


def test_protocol_error_defaults_to_einval_and_keeps_status() -> None:
    assert ProtocolError("x").status == Status.EINVAL
    error = ProtocolError("too big", Status.E2BIG)
    assert error.status == Status.E2BIG
    assert str(error) == "too big"
    assert not isinstance(error, StatusError)
    assert not isinstance(error, ValueError)  # our own misuse is ValueError, never this


def _wire_classes() -> list[type[StatusError]]:
    """The classes a client decodes a status into: those declared in protocol/errors.py.

    Layers above may refine one (CheckpointMemoryFullError is a TemporaryFailureError); a
    refinement keeps its parent's status and a client decodes the parent.
    """
    return [cls for cls in _all_subclasses() if cls.__module__ == "changefeed.protocol.errors"]


def test_refinements_in_other_layers_keep_their_parents_status() -> None:
    import changefeed.checkpoint  # noqa: F401 - defines a refinement

    refinements = [cls for cls in _all_subclasses() if cls not in _wire_classes()]
    assert refinements, "expected at least CheckpointMemoryFullError"
    for cls in refinements:
        parent = next(base for base in cls.__mro__[1:] if base in _wire_classes())
        assert cls.status == parent.status, (cls, parent)
        assert cls.retriable == parent.retriable, (cls, parent)
        assert type(error_for_status(cls.status)) is parent


@pytest.mark.parametrize("cls", _wire_classes(), ids=lambda c: c.__name__)
def test_registry_maps_every_subclass(cls: type[StatusError]) -> None:
    error = error_for_status(cls.status, "context")
    assert type(error) is cls
    assert error.code == cls.status
    assert str(error) == f"{cls.status.name}: context"


def test_registry_statuses_are_unique() -> None:
    statuses = [cls.status for cls in _wire_classes()]
    assert len(statuses) == len(set(statuses))
    assert len(statuses) >= 18


def test_unknown_status_falls_back_to_base_class() -> None:
    error = error_for_status(0xFF01)
    assert type(error) is StatusError
    assert error.code == 0xFF01
    assert str(error) == "0xff01"
    known_but_unmapped = error_for_status(Status.OPAQUE_NO_MATCH, "busy key")
    assert type(known_but_unmapped) is StatusError
    assert str(known_but_unmapped) == "OPAQUE_NO_MATCH: busy key"


def test_success_is_not_an_error() -> None:
    with pytest.raises(AssertionError):
        error_for_status(Status.SUCCESS)


def test_retriable_policy() -> None:
    retriable = {cls.__name__ for cls in _wire_classes() if cls.retriable}
    assert retriable == {
        "NotMyVbucketError",
        "OutOfMemoryError",
        "BusyError",
        "TemporaryFailureError",
        "SyncWriteAmbiguousError",
        "SyncWriteInProgressError",  # the pending durable write ends within its timeout
        "LockedError",  # the lock times out
        "ManifestIsAheadError",  # the node applies the manifest it has not yet
    }
    assert NotMyVbucketError.retriable
    assert not RollbackRequiredError.retriable
    assert BusyError().code == Status.EBUSY


def test_status_error_direct_construction() -> None:
    assert str(errors.KeyNotFoundError()) == "KEY_ENOENT"
    assert errors.KeyNotFoundError("k").code == Status.KEY_ENOENT
    assert errors.InvalidArgumentsError(status=0x9999).code == 0x9999
    assert isinstance(error_for_status(Status.ROLLBACK), RollbackRequiredError)


def test_status_names() -> None:
    assert Status.name_of(0x23) == "ROLLBACK"
    assert Status.name_of(0x8D) == "DCP_STREAM_ID_INVALID"
    assert Status.name_of(0x1234) == "0x1234"
    # dcp-wire.md §1.5 values DCP depends on.
    assert (Status.E2BIG, Status.EINVAL, Status.ROLLBACK, Status.DCP_STREAM_ID_INVALID) == (
        0x03,
        0x04,
        0x23,
        0x8D,
    )
