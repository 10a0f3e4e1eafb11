"""Connection-level DCP flow control (dcp-wire.md §8.1).

The producer may send while ``outstanding < window``, so one message can overshoot the window
(clients must accept items larger than it). Every producer→client DCP request counts, except
NOOP; BUFFER_ACK subtracts. ``window_bytes == 0`` disables flow control (the default until the
client sends ``connection_buffer_size``).
"""

from __future__ import annotations


class FlowControl:
    def __init__(self, window_bytes: int = 0) -> None:
        assert window_bytes >= 0, window_bytes
        self.window_bytes = window_bytes
        self.outstanding_bytes = 0
        self.acked_bytes_total = 0

    @property
    def enabled(self) -> bool:
        return self.window_bytes > 0

    @property
    def can_send(self) -> bool:
        return not self.enabled or self.outstanding_bytes < self.window_bytes

    @property
    def room_bytes(self) -> int:
        """Bytes that may still be sent before the window is full (unbounded: a large number)."""
        if not self.enabled:
            return 1 << 62
        return max(0, self.window_bytes - self.outstanding_bytes)

    def sent(self, nbytes: int) -> None:
        assert nbytes >= 0, nbytes
        if self.enabled:
            self.outstanding_bytes += nbytes

    def ack(self, nbytes: int) -> None:
        """Apply a BUFFER_ACK; an ack beyond what is outstanding is clamped (never negative)."""
        self.acked_bytes_total += nbytes
        self.outstanding_bytes = max(0, self.outstanding_bytes - nbytes)
        assert self.outstanding_bytes >= 0, self.outstanding_bytes
