"""SDK-style KV client: ``upsert``, ``insert``, ``replace``, ``get``, ``remove``, pipelined
``upsert_many``, and durability ``persist`` (wait until the node has the write on disk).

The vbucket of a key comes from the node's cluster map (GET_CLUSTER_CONFIG), hashed as
Couchbase does (``vbmap.vbucket_for_key``). ``persist`` polls OBSERVE_SEQNO with the mutation
token the write returned, the way Couchbase SDKs implement ``PersistTo``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Literal

from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import call, connect
from changefeed.protocol.errors import error_for_status
from changefeed.protocol.frame import Frame
from changefeed.protocol.kv import (
    CompactDb,
    CompactionSummary,
    MutationResult,
    StoreCommand,
    decode_compaction_summary,
    decode_get_response_flags,
    decode_mutation_token,
    decode_observe_seqno_result,
    encode_compact_db,
    encode_request,
    encode_store,
)
from changefeed.protocol.opcode import Feature, Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import vbucket_for_key

Durability = Literal["none", "persist"]
PIPELINE_DEPTH_MAX = 1024  # requests in flight per upsert_many window
PERSIST_POLL_S = 0.002


@dataclass(frozen=True, slots=True)
class GetResult:
    value: bytes
    cas: int
    flags: int
    datatype: int


class KvClient:
    """One connection to a node for key-value operations."""

    def __init__(self, conn: Connection, vbuckets: int) -> None:
        assert vbuckets >= 1, vbuckets
        self._conn = conn
        self.vbuckets = vbuckets

    @classmethod
    async def connect(
        cls,
        host: str = "127.0.0.1",
        port: int = 11210,
        *,
        bucket: str = "default",
        user: str = "Administrator",
        password: str = "password",
    ) -> KvClient:
        features = [Feature.MUTATION_SEQNO, Feature.XERROR, Feature.SELECT_BUCKET, Feature.JSON]
        conn = await connect(
            host, port, agent="changefeed-kv", user=user, password=password, bucket=bucket,
            features=features,
        )  # fmt: skip
        try:
            config = json.loads((await call(conn, Opcode.GET_CLUSTER_CONFIG)).value)
            vbuckets = len(config["vBucketServerMap"]["vBucketMap"])
        except BaseException:
            await conn.close()
            raise
        return cls(conn, vbuckets)

    async def close(self) -> None:
        await self._conn.close()

    async def __aenter__(self) -> KvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def vbucket_of(self, key: bytes) -> int:
        return vbucket_for_key(key, self.vbuckets)

    async def upsert(
        self, key: bytes, value: bytes, *, durability: Durability = "none", **meta: int
    ) -> MutationResult:
        """Write ``value`` at ``key``. ``meta``: cas, flags, expiry, datatype."""
        return await self._store(Opcode.SET, key, value, durability, **meta)

    async def insert(
        self, key: bytes, value: bytes, *, durability: Durability = "none", **meta: int
    ) -> MutationResult:
        """Like ``upsert``; raises KeyExistsError when the key exists."""
        return await self._store(Opcode.ADD, key, value, durability, **meta)

    async def replace(
        self, key: bytes, value: bytes, *, durability: Durability = "none", **meta: int
    ) -> MutationResult:
        """Like ``upsert``; raises KeyNotFoundError if absent, KeyExistsError on CAS mismatch."""
        return await self._store(Opcode.REPLACE, key, value, durability, **meta)

    async def _store(
        self,
        opcode: int,
        key: bytes,
        value: bytes,
        durability: Durability,
        *,
        cas: int = 0,
        flags: int = 0,
        expiry: int = 0,
        datatype: int = 0,
    ) -> MutationResult:
        vb = self.vbucket_of(key)
        opaque = self._conn.next_opaque()
        command = StoreCommand(opcode, vb, opaque, key, value, flags, expiry, cas, datatype)
        result = _mutation_result(await self._conn.request(encode_store(command), opaque), vb)
        if durability == "persist":
            await self.wait_persisted(result)
        return result

    async def get(self, key: bytes) -> GetResult:
        """Raises KeyNotFoundError when the key does not exist."""
        vb = self.vbucket_of(key)
        opaque = self._conn.next_opaque()
        response = await self._conn.request(
            encode_request(Opcode.GET, vbucket=vb, opaque=opaque, key=key), opaque
        )
        _check(response)
        flags = decode_get_response_flags(response.extras)
        return GetResult(response.value, response.cas, flags, response.datatype)

    async def remove(
        self, key: bytes, *, cas: int = 0, durability: Durability = "none"
    ) -> MutationResult:
        vb = self.vbucket_of(key)
        opaque = self._conn.next_opaque()
        request = encode_request(Opcode.DELETE, vbucket=vb, opaque=opaque, key=key, cas=cas)
        result = _mutation_result(await self._conn.request(request, opaque), vb)
        if durability == "persist":
            await self.wait_persisted(result)
        return result

    async def upsert_many(
        self, items: list[tuple[bytes, bytes]], *, durability: Durability = "none"
    ) -> list[MutationResult]:
        """Pipelined SETs: up to ``PIPELINE_DEPTH_MAX`` in flight, results in input order."""
        results: list[MutationResult] = []
        for first in range(0, len(items), PIPELINE_DEPTH_MAX):
            window = items[first : first + PIPELINE_DEPTH_MAX]
            futures = []
            for key, value in window:
                vb = self.vbucket_of(key)
                opaque = self._conn.next_opaque()
                futures.append((vb, self._conn.expect(opaque)))
                command = StoreCommand(Opcode.SET, vb, opaque, key, value)
                self._conn.send(encode_store(command))
            await self._conn.drain()
            for vb, future in futures:
                results.append(_mutation_result(await asyncio.wait_for(future, 60.0), vb))
        if durability == "persist":
            newest: dict[int, MutationResult] = {}
            for result in results:
                newest[result.vbucket] = result
            await asyncio.gather(*(self.wait_persisted(r) for r in newest.values()))
        return results

    async def compact(
        self,
        vb: int,
        *,
        purge_age_s: float | None = None,
        drop_deletes: bool = False,
        timeout_s: float = 600.0,
    ) -> CompactionSummary:
        """COMPACT_DB: purge vbucket ``vb``'s old tombstones now; returns once the node is done.

        Args:
            purge_age_s: purge tombstones deleted at least this long ago. The node compares
                delete times with its own clock, so this becomes a cutoff time on this host's
                clock (kv_engine's purge_before_ts); None uses the node's tombstone_purge_age_s.
            drop_deletes: purge every tombstone, whatever its age.

        Raises:
            NotMyVbucketError: ``vb`` is not an active vbucket of the node.
            TimeoutError: no answer within ``timeout_s``.
        """
        purge_before_ts = 0  # the node's own purge age
        if purge_age_s is not None:
            purge_before_ts = max(1, int(time.time() - purge_age_s) + 1)  # "deleted before"
        opaque = self._conn.next_opaque()
        request = CompactDb(vb, opaque, purge_before_ts, drop_deletes=drop_deletes)
        response = await self._conn.request(encode_compact_db(request), opaque, timeout_s=timeout_s)
        _check(response)
        return decode_compaction_summary(response.value)

    async def wait_persisted(self, result: MutationResult, *, timeout_s: float = 30.0) -> None:
        """Wait until the node's persisted seqno for the vbucket reaches the write's seqno.

        Raises:
            TimeoutError: not persisted within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        value = result.vb_uuid.to_bytes(8, "big")
        while True:  # bounded by the deadline
            response = await call(
                self._conn, Opcode.OBSERVE_SEQNO, vbucket=result.vbucket, value=value
            )
            observed = decode_observe_seqno_result(response.value)
            if observed.persisted_seqno >= result.seqno:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"seqno {result.seqno} of vb {result.vbucket} not persisted")
            await asyncio.sleep(PERSIST_POLL_S)


def _check(response: Frame) -> None:
    if response.status != Status.SUCCESS:
        raise error_for_status(response.status, response.value.decode(errors="replace"))


def _mutation_result(response: Frame, vb: int) -> MutationResult:
    _check(response)
    token = decode_mutation_token(response.extras)
    uuid, seqno = token if token is not None else (0, 0)
    return MutationResult(vbucket=vb, seqno=seqno, cas=response.cas, vb_uuid=uuid)
