"""Encoding checkpoint items as DCP data messages, with the options a connection negotiated.

The common case (a mutation on a stream without a stream-id) is one ``struct.pack`` of header and
extras plus the key and value; everything else goes through the message encoders.
"""

from __future__ import annotations

from dataclasses import dataclass

from changefeed.checkpoint.item import Item
from changefeed.protocol.dcp_items import (
    MUTATION_PREFIX,
    Deletion,
    Expiration,
    Mutation,
    encode_deletion,
    encode_expiration,
    encode_mutation,
)
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.storage import Op

# Plain ints: an enum attribute lookup costs ~90 ns on 3.11, a third of this hot path.
_MAGIC_REQUEST = int(Magic.REQUEST)
_OP_DCP_MUTATION = int(Opcode.DCP_MUTATION)
_MUTATION = Op.MUTATION


@dataclass(frozen=True, slots=True)
class ItemOptions:
    """Per-connection choices (DCP_OPEN flags and controls)."""

    delete_times: bool = False  # IncludeDeleteTimes: deletion V2 extras
    expiry_opcode: bool = False  # enable_expiry_opcode (only with delete_times)
    no_value: bool = False  # NoValue: strip values


def encode_item(
    item: Item, vb: int, opaque: int, options: ItemOptions, stream_id: int | None = None
) -> bytes:
    value = b"" if options.no_value else item.value
    datatype = 0 if options.no_value else item.datatype
    if item.op is _MUTATION:
        if stream_id is None:
            key = item.key
            prefix = MUTATION_PREFIX.pack(
                _MAGIC_REQUEST,
                _OP_DCP_MUTATION,
                len(key),
                31,
                datatype,
                vb,
                31 + len(key) + len(value),
                opaque,
                item.cas,
                item.seqno,
                item.rev_seqno,
                item.flags,
                item.expiry,
                0,
                0,
                0,
            )
            return b"".join((prefix, key, value))
        mutation = Mutation(
            vb,
            opaque,
            item.seqno,
            item.key,
            value,
            item.cas,
            item.rev_seqno,
            item.flags,
            item.expiry,
            0,
            datatype,
            stream_id,
        )
        return encode_mutation(mutation)
    if item.op is Op.EXPIRATION and options.expiry_opcode and options.delete_times:
        return encode_expiration(
            Expiration(
                vb,
                opaque,
                item.seqno,
                item.key,
                item.cas,
                item.rev_seqno,
                item.delete_time,
                value,
                datatype,
                stream_id,
            )
        )
    delete_time = item.delete_time if options.delete_times else None
    return encode_deletion(
        Deletion(
            vb,
            opaque,
            item.seqno,
            item.key,
            item.cas,
            item.rev_seqno,
            delete_time,
            value,
            datatype,
            stream_id,
        )
    )
