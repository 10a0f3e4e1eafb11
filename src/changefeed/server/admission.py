"""Which connections a node keeps when slots run short: budgets for those still authenticating,
for every authenticated user, and slots only admins (and so replica streams) may take.

A node has ``max_connections`` slots (file descriptors). Without budgets, whoever connects first
keeps a slot until a deadline closes it: 5,000 sockets that never authenticate locked every new
client out for the 10 s authentication deadline, and 897 idle authenticated ones for the 300 s
idle timeout. Here:

* connections still authenticating share ``unauthenticated_max`` slots; one more closes the
  oldest of them that has not sent a request yet, or if every one has, the oldest of all (it
  had the longest to authenticate). A flood of them costs at most that many slots, a new client
  always gets a socket, and a client in the middle of its SASL exchange is not pushed out by
  sockets that never speak (a CI run's flood of 5,000 silent sockets closed a KvClient between
  its SCRAM steps when the flood arrived faster than one exchange);
* authenticated connections share what is left, minus ``admin_reserved`` slots only users with
  the admin privilege may take (a replica stream authenticates as the replication user, an
  admin: replication and the operator get in whatever the applications hold);
* one user holds at most ``per_user_max`` connections.

When an authentication would go over the user's bound or the authenticated share, the
connection of that user (or, for the share, of anyone) that has been idle the longest makes
room, if it has been idle at least ``idle_min_s``, as memcached frees its least recently used
connections near its limit; a client that had the slot reconnects (the SDKs and ``KvClient`` do
on their next request). Otherwise the authentication is refused with a retriable status.
Connections that stream (DCP) or wait for something the node owes them are never idle.

What it does not do: close anything itself (it names the connections to close), or count
connections over ``max_connections`` (the listener refuses those at once, as before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from changefeed import limits


class Member(Protocol):
    """A connection as admission sees it."""

    last_request_s: float  # monotonic seconds of its latest request

    def close(self) -> None: ...

    def idle_evictable(self) -> bool:
        """True if closing it loses nothing the node owes it (no DCP, no pending answers)."""
        ...


@dataclass(frozen=True, slots=True)
class Shares:
    """The slots of each kind, from the configured bounds (see `Shares.of`)."""

    unauthenticated_max: int
    authenticated_max: int  # what every authenticated user may take together
    admin_max: int  # authenticated_max plus the reserved slots: what admins may fill
    per_user_max: int

    @classmethod
    def of(
        cls, connections_max: int, unauthenticated_max: int, admin_reserved: int, per_user_max: int
    ) -> Shares:
        """Split ``connections_max``. A node configured with few slots (a test's 3) still
        leaves half of them to authenticated users: the shares shrink before that half does.
        """
        assert connections_max >= 1, connections_max
        assert unauthenticated_max >= 1, unauthenticated_max
        assert admin_reserved >= 0, admin_reserved
        assert per_user_max >= 1, per_user_max
        floor = max(1, connections_max // 2)
        authenticated = max(floor, connections_max - unauthenticated_max - admin_reserved)
        admin = max(authenticated, connections_max - unauthenticated_max)
        shares = cls(unauthenticated_max, authenticated, admin, per_user_max)
        assert shares.authenticated_max <= shares.admin_max <= connections_max, shares
        return shares


@dataclass(frozen=True, slots=True)
class Refused:
    """An authentication the budgets cannot take: the reply's text."""

    message: str


COUNTER_HELP = {
    "authenticating": "Connections still authenticating (TLS handshake included).",
    "authenticated": "Authenticated connections (admins included).",
    "admin": "Authenticated connections of users with the admin privilege (replica streams too).",
    "users": "Users holding at least one connection.",
    "busiest_user": "Connections of the user that holds the most.",
    "authenticating_max": "Slots connections still authenticating share (one more closes the "
    "oldest).",
    "authenticated_max": "Slots every authenticated user may take together.",
    "admin_max": "Slots admins may fill (the authenticated share plus the reserved ones).",
    "per_user_max": "Connections one user may hold.",
    "closed_authenticating_total": "Connections closed still authenticating to make room for a "
    "new one.",
    "closed_idle_total": "Idle authenticated connections closed to make room for a new one.",
    "refused_total": "Authentications refused because every slot of their share was busy.",
}


class Admission:
    """The node's connection budgets (one per node, shared by its connections).

    Args:
        shares: the slots of each kind.
        clock: monotonic seconds (the clock ``Member.last_request_s`` is taken on).
        idle_min_s: a connection idle less than this is never closed to make room.
    """

    def __init__(
        self,
        shares: Shares,
        *,
        clock: Callable[[], float],
        idle_min_s: float = limits.IDLE_EVICTION_MIN_S,
    ) -> None:
        assert idle_min_s >= 0, idle_min_s
        self.shares = shares
        self._clock = clock
        self._idle_min_s = idle_min_s
        # Authenticating connections in arrival order (oldest first): those that sent no
        # request yet are closed for room before any that did.
        self._silent: dict[Member, None] = {}
        self._talking: dict[Member, None] = {}
        self._user_of: dict[Member, str] = {}
        self._by_user: dict[str, dict[Member, None]] = {}
        self._admins: set[Member] = set()
        # Counters (STAT and tests read them): closed by each rule, and refusals.
        self.closed_unauthenticated = 0
        self.closed_idle = 0
        self.refused = 0

    @property
    def unauthenticated(self) -> int:
        return len(self._silent) + len(self._talking)

    @property
    def authenticated(self) -> int:
        return len(self._user_of)

    def connections_of(self, user: str) -> int:
        return len(self._by_user.get(user, ()))

    def counters(self) -> dict[str, int]:
        """What the budgets hold and did, by name (``STAT connections`` and ``/metrics``
        ``changefeed_connections_<name>``, described in ``COUNTER_HELP``): in use per class,
        the busiest user's count, the shares, and the totals of each rule."""
        shares = self.shares
        return {
            "authenticating": self.unauthenticated,
            "authenticated": len(self._user_of),
            "admin": len(self._admins),
            "users": len(self._by_user),
            "busiest_user": max((len(mine) for mine in self._by_user.values()), default=0),
            "authenticating_max": shares.unauthenticated_max,
            "authenticated_max": shares.authenticated_max,
            "admin_max": shares.admin_max,
            "per_user_max": shares.per_user_max,
            "closed_authenticating_total": self.closed_unauthenticated,
            "closed_idle_total": self.closed_idle,
            "refused_total": self.refused,
        }

    def arrived(self, member: Member) -> Member | None:
        """A new connection (not authenticated yet). Returns the unauthenticated one to close
        if the budget is full (it leaves the books at once): the oldest silent one, else the
        oldest of all."""
        assert not self._authenticating(member), member
        assert member not in self._user_of, member
        oldest = self._make_room()
        self._silent[member] = None
        return oldest

    def spoke(self, member: Member) -> None:
        """``member``, still authenticating, sent a request: from now on it is closed for room
        only after every silent one. Cheap for any other member (the caller need not check)."""
        if member in self._silent:
            del self._silent[member]
            self._talking[member] = None

    def authenticated_as(
        self, member: Member, user: str, *, admin: bool
    ) -> tuple[Refused | None, list[Member]]:
        """``member`` authenticated as ``user``. Returns a refusal (then it left the books; the
        caller answers and closes it) or None, and the idle connections to close for room."""
        self.left(member)
        victims: list[Member] = []
        refusal = None
        mine = self._by_user.get(user, {})
        share = self.shares.admin_max if admin else self.shares.authenticated_max
        if len(mine) >= self.shares.per_user_max:
            victim = self._idlest(mine)
            if victim is None:
                refusal = Refused(
                    f"user {user!r} holds {len(mine)} busy connections "
                    f"(max_connections_per_user {self.shares.per_user_max}); retry later"
                )
            else:
                victims.append(victim)
                self.left(victim)
        if refusal is None and len(self._user_of) >= share:
            victim = self._idlest(self._user_of)
            if victim is None:
                refusal = Refused(
                    f"all {len(self._user_of)} connection slots for authenticated clients "
                    "are busy; retry later"
                )
            else:
                victims.append(victim)
                self.left(victim)
        self.closed_idle += len(victims)
        if refusal is not None:
            self.refused += 1
            return refusal, victims
        self._user_of[member] = user
        self._by_user.setdefault(user, {})[member] = None
        if admin:
            self._admins.add(member)
        assert len(self._by_user[user]) <= self.shares.per_user_max, user
        assert len(self._user_of) <= self.shares.admin_max, len(self._user_of)
        return None, victims

    def unauthenticated_again(self, member: Member) -> Member | None:
        """An authentication failed: the connection holds no identity (any more). One that
        never had one keeps its place in the eviction order; one that had one joins the
        authenticating connections as a newcomer does, so it returns the oldest of them to
        close when their budget is full (as `arrived`)."""
        if self._authenticating(member):
            return None
        self.left(member)
        oldest = self._make_room()
        self._talking[member] = None  # its SASL request was one
        return oldest

    def left(self, member: Member) -> None:
        """``member`` closed (or changes kind): its slot is free."""
        self._silent.pop(member, None)
        self._talking.pop(member, None)
        self._admins.discard(member)
        user = self._user_of.pop(member, None)
        if user is not None:
            mine = self._by_user[user]
            del mine[member]
            if not mine:
                del self._by_user[user]

    def _authenticating(self, member: Member) -> bool:
        return member in self._silent or member in self._talking

    def _make_room(self) -> Member | None:
        """Take the oldest silent (else oldest talking) authenticating connection off the
        books if their budget is full, to be closed; None if there is room."""
        if self.unauthenticated < self.shares.unauthenticated_max:
            return None
        oldest = next(iter(self._silent or self._talking))
        self.left(oldest)
        self.closed_unauthenticated += 1
        return oldest

    def _idlest(self, among: dict[Member, str] | dict[Member, None]) -> Member | None:
        """The connection idle the longest (at least idle_min_s) that may be closed."""
        latest_s = self._clock() - self._idle_min_s
        best: Member | None = None
        for member in among:  # bounded by the slots; runs only when a budget is full
            if member.last_request_s > latest_s or not member.idle_evictable():
                continue
            if best is None or member.last_request_s < best.last_request_s:
                best = member
        return best

    def _check_invariants(self) -> None:
        assert not set(self._silent) & set(self._talking)
        assert not (set(self._silent) | set(self._talking)) & set(self._user_of)
        assert sum(len(m) for m in self._by_user.values()) == len(self._user_of)
        assert self._admins <= set(self._user_of)
        assert self.unauthenticated <= self.shares.unauthenticated_max
