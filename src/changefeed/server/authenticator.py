"""Server side of SASL for one connection (PLAIN, SCRAM-SHA256/512), and the node's throttle.

`SaslAuthenticator` answers one connection's SASL_AUTH / SASL_STEP with ``(status, value)`` and
holds the connection's identity: ``user`` and ``privileges``. Every SASL_AUTH drops the identity
first, so a failed re-authentication leaves the connection unauthenticated, never as the user it
was before. SCRAM messages are parsed and checked by `changefeed.protocol.scram` (RFC 5802,
strict but for the spaces the Couchbase SDKs put in their nonces), with scramp's primitives.

Replies do not tell which user names exist. An unknown name gets decoy keys (`users.decoy_keys`,
derived from the node secret): SCRAM's first reply carries a salt of the real length, the same
one on every attempt and after a restart, and the exchange fails only at the proof, as for a
wrong password. A PLAIN check of an unknown name hashes the password against a decoy with the
same iterations, so it takes as long as a wrong password.

A PLAIN check costs a PBKDF2 (~2 ms of SHA-512): ``sasl_auth`` runs it on a small thread pool,
not the event loop (hashlib releases the GIL while it hashes). SCRAM costs the server only a few
HMACs; the client does the PBKDF2. `AuthThrottle`, one per node, counts failures per source host
and refuses hosts over their budget without hashing; it also rate-limits the failure log lines.

What it does not do: read frames, reply, or decide what an identity may do (the connection
asks `privileges.required_privilege`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import math
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor

from changefeed.protocol import scram
from changefeed.protocol.errors import ProtocolError
from changefeed.protocol.sasl import PlainCredentials, decode_plain
from changefeed.protocol.status import Status
from changefeed.server.privileges import Privilege
from changefeed.server.users import (
    NODE_SECRET_SIZE,
    PLAIN_MECHANISM,
    SCRAM_MECHANISMS,
    ScramKeys,
    Users,
    decoy_keys,
    password_matches,
)

log = logging.getLogger("changefeed.server.auth")

MECHANISMS = ("SCRAM-SHA512", "SCRAM-SHA256", "PLAIN")

# Threads that hash PLAIN passwords. Two keep the event loop's core free on a small machine and
# still check ~1000 passwords/s (1.7-2 ms each, measured); the throttle keeps attackers far below.
HASH_THREADS = 2

# Failed authentications a source host may have per window before its further attempts are
# refused without hashing. 20 lets people and misconfigured clients behind one address (a NAT,
# a Spark cluster's few hosts) retry; a script gets 20 guesses a minute instead of ~375 a
# second (measured before this throttle), and costs the node at most 20 x 2 ms of hashing
# per minute. Attempts being hashed count too, so many connections of one host cannot start
# more hashes than it has failures left. Loopback peers are exempt by default (see AuthThrottle).
AUTH_FAILURES_PER_WINDOW_MAX = 20
# The window is fixed: it starts at a host's first attempt and ends this much later.
AUTH_FAILURE_WINDOW_S = 60.0
# Source hosts tracked at once; when full, the one whose last failure is oldest is forgotten.
# A record is ~210 bytes (measured: key, slotted record, dict slot), so 10k hosts take ~2 MiB. An
# attacker with more addresses than this can make the node forget its older ones; IPv6 sources
# are tracked per /64 so that one host's addresses count as one.
AUTH_HOSTS_TRACKED_MAX = 10_000
IPV6_SOURCE_PREFIX_BITS = 64
# The retry hint when a host's attempts in progress alone fill its budget: they end in ms.
HASHING_RETRY_S = 1.0
# Authentication log lines per window, node-wide, for each of two kinds: failures and refusals,
# and "throttling <host>" lines (one per host per window), so that a flood of failures cannot
# hide which hosts got throttled. The rest are counted, and the count is logged with the next
# window's first line of that kind. A flood then writes ~40 lines a minute.
AUTH_LOG_LINES_PER_WINDOW_MAX = 20

assert AUTH_FAILURES_PER_WINDOW_MAX >= 1
assert AUTH_FAILURE_WINDOW_S > HASHING_RETRY_S > 0
assert AUTH_HOSTS_TRACKED_MAX >= 1
assert AUTH_LOG_LINES_PER_WINDOW_MAX >= 1

FAILED = b"authentication failed"
# A node authenticated by its certificate (authenticate_node) is this user: users-file names
# cannot hold ':' (users.py), so no password user can be mistaken for a node.
NODE_IDENTITY_PREFIX = "@node:"
# What a node certificate grants: reading, streaming and stats for replica feeds and the
# cluster's own checks, and ADMIN so that replica streams take the slots kept for admins
# (admission.py). Not WRITE: no node writes documents through another's KV port.
NODE_PRIVILEGES = frozenset(
    {Privilege.READ, Privilege.DCP_STREAM, Privilege.STATS, Privilege.ADMIN}
)


def node_identity(node: str) -> str:
    """The user name of a connection authenticated by ``node``'s certificate."""
    return NODE_IDENTITY_PREFIX + node


# The decoy secret of an authenticator built without the node secret (the synchronous API of
# old): decoys are stable only within this process.
_PROCESS_SECRET = secrets.token_bytes(NODE_SECRET_SIZE)
assert set(scram.HASHES) == set(SCRAM_MECHANISMS), scram.HASHES


@dataclasses.dataclass(frozen=True, slots=True)
class _ScramExchange:
    """A SCRAM exchange between its first and final message."""

    mechanism: str
    first: scram.ClientFirst
    server_first: str
    keys: ScramKeys
    user: str | None  # None: the exchange runs on decoy keys (an unknown user)


@functools.cache
def shared_hash_executor() -> Executor:
    """The process's pool of HASH_THREADS threads for PLAIN checks (made on first use)."""
    return ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="changefeed-sasl")


def source_key(peer_host: str) -> str:
    """What the throttle counts failures by: the IP address, an IPv6 address's /64 network (one
    host usually owns a /64), an IPv4-mapped IPv6 address as IPv4; anything else as given."""
    try:
        address = ipaddress.ip_address(peer_host.split("%", 1)[0])  # without an IPv6 zone
    except ValueError:
        return peer_host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, IPV6_SOURCE_PREFIX_BITS), strict=False))
    return str(address)


def is_loopback(peer_host: str) -> bool:
    """Whether ``peer_host`` is a loopback IP address (IPv4-mapped ones included)."""
    try:
        address = ipaddress.ip_address(peer_host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


@dataclasses.dataclass(slots=True)
class _SourceRecord:
    window_start: float
    failures: int = 0
    in_flight: int = 0


class AuthThrottle:
    """Failed authentications per source host, node-wide: a host over its budget is refused
    until its window ends. Memory is bounded by ``hosts_max`` records.

    Loopback peers (127.0.0.0/8, ::1) are exempt unless ``exempt_loopback`` is False, as in
    fail2ban's default: they are processes on the node's own machine (the demo, the CLI, local
    jobs, the tests, whose fuzzing would otherwise lock out their own clients), and their PLAIN
    checks still run off the event loop. Their failures are logged, not counted.

    Args:
        failures_max: failures (plus attempts being hashed) a host may have per window.
        window_s: the window's length; it starts at the host's first attempt.
        hosts_max: hosts tracked at once (the least recently failing one is forgotten).
        log_lines_max: authentication log lines per window, node-wide.
        exempt_loopback: never throttle loopback peers.
        clock: monotonic seconds; inject a fake one to test windows.
    """

    def __init__(
        self,
        *,
        failures_max: int = AUTH_FAILURES_PER_WINDOW_MAX,
        window_s: float = AUTH_FAILURE_WINDOW_S,
        hosts_max: int = AUTH_HOSTS_TRACKED_MAX,
        log_lines_max: int = AUTH_LOG_LINES_PER_WINDOW_MAX,
        exempt_loopback: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert failures_max >= 1, failures_max
        assert window_s > 0, window_s
        assert hosts_max >= 1, hosts_max
        self._failures_max = failures_max
        self._window_s = window_s
        self._hosts_max = hosts_max
        self._exempt_loopback = exempt_loopback
        self._clock = clock
        # Least recently failing first: the one to forget when full.
        self._sources: collections.OrderedDict[str, _SourceRecord] = collections.OrderedDict()
        self._failure_log = _RateLimitedLog("failure", log_lines_max, window_s, clock)
        self._throttling_log = _RateLimitedLog("throttling", log_lines_max, window_s, clock)

    def __len__(self) -> int:
        return len(self._sources)

    def retry_after_s(self, peer_host: str) -> float:
        """0.0 if ``peer_host`` may attempt now; else seconds until it may (a hint)."""
        key = self._key(peer_host)
        if key is None:
            return 0.0
        now = self._clock()
        record = self._record(key, now, create=False)
        if record is None or record.failures + record.in_flight < self._failures_max:
            return 0.0
        if record.failures < self._failures_max:
            return HASHING_RETRY_S
        retry_after_s = record.window_start + self._window_s - now
        assert 0 < retry_after_s <= self._window_s, retry_after_s
        return retry_after_s

    @contextlib.contextmanager
    def hashing(self, peer_host: str) -> Iterator[None]:
        """Count an attempt of ``peer_host`` against its budget while its password is hashed."""
        key = self._key(peer_host)
        if key is None:
            yield
            return
        record = self._record(key, self._clock(), create=True)
        assert record is not None
        record.in_flight += 1
        try:
            yield
        finally:
            # The record itself, even if it was forgotten or its window restarted meanwhile.
            record.in_flight -= 1
            assert record.in_flight >= 0, record

    def record_failure(self, peer_host: str, mechanism: str) -> None:
        """Count a failed authentication of ``peer_host`` and log it (rate-limited)."""
        self._failure_log.warning("authentication failed from %s (%s)", peer_host, mechanism)
        key = self._key(peer_host)
        if key is None:
            return
        record = self._record(key, self._clock(), create=True)
        assert record is not None
        record.failures += 1
        self._sources.move_to_end(key)
        if record.failures == self._failures_max:
            self._throttling_log.warning(
                "throttling %s: %d failed authentications in %.0f s; its attempts are refused "
                "until the window ends",
                key,
                record.failures,
                self._window_s,
            )
        assert len(self._sources) <= self._hosts_max, len(self._sources)

    def record_refusal(self, peer_host: str) -> None:
        """An attempt refused for the throttle: logged (rate-limited), not counted."""
        self._failure_log.warning("refused authentication from %s: throttled", peer_host)

    def _key(self, peer_host: str) -> str | None:
        """The source ``peer_host`` counts as, or None when it is exempt."""
        if self._exempt_loopback and is_loopback(peer_host):
            return None
        return source_key(peer_host)

    def _record(self, key: str, now: float, *, create: bool) -> _SourceRecord | None:
        record = self._sources.get(key)
        if record is not None and now - record.window_start >= self._window_s:
            if record.in_flight == 0 and not create:
                del self._sources[key]
                return None
            record.window_start = now  # a new window; attempts in progress still count
            record.failures = 0
        if record is None and create:
            while len(self._sources) >= self._hosts_max:
                self._sources.popitem(last=False)
            record = self._sources[key] = _SourceRecord(window_start=now)
        return record

    def _check_invariants(self) -> None:
        """O(hosts): for tests, after each public call."""
        assert len(self._sources) <= self._hosts_max, len(self._sources)
        for record in self._sources.values():
            assert record.failures >= 0, record
            assert record.in_flight >= 0, record


class _RateLimitedLog:
    """At most ``lines_max`` warnings per window; the number left out is logged with the next
    window's first line."""

    def __init__(
        self, kind: str, lines_max: int, window_s: float, clock: Callable[[], float]
    ) -> None:
        self._kind = kind
        self._lines_max = lines_max
        self._window_s = window_s
        self._clock = clock
        self._window_start = -math.inf
        self._lines = 0
        self._suppressed = 0

    def warning(self, message: str, *args: object) -> None:
        now = self._clock()
        if now - self._window_start >= self._window_s:
            if self._suppressed:
                log.warning(
                    "%d authentication %s log lines left out in %.0f s",
                    self._suppressed,
                    self._kind,
                    self._window_s,
                )
            self._window_start, self._lines, self._suppressed = now, 0, 0
        if self._lines < self._lines_max:
            self._lines += 1
            log.warning(message, *args)
        else:
            self._suppressed += 1


class SaslAuthenticator:
    """One connection's SASL exchange and identity.

    Args:
        users: who may authenticate.
        secret: the node secret (`users.load_or_create_node_secret`) decoys derive from. None:
            a per-process secret, so decoy salts change across restarts (the old behaviour).
        throttle: the node's one `AuthThrottle`, shared by its connections. None: one of this
            connection's own, which only throttles attempts on this connection.
        executor: where PLAIN passwords are hashed; None: `shared_hash_executor()`.

    Attributes:
        user: the authenticated user, or None.
        privileges: what ``user``'s roles grant; empty while ``user`` is None.
    """

    def __init__(
        self,
        users: Users,
        *,
        secret: bytes | None = None,
        throttle: AuthThrottle | None = None,
        executor: Executor | None = None,
    ) -> None:
        assert secret is None or len(secret) == NODE_SECRET_SIZE, "a node secret is 32 bytes"
        self._users = users
        self._secret = _PROCESS_SECRET if secret is None else secret
        self._throttle = AuthThrottle() if throttle is None else throttle
        self._executor = executor
        self._scram: _ScramExchange | None = None
        self._attempts = 0  # SASL_AUTHs begun; only the latest one may set the identity
        self.user: str | None = None
        self.privileges: frozenset[Privilege] = frozenset()

    @staticmethod
    def mechanisms() -> bytes:
        return " ".join(MECHANISMS).encode()

    async def sasl_auth(
        self, mechanism: str, payload: bytes, peer_host: str
    ) -> tuple[Status, bytes]:
        """SASL_AUTH: start (and for PLAIN, finish) an exchange; drops the current identity.

        Args:
            mechanism: the request's key (PLAIN, SCRAM-SHA512, SCRAM-SHA256).
            payload: the request's value.
            peer_host: the peer's IP address, which the throttle counts by.

        Returns:
            (SUCCESS, b"") for PLAIN, (AUTH_CONTINUE, server-first) for SCRAM, or
            (AUTH_ERROR, reason): wrong credentials, unknown user and a throttled host
            (with a retry hint) all answer AUTH_ERROR.
        """
        attempt = self._begin()
        retry_after_s = self._throttle.retry_after_s(peer_host)
        if retry_after_s > 0:
            self._throttle.record_refusal(peer_host)
            retry_s = math.ceil(retry_after_s)
            return Status.AUTH_ERROR, f"too many failed attempts; retry in {retry_s} s".encode()
        if mechanism == "PLAIN":
            status, value = await self._plain_async(attempt, payload, peer_host)
        else:
            status, value = self._scram_first(mechanism, payload)
        if status == Status.AUTH_ERROR:
            self._throttle.record_failure(peer_host, mechanism)
        return status, value

    async def sasl_step(
        self, mechanism: str, payload: bytes, peer_host: str
    ) -> tuple[Status, bytes]:
        """SASL_STEP: the client's final SCRAM message.

        Returns:
            (SUCCESS, server-final), (AUTH_ERROR, reason), or (EINVAL, reason) when no exchange
            of ``mechanism`` is in progress.
        """
        status, value = self._scram_final(mechanism, payload)
        if status == Status.AUTH_ERROR:
            self._throttle.record_failure(peer_host, mechanism)
        return status, value

    # -- PLAIN ----------------------------------------------------------------------------------

    async def _plain_async(
        self, attempt: int, payload: bytes, peer_host: str
    ) -> tuple[Status, bytes]:
        credentials = _decode_plain(payload)
        if credentials is None:
            return Status.AUTH_ERROR, b"malformed PLAIN payload"
        keys, known = self._plain_keys(credentials.user)
        executor = self._executor if self._executor is not None else shared_hash_executor()
        loop = asyncio.get_running_loop()
        with self._throttle.hashing(peer_host):
            matched = await loop.run_in_executor(
                executor, password_matches, keys, credentials.password
            )
        if attempt != self._attempts:  # a later SASL_AUTH began meanwhile; it decides
            return Status.AUTH_ERROR, FAILED
        return self._plain_outcome(credentials.user, known and matched)

    def _plain_keys(self, user: str) -> tuple[ScramKeys, bool]:
        """``user``'s keys, or decoy keys (hashed against just the same), and which it is."""
        return self._keys_or_decoy(user, PLAIN_MECHANISM)

    def _keys_or_decoy(self, user: str, mechanism: str) -> tuple[ScramKeys, bool]:
        # The decoy is derived for known users too (~15 us of HMACs), so the lookup takes as
        # long whether the name exists or not.
        decoy = decoy_keys(self._secret, user, mechanism)
        keys = self._users.scram_keys(user, mechanism)
        return (decoy, False) if keys is None else (keys, True)

    def _plain_outcome(self, user: str, succeeded: bool) -> tuple[Status, bytes]:
        if not succeeded:
            return Status.AUTH_ERROR, FAILED
        self._set_identity(user)
        return Status.SUCCESS, b""

    # -- SCRAM ----------------------------------------------------------------------------------

    def _scram_first(self, mechanism: str, payload: bytes) -> tuple[Status, bytes]:
        if mechanism not in SCRAM_MECHANISMS:
            return Status.AUTH_ERROR, f"unsupported mechanism {mechanism!r}".encode()
        try:
            first = scram.parse_client_first(payload)
        except scram.ScramError:
            return Status.AUTH_ERROR, FAILED
        # An unknown user gets decoy keys: the exchange then fails at the last step, as for a
        # wrong password (RFC 5802 §5.1), and the first reply does not tell which names exist.
        keys, known = self._keys_or_decoy(first.user, mechanism)
        reply = scram.server_first(first, keys.salt, keys.iterations, scram.make_server_nonce())
        user = first.user if known else None
        self._scram = _ScramExchange(mechanism, first, reply, keys, user)
        return Status.AUTH_CONTINUE, reply.encode()

    def _scram_final(self, mechanism: str, payload: bytes) -> tuple[Status, bytes]:
        exchange, self._scram = self._scram, None
        if exchange is None or mechanism != exchange.mechanism:
            return Status.EINVAL, b"no SASL exchange in progress"
        try:
            final = scram.verify(
                mechanism,
                exchange.first,
                exchange.server_first,
                scram.parse_client_final(payload),
                stored_key=exchange.keys.stored_key,
                server_key=exchange.keys.server_key,
            )
        except scram.ScramError:
            return Status.AUTH_ERROR, FAILED
        if exchange.user is None:  # a decoy exchange never succeeds (its keys match no password)
            return Status.AUTH_ERROR, FAILED
        self._set_identity(exchange.user)
        return Status.SUCCESS, final.encode()

    # -- identity -------------------------------------------------------------------------------

    def authenticate_node(self, node: str) -> None:
        """The peer presented a node certificate the cluster CA signed (the TLS handshake
        checked it): it is authenticated as that node, without SASL, as Couchbase's client
        certificate auth. The identity is `node_identity(node)`, with `NODE_PRIVILEGES`.
        A later SASL_AUTH replaces it, as it replaces any identity."""
        assert node and node.isprintable(), node
        self._scram = None
        self.user = node_identity(node)
        self.privileges = NODE_PRIVILEGES
        assert self.user not in self._users, self.user  # users.py refuses ':' in names

    def _begin(self) -> int:
        """A SASL_AUTH begins: forget the identity and any exchange in progress."""
        self._attempts += 1
        self._scram = None
        self._set_identity(None)
        return self._attempts

    def _set_identity(self, user: str | None) -> None:
        self.user = user
        self.privileges = frozenset() if user is None else self._users.privileges(user)
        if user is None:
            assert not self.privileges, self.privileges
        else:
            assert user in self._users, user


def _decode_plain(payload: bytes) -> PlainCredentials | None:
    try:
        return decode_plain(payload)
    except ProtocolError:
        return None
