"""A client connection's transport for tests that drive a real `ClientConnection` without a
socket: it records what the connection writes (each write apart, and all of it together)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.sasl import encode_plain


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


class Receiving(Protocol):
    """What `sign_in` drives: a connection's receiving side (`ClientConnection`)."""

    def data_received(self, data: bytes) -> None: ...


async def sign_in(
    conn: Receiving, transport: RecordingTransport, user: str = "u", password: str = "p"
) -> None:
    """Authenticate `conn` (PLAIN, opaque 1) and select the bucket "default" (opaque 2), as a
    client does first. The password is checked off the loop: wait (30 s at most) for its
    answer before the next request."""
    plain = encode_plain(user, password)
    conn.data_received(encode_request(Opcode.SASL_AUTH, opaque=1, key=b"PLAIN", value=plain))
    async with asyncio.timeout(30):
        while not transport.writes:
            await asyncio.sleep(0.005)
    conn.data_received(encode_request(Opcode.SELECT_BUCKET, opaque=2, key=b"default"))
