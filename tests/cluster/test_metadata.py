"""ClusterMetadata against a real etcd on loopback: leases, map CAS, fencing, watches, errors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cluster.etcd_server import EtcdServer, free_port
from changefeed.cluster.metadata import (
    ClusterMetadata,
    Leadership,
    MetadataUnavailableError,
    parse_endpoint,
    parse_endpoints,
)
from changefeed.cluster.placement import initial_map
from changefeed.vbmap import ClusterMap, NodeAddress
from support.etcd import running_etcd

T = TypeVar("T")
TEST_TIMEOUT_S = 30.0
SHORT_TTL_S = 2  # etcd's minimum useful TTL: the lease tests wait about this long
NODES = tuple(NodeAddress(f"n{i}", "127.0.0.1", 12000 + i) for i in range(3))


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a test body with a deadline, so a hang fails instead of blocking the suite; on a
    timeout, print where every task was stuck."""

    async def bounded() -> T:
        body = asyncio.ensure_future(coroutine)
        done, _ = await asyncio.wait({body}, timeout=TEST_TIMEOUT_S)
        if not done:
            for task in asyncio.all_tasks():
                task.print_stack(limit=12)
            body.cancel()
            raise TimeoutError(f"test body still running after {TEST_TIMEOUT_S} s")
        return body.result()

    return asyncio.run(bounded())


def a_map(rev: int, replicas: int = 1) -> ClusterMap:
    return initial_map(NODES, replicas, 8, rev=rev)


async def until(predicate: Any, timeout_s: float = 30.0) -> None:  # generous: CPU load
    """Poll an async predicate until true (bounded: fails the test after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_unreachable_etcd_is_a_fast_one_line_error() -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(MetadataUnavailableError) as caught:
        run(ClusterMetadata.connect(endpoint, "c"))
    assert time.monotonic() - started < 5.0
    message = str(caught.value)
    assert endpoint in message and "\n" not in message


@pytest.mark.parametrize(
    "endpoint", ["ftp://127.0.0.1:2379", "127.0.0.1", "http://h:1/x", "http://h:1,h"]
)
def test_malformed_endpoint_is_named(endpoint: str) -> None:
    with pytest.raises(ValueError, match="is not http://HOST:PORT"):
        run(ClusterMetadata.connect(endpoint, "c"))


@pytest.mark.parametrize(
    ("endpoints", "message"),
    [
        ("https://127.0.0.1:2379", "is https: give its CA and a certificate"),
        ("http://a:1,https://b:2", "mix http and https"),
        (" , ", "is not http"),
    ],
)
def test_endpoints_refused_before_connecting(endpoints: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run(ClusterMetadata.connect(endpoints, "c"))


def test_parse_endpoints_keeps_order_and_drops_repeats() -> None:
    given = "http://10.0.0.1:2379, 10.0.0.2:2379,http://10.0.0.1:2379/"
    assert parse_endpoints(given) == ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]


def test_bad_cluster_name_is_refused(etcd: EtcdServer) -> None:
    with pytest.raises(ValueError, match="cluster name 'a/b'"):
        run(ClusterMetadata.connect(etcd.endpoint, "a/b"))


def test_membership_lives_with_its_lease(etcd: EtcdServer, cluster_name: str) -> None:
    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            seen: list[set[str]] = []

            async def watch() -> None:
                async for nodes in md.watch_nodes():
                    seen.append(set(nodes))

            watcher = asyncio.create_task(watch())
            stays = await md.register_node(NODES[0], ttl_s=SHORT_TTL_S)
            leaves = await md.register_node(NODES[1], ttl_s=SHORT_TTL_S)
            dies = await md.register_node(NODES[2], ttl_s=SHORT_TTL_S)
            assert await md.live_nodes() == {n.name: n for n in NODES}

            await leaves.close()  # revoked: gone at once, and not reported as a loss
            assert set(await md.live_nodes()) == {"n0", "n2"}
            assert leaves.lost.is_set()

            dies._lease._task.cancel()  # the node stops sending keep-alives (it died)
            started = time.monotonic()

            async def n2_gone() -> bool:
                return "n2" not in await md.live_nodes()

            await until(n2_gone, SHORT_TTL_S + 5)
            assert time.monotonic() - started >= SHORT_TTL_S - 1.0  # not before its TTL
            await asyncio.sleep(SHORT_TTL_S)  # kept alive past several TTLs
            assert set(await md.live_nodes()) == {"n0"} and not stays.lost.is_set()

            async def watcher_saw_it() -> bool:
                return bool(seen) and seen[-1] == {"n0"}

            await until(watcher_saw_it)
            assert {"n0", "n1", "n2"} in seen and {"n0", "n2"} in seen
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    run(body())


def test_a_lost_lease_is_observable(etcd: EtcdServer, cluster_name: str) -> None:
    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            membership = await md.register_node(NODES[0], ttl_s=SHORT_TTL_S)
            reasons: list[str] = []
            membership.on_lost(reasons.append)
            await membership.put_status({"state": "serving"})
            assert (await md.node_statuses())["n0"] == {"state": "serving"}
            await md.client.revoke_lease(membership.lease_id)  # etcd drops it (an operator)
            await asyncio.wait_for(membership.lost.wait(), SHORT_TTL_S + 2)
            assert reasons and "expired" in reasons[0]
            assert await md.live_nodes() == {} and await md.node_statuses() == {}

    run(body())


def test_map_cas_has_one_winner(etcd: EtcdServer, cluster_name: str) -> None:
    async def body() -> None:
        async with (
            await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md1,
            await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md2,
        ):
            assert await md1.read_map() is None
            leadership = await md1.campaign("orch", ttl_s=SHORT_TTL_S)
            first = await md1.write_map(a_map(1), None, leadership)
            assert first is not None
            assert await md1.write_map(a_map(2), None, leadership) is None  # one exists now
            stored = await md2.read_map()
            assert stored == (a_map(1), first)

            one, two = a_map(2, replicas=1), a_map(2, replicas=2)
            results = await asyncio.gather(
                md1.write_map(one, first, leadership), md2.write_map(two, first, leadership)
            )
            winners = [r for r in results if r is not None]
            assert len(winners) == 1, results
            expected = one if results[0] is not None else two
            assert await md2.read_map() == (expected, winners[0])

            with pytest.raises(ValueError, match="not above the stored map's rev 2"):
                await md1.write_map(a_map(2), winners[0], leadership)
            assert await md1.write_map(a_map(3), first, leadership) is None  # stale expectation

    run(body())


def test_a_stale_leader_cannot_write_the_map(etcd: EtcdServer, cluster_name: str) -> None:
    """Jepsen's etcd-lock case: A's lease ends while A still believes it leads; B is elected;
    A's write must fail inside etcd (the fencing token), not because A noticed."""

    async def body() -> None:
        async with (
            await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md_a,
            await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md_b,
        ):
            a = await md_a.campaign("a", ttl_s=SHORT_TTL_S)
            written = await md_a.write_map(a_map(1), None, a)
            assert written is not None
            b_campaign = asyncio.create_task(md_b.campaign("b", ttl_s=SHORT_TTL_S))
            await asyncio.sleep(0.2)
            assert not b_campaign.done()  # a holds the key
            # A pauses (a GC, a frozen VM): its lease is gone, but A has not noticed yet.
            believes = Leadership(md_a, "a", a.token, _fresh_lease_like(a))
            await md_b.client.revoke_lease(a.lease_id)
            b = await asyncio.wait_for(b_campaign, 10)
            assert b.token > a.token
            assert not believes.lost.is_set()
            assert await md_a.write_map(a_map(2), written, believes) is None
            assert await md_a.read_map() == (a_map(1), written)
            # Same name, same key value: still fenced by the create revision.
            impostor = Leadership(md_a, "b", a.token, _fresh_lease_like(a))
            assert await md_a.write_map(a_map(2), written, impostor) is None
            assert await md_b.write_map(a_map(2), written, b) is not None
            await asyncio.wait_for(a.lost.wait(), SHORT_TTL_S + 2)  # A notices in the end
            assert await md_b.leader() == ("b", b.token)

    run(body())


def _fresh_lease_like(leadership: Leadership) -> Any:
    """A stand-in for a lease whose holder has not noticed it is gone (lost never set)."""

    class Believer:
        lost = asyncio.Event()
        lease_id = leadership.lease_id
        reason = ""

    return Believer()


def test_campaign_waits_for_the_leader_to_go(
    etcd: EtcdServer, cluster_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with (
            await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md1,
            await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md2,
        ):
            first = await md1.campaign("one", ttl_s=SHORT_TTL_S)
            second = asyncio.create_task(md2.campaign("two", ttl_s=SHORT_TTL_S))
            await asyncio.sleep(2 * SHORT_TTL_S + 0.5)  # longer than a TTL: first keeps it
            assert not second.done() and not first.lost.is_set()
            # The waiting candidate's watch timed out and looked again: normal, not a failure
            # (it was reported as etcd failing, and the campaign backed off).
            assert "watch leader failed" not in caplog.text
            assert await md2.leader() == ("one", first.token)
            await first.resign()
            won = await asyncio.wait_for(second, 5)  # a deletion wakes it, not a timeout
            assert won.token > first.token and first.lost.is_set()
            assert await md1.leader() == ("two", won.token)

    run(body())


def test_a_watch_whose_cancellation_etcds_client_swallowed_still_ends(
    etcd: EtcdServer, cluster_name: str
) -> None:
    """aetcd creates a watch through 3.11's ``wait_for``, which loses a cancellation racing
    with its result (it hung the orchestrator's node watch, and a test, once in a CI-sized
    run): the follower must end when cancelled even then, not wait for the next event."""

    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            create_watch = md.client.watch
            created = asyncio.Event()

            async def watch_losing_a_cancel(*args: Any, **kwargs: Any) -> Any:
                watch = await create_watch(*args, **kwargs)
                created.set()
                # swallowed, as wait_for does when it races with the result
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.sleep(30)
                return watch

            md.client.watch = watch_losing_a_cancel  # type: ignore[method-assign]

            async def follow() -> None:
                async with contextlib.aclosing(md.watch_nodes()) as changes:
                    async for _ in changes:
                        pass

            follower = asyncio.create_task(follow())
            await asyncio.wait_for(created.wait(), 10)
            follower.cancel()
            await asyncio.wait({follower}, timeout=10)
            assert follower.cancelled()

    run(body())


def test_watch_map_sees_every_change_in_order(etcd: EtcdServer, cluster_name: str) -> None:
    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            seen: list[tuple[int, int]] = []

            async def watch() -> None:
                async with contextlib.aclosing(md.watch_map()) as maps:
                    async for cluster_map, revision in maps:
                        seen.append((cluster_map.rev, revision))

            watcher = asyncio.create_task(watch())
            leadership = await md.campaign("orch", ttl_s=SHORT_TTL_S)
            revision = await md.write_map(a_map(1), None, leadership)
            written = [(1, revision)]
            for rev in range(2, 31):
                revision = await md.write_map(a_map(rev), revision, leadership)
                written.append((rev, revision))
                await md.client.put(md.key("noise"), b"x")  # other keys do not show

            async def all_seen() -> bool:
                return len(seen) >= len(written)

            await until(all_seen)
            assert seen == written
            # A compaction below the watch's position does not disturb it. (One that overtakes
            # a lagging watch makes it re-read: it then skips to the latest map, in order.)
            await md.client.compact((await md.client.get_prefix(b"/")).header.revision)
            assert revision is not None
            for rev in range(31, 41):
                revision = await md.write_map(a_map(rev), revision, leadership)
                written.append((rev, revision))
            await until(all_seen)
            assert seen == written
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    run(body())


def test_watch_map_starts_with_the_current_map_and_survives_an_etcd_restart(
    tmp_path: Path,
) -> None:
    async def body(server: EtcdServer) -> None:
        async with await ClusterMetadata.connect(server.endpoint, "restart") as md:
            leadership = await md.campaign("orch", ttl_s=10)
            revision = await md.write_map(a_map(1), None, leadership)
            seen: list[int] = []

            async def watch() -> None:
                async for cluster_map, _ in md.watch_map():
                    seen.append(cluster_map.rev)

            watcher = asyncio.create_task(watch())

            async def saw(count: int) -> bool:
                return len(seen) >= count

            await until(lambda: saw(1))
            assert seen == [1]
            await asyncio.to_thread(server.stop)
            await asyncio.sleep(0.5)  # the watch fails and retries meanwhile
            await asyncio.to_thread(server.start)  # same ports, same data
            deadline = time.monotonic() + 10
            while True:  # the client reconnects within its (capped) backoff
                try:
                    revision = await md.write_map(a_map(2), revision, leadership)
                    break
                except MetadataUnavailableError:
                    assert time.monotonic() < deadline, "the client did not reconnect"
                    await asyncio.sleep(0.1)
            assert revision is not None
            await until(lambda: saw(2))
            assert seen == [1, 2]
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    with running_etcd(tmp_path) as server:
        run(body(server))


def test_request_to_a_stopped_etcd_fails_fast(tmp_path: Path) -> None:
    async def body(server: EtcdServer) -> None:
        async with await ClusterMetadata.connect(server.endpoint, "gone") as md:
            await asyncio.to_thread(server.stop)
            started = time.monotonic()
            with pytest.raises(MetadataUnavailableError, match=server.endpoint):
                await md.read_map()
            assert time.monotonic() - started < 6.0

    with running_etcd(tmp_path) as server:
        run(body(server))


def test_raw_client_sees_the_documented_layout(etcd: EtcdServer, cluster_name: str) -> None:
    """The keys are where the module docstring says (operators read them with etcdctl)."""

    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            await md.register_node(NODES[0], ttl_s=SHORT_TTL_S)
            leadership = await md.campaign("orch", ttl_s=SHORT_TTL_S)
            await md.write_map(a_map(1), None, leadership)
            raw = aetcd.Client("127.0.0.1", etcd.client_port)
            try:
                keys = {
                    kv.key for kv in await raw.get_prefix(f"/changefeed/{cluster_name}/".encode())
                }
            finally:
                await raw.close()
            prefix = f"/changefeed/{cluster_name}/"
            assert keys == {f"{prefix}{k}".encode() for k in ("nodes/n0", "leader", "map")}

    run(body())


# -- decoders of what etcd (or a user) hands us: bad input is a ValueError, never a crash ------


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_parse_endpoint_fuzz(text: str) -> None:
    try:
        host, port = parse_endpoint(text)
    except ValueError as error:
        assert "is not http://HOST:PORT" in str(error)
    else:
        assert host and 0 <= port <= 65535


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=8),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(
                    st.sampled_from(["rev", "replicas", "nodes", "chains", "name", "host", "port"]),
                    inner,
                    max_size=5,
                )
            ),
            max_leaves=20,
        ).map(lambda doc: json.dumps(doc).encode()),
    )
)
def test_stored_map_and_member_decoders_fuzz(value: bytes) -> None:
    md = ClusterMetadata([None], ["http://127.0.0.1:1"], "fuzz", 1.0)
    try:
        md._parse_map(value)
    except ValueError as error:
        assert "cluster map at /changefeed/fuzz/map" in str(error)

    class Kv:
        pass

    kv = Kv()
    kv.value = value  # type: ignore[attr-defined]
    nodes = md._nodes_of({b"/changefeed/fuzz/nodes/x": kv})
    assert all(isinstance(n, NodeAddress) for n in nodes.values())


def test_a_deeply_nested_map_is_refused_not_a_crash() -> None:
    md = ClusterMetadata([None], ["http://127.0.0.1:1"], "fuzz", 1.0)
    with pytest.raises(ValueError, match="cluster map at"):
        md._parse_map(b"[" * 100_000)


def test_a_map_planned_on_a_replaced_in_sync_record_is_not_written(
    etcd: EtcdServer, cluster_name: str
) -> None:
    """A promotion relies on the in-sync record it read: if the active replaced the record
    meanwhile (and may commit without the member that left), the map must not land."""

    async def body() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            leadership = await md.campaign("orch", ttl_s=SHORT_TTL_S)
            first = await md.write_map(a_map(1), None, leadership)
            assert first is not None
            records, revisions = await md.in_sync_sets_and_revisions()
            assert records == {} and revisions == {}
            absent_guard = {3: 0}  # no record for vb 3 yet: written only while there is none
            assert await md.put_in_sync(3, "n0", ["n1", "n2"], first)
            assert (
                await md.write_map(a_map(2), first, leadership, in_sync_revisions=absent_guard)
                is None
            )
            records, revisions = await md.in_sync_sets_and_revisions()
            assert records[3].members == frozenset({"n1", "n2"})
            guard = {3: revisions[3]}
            assert await md.put_in_sync(3, "n0", ["n2"], first)  # the record shrank
            assert await md.write_map(a_map(2), first, leadership, in_sync_revisions=guard) is None
            _, revisions = await md.in_sync_sets_and_revisions()
            written = await md.write_map(
                a_map(2), first, leadership, in_sync_revisions={3: revisions[3]}
            )
            assert written is not None

    run(body())
