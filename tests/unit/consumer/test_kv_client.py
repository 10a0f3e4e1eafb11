"""``consumer/kv_client.py`` (and the ``Connection`` under it) when the node goes away: a call
raises one ``ConnectionClosedError`` naming why, later calls raise it again at once, and nothing
is left for the loop to report ("Future exception was never retrieved", "socket.send() raised
exception")."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

from changefeed.consumer.connection import CloseReason, Connection, ConnectionClosedError
from changefeed.consumer.kv_client import PIPELINE_DEPTH_MAX, KvClient
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.reader import FrameReader

HOST = "127.0.0.1"
VBUCKETS = 4
BIG_WINDOW = PIPELINE_DEPTH_MAX + 500  # more than one upsert_many window
Scenario = Callable[[KvClient], Awaitable[None]]
Runner = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    """The CLI runs on uvloop when installed, libraries often on asyncio's loop: test both."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run  # type: ignore[no-any-return]
    return asyncio.run


async def serve(answer_first: int, reader: asyncio.StreamReader, writer: Any) -> None:
    """A node that answers the first ``answer_first`` requests with success and then drops the
    connection (a crash: no reply, no goodbye)."""
    frames = FrameReader(1 << 20)
    answered = 0
    while answered < answer_first:
        data = await reader.read(65536)
        if not data:
            break
        frames.feed(data)
        for _, frame in frames.read_batch().controls:
            if answered < answer_first:
                writer.write(encode_response(frame))
                answered += 1
    await writer.drain()
    writer.transport.abort()


def run_against_dropping_node(
    run: Runner, answer_first: int, scenario: Scenario
) -> list[dict[str, Any]]:
    """Run ``scenario`` on a ``KvClient`` connected to a node that drops the connection after
    ``answer_first`` answers; return what the loop reported to its exception handler."""
    reported: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: reported.append(ctx))
        server = await asyncio.start_server(lambda r, w: serve(answer_first, r, w), HOST, 0)
        port = server.sockets[0].getsockname()[1]
        kv = KvClient(await Connection.open(HOST, port), VBUCKETS)
        try:
            await scenario(kv)
        finally:
            await kv.close()
            server.close()
            await server.wait_closed()
        del kv
        gc.collect()  # futures nobody awaited report themselves when collected
        await asyncio.sleep(0)

    run(main())
    return reported


def items(count: int) -> list[tuple[bytes, bytes]]:
    return [(b"key-%06d" % n, b"value") for n in range(count)]


@pytest.mark.parametrize("answer_first", [0, 5, 1500])
def test_upsert_many_raises_one_error_and_leaves_nothing_behind(
    run: Runner, answer_first: int, caplog: pytest.LogCaptureFixture
) -> None:
    reasons: list[CloseReason] = []

    async def scenario(kv: KvClient) -> None:
        with pytest.raises(ConnectionClosedError) as info:
            await kv.upsert_many(items(BIG_WINDOW))
        reasons.append(info.value.reason)
        # The connection is known dead: the next call fails at once with the same error.
        with pytest.raises(ConnectionClosedError) as again:
            await kv.upsert_many(items(10))
        assert str(again.value) == str(info.value)
        with pytest.raises(ConnectionClosedError):
            await kv.get(b"key")
        del info, again  # their tracebacks hold upsert_many's futures: let them be collected

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        reported = run_against_dropping_node(run, answer_first, scenario)
    assert reasons in ([CloseReason.EOF], [CloseReason.IO_ERROR]), reasons
    assert reported == [], [context.get("message") for context in reported]
    assert caplog.records == [], [record.getMessage() for record in caplog.records]


def test_single_request_after_drop(run: Runner, caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(kv: KvClient) -> None:
        await kv.upsert(b"a", b"1")  # answered
        with pytest.raises(ConnectionClosedError):
            await kv.upsert(b"b", b"2")  # never answered: the node drops the connection
        with pytest.raises(ConnectionClosedError):
            await kv.remove(b"a")

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        reported = run_against_dropping_node(run, 1, scenario)
    assert reported == [], [context.get("message") for context in reported]
    assert caplog.records == [], [record.getMessage() for record in caplog.records]


def test_close_with_requests_in_flight_reports_nothing(run: Runner) -> None:
    """Closing a client while requests wait fails them quietly (the caller chose to close)."""
    reported: list[dict[str, Any]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, ctx: reported.append(ctx))
        silent = await asyncio.start_server(lambda r, w: None, HOST, 0)  # never answers
        port = silent.sockets[0].getsockname()[1]
        conn = await Connection.open(HOST, port)
        futures: list[asyncio.Future[Frame]] = []
        for _ in range(10):
            futures.append(conn.expect(conn.next_opaque()))
        await conn.close()
        assert all(isinstance(f.exception(), ConnectionClosedError) for f in futures[:1])
        del futures
        silent.close()
        with contextlib.suppress(Exception):
            await silent.wait_closed()
        gc.collect()
        await asyncio.sleep(0)

    run(main())
    assert reported == [], [context.get("message") for context in reported]


async def answer_after(
    held: int, hold_s: float, seen: list[int], reader: asyncio.StreamReader, writer: Any
) -> None:
    """A node that answers nothing until it has ``held`` requests (or ``hold_s`` passed after
    that, counting what else arrives meanwhile in ``seen``), then answers everything."""
    frames = FrameReader(1 << 20)
    waiting: list[Frame] = []
    loop = asyncio.get_running_loop()
    until: float | None = None
    while True:
        timeout = None if until is None else max(0.0, until - loop.time())
        try:
            data = await asyncio.wait_for(reader.read(65536), timeout)
        except TimeoutError:
            data = b"..."  # the hold is over
        else:
            if not data:
                break
            frames.feed(data)
            waiting += [frame for _, frame in frames.read_batch().controls]
        if until is None and len(waiting) >= held:
            until = loop.time() + hold_s
            seen.append(len(waiting))
        if until is not None and loop.time() >= until:
            seen.append(len(waiting))
            writer.write(b"".join(encode_response(frame) for frame in waiting))
            waiting = []
            until = float("inf")  # from now on: answer as requests come
        elif until == float("inf") and waiting:
            writer.write(b"".join(encode_response(frame) for frame in waiting))
            waiting = []
        await writer.drain()


def run_against_holding_node(run: Runner, held: int, hold_s: float, batch: list[Any]) -> list[int]:
    seen: list[int] = []

    async def main() -> None:
        server = await asyncio.start_server(
            lambda r, w: answer_after(held, hold_s, seen, r, w), HOST, 0
        )
        port = server.sockets[0].getsockname()[1]
        kv = KvClient(await Connection.open(HOST, port), VBUCKETS)
        try:
            async with asyncio.timeout(30):
                assert len(await kv.upsert_many(batch)) == len(batch)
        finally:
            await kv.close()
            server.close()
            await server.wait_closed()

    run(main())
    return seen


def test_the_next_window_goes_out_before_the_replies_to_one(run: Runner) -> None:
    """A node that answers only once it holds more than a window: upsert_many completes, so
    the second window was sent with the first one's replies still due."""
    window = PIPELINE_DEPTH_MAX
    seen = run_against_holding_node(run, window + 1, 0.0, items(2 * window))
    assert seen[0] >= window + 1, seen


def test_a_window_sharing_a_key_with_the_one_before_waits_for_it(run: Runner) -> None:
    """A retried write must not land after a later write of its key: a window holding a key
    of the window before is not sent until that window is answered."""
    window = PIPELINE_DEPTH_MAX
    batch = [*items(window), (b"key-000000", b"again"), *items(2 * window)[window + 1 :]]
    seen = run_against_holding_node(run, window, 0.3, batch)
    assert seen[:2] == [window, window], seen  # nothing of window 2 came while 1 was held
