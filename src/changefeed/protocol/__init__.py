"""Sans-IO codec for the memcached binary protocol and DCP (``shared/reference/dcp-wire.md``).

No sockets, no asyncio: bytes in, frames and messages out; encoders return bytes. Peer bytes
that break the protocol raise ``ProtocolError`` carrying the status to answer with.
"""

from changefeed.protocol.batch import Batch, ChangeColumns, decode_batch
from changefeed.protocol.errors import ProtocolError, StatusError, error_for_status
from changefeed.protocol.frame import Frame, encode_frame, encode_response
from changefeed.protocol.opcode import Datatype, Feature, Magic, Opcode
from changefeed.protocol.reader import CLOSED, NEED_DATA, FrameReader
from changefeed.protocol.status import Status

__all__ = [
    "CLOSED",
    "NEED_DATA",
    "Batch",
    "ChangeColumns",
    "Datatype",
    "Feature",
    "Frame",
    "FrameReader",
    "Magic",
    "Opcode",
    "ProtocolError",
    "Status",
    "StatusError",
    "decode_batch",
    "encode_frame",
    "encode_response",
    "error_for_status",
]
