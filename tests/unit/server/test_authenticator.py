"""SASL on the server: replies that do not tell which users exist, identity after re-auth."""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
from scramp import ScramClient

from changefeed.protocol.sasl import encode_plain
from changefeed.protocol.status import Status
from changefeed.server.authenticator import (
    HASHING_RETRY_S,
    AuthThrottle,
    SaslAuthenticator,
    is_loopback,
    source_key,
)
from changefeed.server.privileges import Privilege
from changefeed.server.users import NODE_SECRET_SIZE, Users, load_or_create_node_secret

LOOPBACK = "127.0.0.1"  # exempt from the throttle: these tests count outcomes, not lockouts


def auth(authenticator: SaslAuthenticator, mechanism: str, payload: bytes) -> tuple[Status, bytes]:
    """One SASL_AUTH through the real async path (hashing in the executor)."""
    return asyncio.run(authenticator.sasl_auth(mechanism, payload, LOOPBACK))


T = TypeVar("T")
SECRET = b"n" * NODE_SECRET_SIZE
HOST = "192.0.2.7"  # TEST-NET-1


@pytest.fixture(scope="module")
def users() -> Users:
    users = Users()
    users.add("alice", "secret")
    users.add("reader", "secret", roles=["data_reader"])
    return users


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingExecutor(Executor):
    """Runs each call on a worker thread and records the thread's name."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="recording")
        self.threads: list[str] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        def call() -> T:
            self.threads.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return self._pool.submit(call)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait, cancel_futures=cancel_futures)


def scram_exchange(
    authenticator: SaslAuthenticator, mechanism: str, user: str, password: str
) -> tuple[Status, bytes]:
    """A whole SCRAM exchange through the async API; the last (status, value)."""
    client = ScramClient([mechanism.replace("SHA", "SHA-")], user, password)

    async def exchange() -> tuple[Status, bytes]:
        first = client.get_client_first().encode()
        status, reply = await authenticator.sasl_auth(mechanism, first, HOST)
        if status != Status.AUTH_CONTINUE:
            return status, reply
        client.set_server_first(reply.decode())
        final = client.get_client_final().encode()
        return await authenticator.sasl_step(mechanism, final, HOST)

    return asyncio.run(exchange())


def plain(authenticator: SaslAuthenticator, user: str, password: str, host: str = HOST) -> Status:
    status, _ = asyncio.run(authenticator.sasl_auth("PLAIN", encode_plain(user, password), host))
    return status


def scram_salt(reply: bytes) -> bytes:
    fields = dict(part.split("=", 1) for part in reply.decode().split(","))
    return base64.b64decode(fields["s"])


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA512", "SCRAM-SHA256"])
def test_scram_first_reply_has_a_salt_of_the_same_length_for_unknown_users(
    users: Users, mechanism: str
) -> None:
    scramp_name = mechanism.replace("SHA", "SHA-")
    salts = {}
    for name in ("alice", "mallory"):
        client = ScramClient([scramp_name], name, "whatever")
        status, reply = auth(
            SaslAuthenticator(users), mechanism, client.get_client_first().encode()
        )
        assert status == Status.AUTH_CONTINUE, (name, status)
        salts[name] = scram_salt(reply)
    assert len(salts["alice"]) == len(salts["mallory"]) == 32, salts


def test_plain_takes_as_long_for_an_unknown_user_as_for_a_wrong_password(users: Users) -> None:
    """The same hashing work: compared by the fastest of 30 tries each, since load on the
    machine only ever adds time (medians swing 2x under a load of 4 on 2 cores)."""
    authenticator = SaslAuthenticator(users)
    elapsed_s: dict[str, list[float]] = {"alice": [], "mallory": []}
    for _ in range(30):
        for name in elapsed_s:  # interleaved, so both see the same machine noise
            start = time.perf_counter()
            status, _ = auth(authenticator, "PLAIN", encode_plain(name, "wrong"))
            elapsed_s[name].append(time.perf_counter() - start)
            assert status == Status.AUTH_ERROR
    known, unknown = (min(elapsed_s[name]) for name in ("alice", "mallory"))
    assert 0.67 < unknown / known < 1.5, (known, unknown)


@pytest.mark.parametrize("password", ["pass\x07word", "\x1b[2J", "\ue000"])
def test_a_plain_password_with_control_characters_fails_cleanly(
    users: Users, password: str
) -> None:
    authenticator = SaslAuthenticator(users)
    status, _ = auth(authenticator, "PLAIN", encode_plain("alice", password))
    assert status == Status.AUTH_ERROR
    assert authenticator.user is None


def test_a_failed_reauth_drops_the_previous_identity(users: Users) -> None:
    authenticator = SaslAuthenticator(users)
    status, _ = auth(authenticator, "PLAIN", encode_plain("alice", "secret"))
    assert (status, authenticator.user) == (Status.SUCCESS, "alice")
    status, _ = auth(authenticator, "PLAIN", encode_plain("alice", "wrong"))
    assert status == Status.AUTH_ERROR
    assert authenticator.user is None


def test_the_fake_salt_is_stable_across_restarts_and_differs_between_nodes(
    users: Users, tmp_path: Path
) -> None:
    def first_salt(secret: bytes) -> bytes:
        client = ScramClient(["SCRAM-SHA-512"], "mallory", "whatever")
        authenticator = SaslAuthenticator(users, secret=secret)
        _, reply = auth(authenticator, "SCRAM-SHA512", client.get_client_first().encode())
        return scram_salt(reply)

    salt = first_salt(load_or_create_node_secret(tmp_path / "node"))
    assert first_salt(load_or_create_node_secret(tmp_path / "node")) == salt  # a restart
    assert first_salt(load_or_create_node_secret(tmp_path / "other")) != salt


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA512", "SCRAM-SHA256"])
def test_scram_for_an_unknown_user_fails_at_the_proof_like_a_wrong_password(
    users: Users, mechanism: str
) -> None:
    wrong = scram_exchange(SaslAuthenticator(users, secret=SECRET), mechanism, "alice", "nope")
    unknown = scram_exchange(SaslAuthenticator(users, secret=SECRET), mechanism, "ghost", "nope")
    assert wrong == unknown == (Status.AUTH_ERROR, b"authentication failed")


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA512", "SCRAM-SHA256"])
def test_scram_success_sets_the_identity_and_its_privileges(users: Users, mechanism: str) -> None:
    authenticator = SaslAuthenticator(users, secret=SECRET)
    status, final = scram_exchange(authenticator, mechanism, "reader", "secret")
    assert status == Status.SUCCESS
    assert final.startswith(b"v=")
    assert (authenticator.user, authenticator.privileges) == ("reader", {Privilege.READ})


def test_a_step_without_an_exchange_or_for_another_mechanism_is_einval(users: Users) -> None:
    authenticator = SaslAuthenticator(users, secret=SECRET)
    status, _ = asyncio.run(authenticator.sasl_step("SCRAM-SHA512", b"c=biws", HOST))
    assert status == Status.EINVAL
    client = ScramClient(["SCRAM-SHA-512"], "alice", "secret")
    first = client.get_client_first().encode()
    assert asyncio.run(authenticator.sasl_auth("SCRAM-SHA512", first, HOST))[0] == (
        Status.AUTH_CONTINUE
    )
    status, _ = asyncio.run(authenticator.sasl_step("SCRAM-SHA256", b"c=biws", HOST))
    assert status == Status.EINVAL


def test_privileges_follow_the_identity_and_a_failure_clears_both(users: Users) -> None:
    authenticator = SaslAuthenticator(users, secret=SECRET, throttle=AuthThrottle())
    assert (authenticator.user, authenticator.privileges) == (None, frozenset())
    assert plain(authenticator, "alice", "secret") == Status.SUCCESS
    assert authenticator.privileges == frozenset(Privilege)
    assert plain(authenticator, "reader", "secret") == Status.SUCCESS
    assert (authenticator.user, authenticator.privileges) == ("reader", {Privilege.READ})
    assert plain(authenticator, "alice", "wrong") == Status.AUTH_ERROR
    assert (authenticator.user, authenticator.privileges) == (None, frozenset())
    status, _ = asyncio.run(authenticator.sasl_auth("PLAIN", b"garbage", HOST))
    assert status == Status.AUTH_ERROR


def test_a_scram_start_drops_the_previous_identity(users: Users) -> None:
    authenticator = SaslAuthenticator(users, secret=SECRET)
    assert plain(authenticator, "alice", "secret") == Status.SUCCESS
    client = ScramClient(["SCRAM-SHA-512"], "alice", "secret")
    status, _ = auth(authenticator, "SCRAM-SHA512", client.get_client_first().encode())
    assert status == Status.AUTH_CONTINUE
    assert (authenticator.user, authenticator.privileges) == (None, frozenset())


def test_plain_passwords_are_hashed_off_the_event_loop(users: Users) -> None:
    executor = RecordingExecutor()
    try:
        authenticator = SaslAuthenticator(users, secret=SECRET, executor=executor)
        assert plain(authenticator, "alice", "secret") == Status.SUCCESS
        assert plain(authenticator, "ghost", "secret") == Status.AUTH_ERROR  # a decoy, hashed too
        assert plain(authenticator, "alice", "bad\x07") == Status.AUTH_ERROR
    finally:
        executor.shutdown()
    assert len(executor.threads) == 3
    assert all(name.startswith("recording") for name in executor.threads), executor.threads


class GatedExecutor(Executor):
    """Each hash waits for a gate the event loop opens only once it has turned a few times
    after the hashing began: if hashing ran on the loop, the gate could never open."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="gated")
        self.gate = threading.Event()
        self.opened: list[bool] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        def call() -> T:
            self.opened.append(self.gate.wait(10.0))  # 10 s: only a guard against a hang
            return fn(*args, **kwargs)

        return self._pool.submit(call)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait, cancel_futures=cancel_futures)


def test_the_event_loop_keeps_turning_while_passwords_are_hashed(users: Users) -> None:
    """64 PLAIN checks from as many hosts: every hash runs off the loop, and the loop keeps
    turning while they wait (no timing: the hashes cannot finish unless it does)."""
    executor = GatedExecutor()

    async def scenario() -> None:
        throttle = AuthThrottle()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while not executor.gate.is_set():
                await asyncio.sleep(0)
                ticks += 1
                if ticks >= 5:
                    executor.gate.set()

        attempts = [
            SaslAuthenticator(users, secret=SECRET, throttle=throttle, executor=executor).sasl_auth(
                "PLAIN", encode_plain("alice", "wrong"), f"198.51.100.{n}"
            )
            for n in range(64)
        ]
        tick = asyncio.create_task(ticker())
        replies = await asyncio.gather(*attempts)
        await tick
        assert {status for status, _ in replies} == {Status.AUTH_ERROR}

    try:
        asyncio.run(scenario())
    finally:
        executor.shutdown()
    assert len(executor.opened) == 64 and all(executor.opened), executor.opened


def test_a_host_over_its_failure_budget_is_refused_without_hashing(users: Users) -> None:
    clock = FakeClock()
    throttle = AuthThrottle(failures_max=3, window_s=60.0, clock=clock)
    executor = RecordingExecutor()
    try:

        def attempt(password: str, host: str = HOST) -> tuple[Status, bytes]:
            authenticator = SaslAuthenticator(
                users, secret=SECRET, throttle=throttle, executor=executor
            )
            payload = encode_plain("alice", password)
            return asyncio.run(authenticator.sasl_auth("PLAIN", payload, host))

        for _ in range(3):
            assert attempt("wrong")[0] == Status.AUTH_ERROR
        hashed = len(executor.threads)
        clock.now += 10
        status, message = attempt("secret")  # even the right password: the host is throttled
        assert (status, message) == (Status.AUTH_ERROR, b"too many failed attempts; retry in 50 s")
        assert len(executor.threads) == hashed
        assert attempt("secret", host="203.0.113.9")[0] == Status.SUCCESS  # other hosts are not
        clock.now += 50
        assert attempt("secret")[0] == Status.SUCCESS  # a new window
    finally:
        executor.shutdown()


def test_scram_failures_count_against_the_host_too(users: Users) -> None:
    throttle = AuthThrottle(failures_max=2, clock=FakeClock())
    for _ in range(2):
        authenticator = SaslAuthenticator(users, secret=SECRET, throttle=throttle)
        assert scram_exchange(authenticator, "SCRAM-SHA512", "alice", "wrong")[0] == (
            Status.AUTH_ERROR
        )
    authenticator = SaslAuthenticator(users, secret=SECRET, throttle=throttle)
    status, message = scram_exchange(authenticator, "SCRAM-SHA512", "alice", "secret")
    assert status == Status.AUTH_ERROR
    assert message.startswith(b"too many failed attempts")


def test_attempts_being_hashed_count_against_the_budget(users: Users) -> None:
    """Many connections of one host cannot start more hashes than it has failures left."""
    release = threading.Event()

    class BlockedExecutor(RecordingExecutor):
        def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
            def blocked(*call_args: Any) -> T:
                release.wait(10)
                return fn(*call_args)

            return super().submit(blocked, *args, **kwargs)

    async def scenario(executor: Executor) -> list[tuple[Status, bytes]]:
        throttle = AuthThrottle(failures_max=3, clock=FakeClock())
        attempts = [
            asyncio.create_task(
                SaslAuthenticator(
                    users, secret=SECRET, throttle=throttle, executor=executor
                ).sasl_auth("PLAIN", encode_plain("alice", "wrong"), HOST)
            )
            for _ in range(8)
        ]
        await asyncio.sleep(0.05)
        throttle._check_invariants()
        release.set()
        replies = await asyncio.gather(*attempts)
        throttle._check_invariants()
        assert throttle.retry_after_s(HOST) == 60.0  # three failures, nothing in flight
        return replies

    executor = BlockedExecutor()
    try:
        replies = asyncio.run(scenario(executor))
    finally:
        release.set()
        executor.shutdown()
    assert len(executor.threads) == 3
    refused = f"too many failed attempts; retry in {HASHING_RETRY_S:.0f} s".encode()
    assert (
        sorted(replies)
        == [(Status.AUTH_ERROR, b"authentication failed")] * 3 + [(Status.AUTH_ERROR, refused)] * 5
    )


def test_the_throttle_tracks_a_bounded_number_of_hosts() -> None:
    clock = FakeClock()
    throttle = AuthThrottle(failures_max=2, hosts_max=3, clock=clock)
    for n in range(10):
        throttle.record_failure(f"10.0.0.{n}", "PLAIN")
        throttle.record_failure(f"10.0.0.{n}", "PLAIN")
        throttle._check_invariants()
        assert len(throttle) <= 3
    assert throttle.retry_after_s("10.0.0.9") > 0  # the latest are kept
    assert throttle.retry_after_s("10.0.0.0") == 0.0  # the oldest forgotten
    clock.now += 3600
    assert throttle.retry_after_s("10.0.0.9") == 0.0
    assert len(throttle) == 2  # an expired record is dropped when looked up


@pytest.mark.parametrize(
    ("peer_host", "key"),
    [
        ("192.0.2.7", "192.0.2.7"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("::ffff:192.0.2.7", "192.0.2.7"),
        ("/tmp/node.sock", "/tmp/node.sock"),
    ],
)
def test_sources_are_counted_per_address_and_per_ipv6_64(peer_host: str, key: str) -> None:
    assert source_key(peer_host) == key


def test_authentication_log_lines_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    throttle = AuthThrottle(failures_max=1000, log_lines_max=5, window_s=60.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="changefeed.server.auth"):
        for n in range(200):
            throttle.record_failure(f"10.0.{n // 250}.{n % 250}", "PLAIN")
        assert len(caplog.records) == 5
        clock.now += 60
        throttle.record_failure(HOST, "PLAIN")
    assert len(caplog.records) == 7
    assert caplog.records[5].getMessage() == "195 authentication failure log lines left out in 60 s"
    assert caplog.records[6].getMessage() == f"authentication failed from {HOST} (PLAIN)"


def test_throttled_hosts_are_logged_even_when_failures_flood_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    throttle = AuthThrottle(failures_max=4, log_lines_max=3, clock=FakeClock())
    with caplog.at_level(logging.WARNING, logger="changefeed.server.auth"):
        for host in ("10.0.0.1", "10.0.0.2"):
            for _ in range(4):
                throttle.record_failure(host, "PLAIN")
            throttle.record_refusal(host)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 5, lines
    assert [line for line in lines if line.startswith("throttling")] == [
        f"throttling 10.0.0.{n}: 4 failed authentications in 60 s; its attempts are refused "
        "until the window ends"
        for n in (1, 2)
    ]


@pytest.mark.parametrize(
    ("peer_host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.7", False),
        ("::ffff:192.0.2.7", False),
        ("2001:db8::1", False),
        ("?", False),
    ],
)
def test_loopback_peers_are_recognised(peer_host: str, loopback: bool) -> None:
    assert is_loopback(peer_host) is loopback


def test_loopback_peers_are_exempt_unless_told_otherwise(users: Users) -> None:
    exempting = AuthThrottle(failures_max=2, clock=FakeClock())
    for _ in range(5):
        exempting.record_failure("127.0.0.1", "PLAIN")
    assert exempting.retry_after_s("127.0.0.1") == 0.0
    assert len(exempting) == 0  # not even tracked
    authenticator = SaslAuthenticator(users, secret=SECRET, throttle=exempting)
    assert plain(authenticator, "alice", "secret", host="127.0.0.1") == Status.SUCCESS

    strict = AuthThrottle(failures_max=2, clock=FakeClock(), exempt_loopback=False)
    for _ in range(2):
        strict.record_failure("127.0.0.1", "PLAIN")
    assert strict.retry_after_s("127.0.0.1") == 60.0
