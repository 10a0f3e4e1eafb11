"""The node-wide bound on bytes of requests that have started to arrive but not finished.

Each connection buffers an unfinished request until its last byte arrives (up to
FRAME_SIZE_MAX, ~20 MiB once authenticated). Without a node-wide bound, many connections that
each send part of a large SET hold all of that at once (measured: 200 connections x 1 MiB =
+190 MiB). Above PARTIAL_REQUEST_BYTES_MAX a connection that holds partial bytes stops reading
until the total falls below the resume mark; the partial-frame deadline closes the ones that
never finish, which gives their bytes back.
"""

from __future__ import annotations

from collections.abc import Callable

from changefeed import limits


class PartialBytesBudget:
    """Bytes of unfinished requests per connection, their total, and who is paused for it."""

    def __init__(
        self,
        bytes_max: int = limits.PARTIAL_REQUEST_BYTES_MAX,
        resume_bytes: int = limits.PARTIAL_REQUEST_BYTES_RESUME,
    ) -> None:
        assert 0 < resume_bytes < bytes_max, (resume_bytes, bytes_max)
        self.bytes_max = bytes_max
        self.resume_bytes = resume_bytes
        self.total_bytes = 0
        self._held: dict[object, int] = {}
        self._paused: dict[object, Callable[[], None]] = {}

    def update(self, owner: object, held_bytes: int, resume: Callable[[], None]) -> bool:
        """`owner` now holds `held_bytes`; returns True if it must stop reading (then `resume`
        is called once the total is back under the resume mark)."""
        assert held_bytes >= 0, held_bytes
        self.total_bytes += held_bytes - self._held.get(owner, 0)
        if held_bytes:
            self._held[owner] = held_bytes
        else:
            self._held.pop(owner, None)
        assert self.total_bytes >= 0, self.total_bytes
        if held_bytes and self.total_bytes > self.bytes_max:
            self._paused[owner] = resume
            return True
        self._resume_if_room()
        return False

    def release(self, owner: object) -> None:
        """`owner` is gone: its bytes return to the budget."""
        self._paused.pop(owner, None)
        self.update(owner, 0, lambda: None)

    @property
    def paused(self) -> int:
        return len(self._paused)

    def _resume_if_room(self) -> None:
        if self._paused and self.total_bytes <= self.resume_bytes:
            paused, self._paused = self._paused, {}
            for resume in paused.values():
                resume()
