"""`KvClient.wait_persisted` / `wait_all_persisted` and `Connection.request_batch` against
scripted nodes: the client asks with SEQNO_PERSISTENCE; a node that does not know the opcode
(UNKNOWN_COMMAND) is polled with OBSERVE_SEQNO from then on, one that answers TMPFAIL (too many
waits) is polled for that wait only, and other refusals are raised."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from changefeed.consumer.connection import Connection, ConnectionClosedError
from changefeed.consumer.kv_client import KvClient, MutationLostError
from changefeed.protocol.errors import StatusError
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.kv import (
    MutationResult,
    ObserveSeqnoResult,
    decode_seqno_persistence,
    encode_observe_seqno_result,
    encode_seqno_persistence,
)
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.reader import FrameReader
from changefeed.protocol.status import Status

HOST = "127.0.0.1"
UUID = 0xABCDEF


def node(seqno_persistence: Status, seen: list[int], history: str = "same") -> Any:
    """A node answering SEQNO_PERSISTENCE with `seqno_persistence` (SUCCESS: the seqno is
    persisted) and OBSERVE_SEQNO with a persisted seqno that rises by 10 per call, on the
    writer's history (`history` "same"), or on a new one that branched off the writer's at
    seqno 100 ("kept": writes up to 100 survive) or at 1 ("lost")."""
    persisted = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal persisted
        frames = FrameReader(1 << 20)
        while data := await reader.read(65536):
            frames.feed(data)
            for _, frame in frames.read_batch().controls:
                assert isinstance(frame, Frame)
                seen.append(frame.opcode)
                if frame.opcode == Opcode.SEQNO_PERSISTENCE:
                    decode_seqno_persistence(frame)  # well formed
                    writer.write(encode_response(frame, seqno_persistence))
                    continue
                assert frame.opcode == Opcode.OBSERVE_SEQNO, frame
                assert int.from_bytes(frame.value, "big") == UUID  # the write's history
                persisted += 10
                if history == "same":
                    result = ObserveSeqnoResult(frame.vbucket, UUID, persisted, 100)
                else:
                    branch_end = 100 if history == "kept" else 1
                    result = ObserveSeqnoResult(
                        frame.vbucket, UUID + 1, persisted, 100, UUID, branch_end
                    )
                writer.write(encode_response(frame, value=encode_observe_seqno_result(result)))
            await writer.drain()

    return serve


def against_node(
    answer: Status, waits: Callable[[KvClient], Awaitable[None]], history: str = "same"
) -> list[int]:
    """Run `waits` with a client of a scripted `node`; the opcodes the node saw."""
    seen: list[int] = []

    async def main() -> None:
        server = await asyncio.start_server(node(answer, seen, history), HOST, 0)
        port = server.sockets[0].getsockname()[1]
        kv = KvClient(await Connection.open(HOST, port), 4)
        try:
            async with asyncio.timeout(10):
                await waits(kv)
        finally:
            await kv.close()
            server.close()
            await server.wait_closed()

    asyncio.run(main())
    return seen


def waits_against(answer: Status, seqnos: list[int], history: str = "same") -> list[int]:
    """`wait_persisted` of each of `seqnos` (vbucket 1), one after the other."""

    async def waits(kv: KvClient) -> None:
        for seqno in seqnos:
            await kv.wait_persisted(MutationResult(vbucket=1, seqno=seqno, cas=5, vb_uuid=UUID))

    return against_node(answer, waits, history)


WAIT, POLL = Opcode.SEQNO_PERSISTENCE, Opcode.OBSERVE_SEQNO


def test_a_node_that_answers_waits_is_never_polled() -> None:
    """Each wait goes with one OBSERVE_SEQNO in the same write (the history check)."""
    assert waits_against(Status.SUCCESS, [25, 50]) == [WAIT, POLL, WAIT, POLL]


def test_a_node_without_the_opcode_is_polled_from_then_on() -> None:
    assert waits_against(Status.UNKNOWN_COMMAND, [25, 50]) == [WAIT, POLL, POLL, POLL, POLL, POLL]


def test_a_refused_wait_is_polled_and_the_next_one_asks_again() -> None:
    assert waits_against(Status.ETMPFAIL, [25, 50]) == [WAIT, POLL, POLL, POLL, WAIT, POLL, POLL]


def test_a_write_the_history_lost_raises() -> None:
    """The node's history branched off the write's before the write (a failover): the wait
    cannot succeed, even though the node answers it."""
    with pytest.raises(MutationLostError, match="seqno 25 written on history"):
        waits_against(Status.SUCCESS, [25], history="lost")


def test_a_write_on_the_shared_part_of_the_history_is_kept() -> None:
    assert waits_against(Status.SUCCESS, [25], history="kept") == [WAIT, POLL]
    with pytest.raises(MutationLostError):  # polled: the same check
        waits_against(Status.UNKNOWN_COMMAND, [25], history="lost")


@pytest.mark.parametrize("answer", [Status.EACCESS, Status.NOT_MY_VBUCKET])
def test_other_refusals_are_raised(answer: Status) -> None:
    with pytest.raises(StatusError) as info:
        waits_against(answer, [25])
    assert info.value.status == answer


def waits_all_against(answer: Status, seqnos: list[int]) -> list[int]:
    """`wait_all_persisted` of writes to vbuckets 0..len(seqnos)-1."""

    async def waits(kv: KvClient) -> None:
        await kv.wait_all_persisted(
            [
                MutationResult(vbucket=vb, seqno=seqno, cas=5, vb_uuid=UUID)
                for vb, seqno in enumerate(seqnos)
            ]
        )

    return against_node(answer, waits)


def test_waits_for_several_vbuckets_are_each_answered_by_the_node() -> None:
    assert waits_all_against(Status.SUCCESS, [5, 15, 25]) == [WAIT] * 3 + [POLL] * 3


def test_several_vbuckets_on_a_node_without_the_opcode_are_polled() -> None:
    seen = waits_all_against(Status.UNKNOWN_COMMAND, [5, 15, 25])
    assert seen[:6] == [WAIT] * 3 + [POLL] * 3
    assert set(seen[6:]) == {POLL} and len(seen) >= 9  # each vbucket polled until persisted


@pytest.mark.parametrize("answer", [Status.EACCESS, Status.NOT_MY_VBUCKET])
def test_other_refusals_of_a_batch_are_raised(answer: Status) -> None:
    with pytest.raises(StatusError) as info:
        waits_all_against(answer, [5, 15])
    assert info.value.status == answer


def test_a_batch_left_unanswered_leaves_nothing_waiting(caplog: pytest.LogCaptureFixture) -> None:
    """`Connection.request_batch` against a node that answers one request of three, then
    closes: the caller gets the close (or a timeout), no response stays registered and no
    future is reported as never retrieved."""
    reported: list[dict[str, Any]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: reported.append(context))

        async def answer_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            frames = FrameReader(1 << 20)
            frames.feed(await reader.read(65536))
            first = frames.read_batch().controls[0][1]
            assert isinstance(first, Frame)
            writer.write(encode_response(first))
            await writer.drain()
            await asyncio.sleep(0.1)
            writer.close()

        server = await asyncio.start_server(answer_one, HOST, 0)
        conn = await Connection.open(HOST, server.sockets[0].getsockname()[1])
        first = conn.reserve_opaques(3)
        opaques = [first, first + 1, first + 2]
        data = b"".join(encode_seqno_persistence(0, 1, opaque) for opaque in opaques)
        with pytest.raises((ConnectionClosedError, TimeoutError)):
            await conn.request_batch(data, opaques, timeout_s=5.0)
        assert not conn._pending  # nothing left registered
        await conn.close()
        server.close()
        await server.wait_closed()
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert reported == [], [context.get("message") for context in reported]
