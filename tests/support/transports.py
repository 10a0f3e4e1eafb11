"""A client connection's transport for tests that drive a real `ClientConnection` without a
socket: it records what the connection writes (each write apart, and all of it together)."""

from __future__ import annotations


class RecordingTransport:
    """The transport side of a socket, recording each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    @property
    def data(self) -> bytes:
        """Everything written so far, in order."""
        return b"".join(self.writes)

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def writelines(self, data: list[bytes]) -> None:
        self.writes.append(b"".join(data))

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str) -> object:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
