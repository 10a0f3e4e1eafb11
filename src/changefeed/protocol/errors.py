"""Errors for bytes a peer sent us, and for error statuses a server answered.

``ProtocolError`` is only ever about the *peer's* bytes and carries the status to answer with
(STYLE.md §1). Misuse of our own encoders is a bug and raises ``ValueError`` instead, so a server
never blames a peer for it.

``StatusError`` subclasses turn a response status into an exception whose class attributes carry
policy (``retriable``), looked up through a registry built from the subclasses (aiokafka habit).
"""

from __future__ import annotations

from typing import ClassVar

from changefeed.protocol.status import Status


class ProtocolError(Exception):
    """The peer sent bytes that break the protocol.

    Attributes:
        status: the status a server answers with (EINVAL, E2BIG, ...). A client that receives
            bad bytes closes the connection instead.
    """

    def __init__(self, message: str, status: Status = Status.EINVAL) -> None:
        super().__init__(message)
        self.status = status


class StatusError(Exception):
    """A server answered a request with a non-success status."""

    status: ClassVar[Status] = Status.EINTERNAL
    retriable: ClassVar[bool] = False

    def __init__(self, message: str = "", *, status: int | None = None) -> None:
        code = self.status if status is None else status
        super().__init__(f"{Status.name_of(code)}: {message}" if message else Status.name_of(code))
        self.code = code


class KeyNotFoundError(StatusError):
    status = Status.KEY_ENOENT


class KeyExistsError(StatusError):
    status = Status.KEY_EEXISTS


class ValueTooLargeError(StatusError):
    status = Status.E2BIG


class InvalidArgumentsError(StatusError):
    status = Status.EINVAL


class NotStoredError(StatusError):
    status = Status.NOT_STORED


class DeltaBadValueError(StatusError):
    """INCREMENT/DECREMENT of a document that is not an unsigned decimal number."""

    status = Status.DELTA_BADVAL


class LockedError(StatusError):
    """The document is locked (GET_LOCKED) by someone holding another CAS."""

    status = Status.LOCKED
    retriable = True  # the lock times out


class NotLockedError(StatusError):
    """UNLOCK_KEY of a document that is not locked."""

    status = Status.NOT_LOCKED


class UnknownCollectionError(StatusError):
    """A collection the node's manifest does not hold (the body names its manifest uid)."""

    status = Status.UNKNOWN_COLLECTION


class UnknownScopeError(StatusError):
    """A scope the node's manifest does not hold (the body names its manifest uid)."""

    status = Status.UNKNOWN_SCOPE


class ManifestIsAheadError(StatusError):
    """The request names a manifest uid the node has not applied yet (it will: retry)."""

    status = Status.COLLECTIONS_MANIFEST_IS_AHEAD
    retriable = True


class NotMyVbucketError(StatusError):
    status = Status.NOT_MY_VBUCKET
    retriable = True  # the cluster map may have moved the vbucket; refresh and retry


class NoBucketError(StatusError):
    status = Status.NO_BUCKET


class StreamNotFoundError(StatusError):
    status = Status.DCP_STREAM_NOT_FOUND


class AuthError(StatusError):
    status = Status.AUTH_ERROR


class RangeError(StatusError):
    status = Status.ERANGE


class RollbackRequiredError(StatusError):
    status = Status.ROLLBACK


class AccessError(StatusError):
    status = Status.EACCESS


class UnknownCommandError(StatusError):
    status = Status.UNKNOWN_COMMAND


class OutOfMemoryError(StatusError):
    status = Status.ENOMEM
    retriable = True


class NotSupportedError(StatusError):
    status = Status.NOT_SUPPORTED


class InternalError(StatusError):
    status = Status.EINTERNAL


class BusyError(StatusError):
    status = Status.EBUSY
    retriable = True


class TemporaryFailureError(StatusError):
    status = Status.ETMPFAIL
    retriable = True


class DurabilityImpossibleError(StatusError):
    status = Status.DURABILITY_IMPOSSIBLE


class SyncWriteAmbiguousError(StatusError):
    status = Status.SYNC_WRITE_AMBIGUOUS
    retriable = True


class SyncWriteInProgressError(StatusError):
    """The key has a durable write pending (its prepare is not committed or aborted yet)."""

    status = Status.SYNC_WRITE_IN_PROGRESS
    retriable = True


def _registry() -> dict[int, type[StatusError]]:
    table: dict[int, type[StatusError]] = {}
    pending: list[type[StatusError]] = list(StatusError.__subclasses__())
    while pending:
        cls = pending.pop()
        assert cls.status not in table, cls
        table[cls.status] = cls
        pending.extend(cls.__subclasses__())
    return table


_BY_STATUS = _registry()


def error_for_status(status: int, message: str = "") -> StatusError:
    """Return the exception for a non-success response status.

    Args:
        status: the u16 status from a response header (must not be SUCCESS).
        message: context to include, e.g. the error-context JSON of an XERROR response.
    """
    assert status != Status.SUCCESS, status
    cls = _BY_STATUS.get(status, StatusError)
    return cls(message, status=status)
