"""What the planner asks a node: each vbucket's high seqno and current vb_uuid.

Runs in Spark's per-query runner process (offset planning), over a short-lived connection.
"""

from __future__ import annotations

import asyncio

from changefeed.consumer.handshake import call, connect
from changefeed.protocol.dcp import decode_failover_log, encode_get_failover_log
from changefeed.protocol.errors import error_for_status
from changefeed.protocol.kv import decode_vb_seqnos
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from changefeed.spark.offsets import Offsets, VbOffset
from changefeed.spark.options import SourceOptions


async def fetch_latest(options: SourceOptions) -> tuple[Offsets, int]:
    """Return ``({vb: VbOffset at the high seqno}, number of vbuckets in the bucket)``."""
    conn = await connect(
        options.host, options.port, agent="changefeed-spark", user=options.user,
        password=options.password, bucket=options.bucket,
    )  # fmt: skip
    try:
        seqnos = dict(decode_vb_seqnos((await call(conn, Opcode.GET_ALL_VB_SEQNOS)).value))
        total = max(seqnos) + 1 if seqnos else 0
        wanted = options.vbucket_ids(total)
        futures = []
        for vb in wanted:
            opaque = conn.next_opaque()
            futures.append(conn.expect(opaque))
            conn.send(encode_get_failover_log(vb, opaque, dcp=False))
        latest: Offsets = {}
        for vb, future in zip(wanted, futures, strict=True):
            response = await asyncio.wait_for(future, 30.0)
            if response.status != Status.SUCCESS:
                raise error_for_status(response.status, f"failover log of vbucket {vb}")
            uuid = decode_failover_log(response.value)[0][0]
            high = seqnos.get(vb, 0)
            latest[vb] = VbOffset(uuid, high, high, high)
        return latest, total
    finally:
        await conn.close()


def fetch_latest_sync(options: SourceOptions) -> tuple[Offsets, int]:
    return asyncio.run(fetch_latest(options))
