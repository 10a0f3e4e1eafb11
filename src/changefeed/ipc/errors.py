"""The errors of changefeed.ipc: one base class, one subclass per thing a caller can act on."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from changefeed.consumer.session import SessionState


class IpcError(Exception):
    """Base of every changefeed.ipc error."""


class ControlSegmentError(IpcError, ValueError):
    """A control segment (or a data slot header) that does not decode: wrong magic or version,
    a geometry out of bounds, a size that does not match the mapping, a bad checksum, a word
    out of range."""


class ServiceNotFoundError(IpcError):
    """No provider ever offered the service in this directory (no usage marker or segment)."""


class ProviderExistsError(IpcError):
    """A second provider for a service whose existence marker a live provider holds."""


class MaxSubscribersError(IpcError):
    """Every transaction log of the service is owned, or the subscriber count or the slot budget
    (sum of max_samples) is at its maximum."""


class CouldNotRestartProxyError(IpcError):
    """The proxy's previous run left only transaction logs that cannot be rolled back (caught
    mid-transaction: quarantined, fail-closed) and no free log is left to register a new one."""


class SampleBudgetError(IpcError):
    """A reader asked for another batch while holding ``max_samples`` of them: release one."""


class ServiceReplacedError(IpcError):
    """The provider replaced the segments (a new geometry, or damaged ones) while this proxy had
    the old ones mapped: subscribe again."""


class LostDataError(IpcError):
    """The reader fell behind the ring: the batch it needs was overwritten (or never fit a slot).

    Resume over DCP from ``session`` (the reader's position after the last batch it took), then
    rejoin; ``changefeed.ipc.LocalStream`` does that by itself.

    Attributes:
        wanted_seq: the batch the reader needed.
        oldest_seq: the oldest batch still in the ring (0 if none).
        session: the reader's per-vbucket position, as DCP session state.
    """

    def __init__(
        self, message: str, *, wanted_seq: int, oldest_seq: int, session: SessionState | None
    ) -> None:
        super().__init__(message)
        self.wanted_seq = wanted_seq
        self.oldest_seq = oldest_seq
        self.session = session


class UnpublishedError(IpcError):
    """Vbuckets no shared-memory service of the node publishes (``missing``, sorted)."""

    def __init__(self, missing: list[int], node: str) -> None:
        super().__init__(
            f"vbuckets {missing} of {node} are not published over shared memory here "
            "(a node started with --shm, and its shm_dir)"
        )
        self.missing = missing
