"""An etcd-like metadata store: revisions, leases on the simulated clock, fenced transactions.

It models etcd's semantics, not our etcd client (cluster/metadata.py):

- one global `revision`, raised by every write; each key keeps its `create_revision` (the
  revision of the put that created it) and `mod_revision` (of its last put);
- leases with a TTL in whole seconds on the simulated clock: `keep_alive` renews one to a
  full TTL and answers the TTL (0: the lease is unknown, it expired or was revoked); when a
  lease runs out, it is gone and every key attached to it is deleted in one revision;
- `txn(compares, success, failure)`: compares on a key's `mod_revision`, `create_revision` or
  value, all evaluated and applied at one revision (a map write that compares the map's
  `mod_revision` and the leader key's `create_revision` fails once either changed);
- reached only over the network (tests/sim/network.py): a call is a datagram to endpoint
  ``etcd`` and its answer a datagram back, so a node cut from the store learns nothing, and a
  keep-alive that is lost renews nothing.

Watches are modelled as polls (the node agent and the orchestrator read every
`POLL_INTERVAL_S`): a watch delivers the same revisions, a little sooner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .network import Network
from .scheduler import Scheduler

ENDPOINT = "etcd"


@dataclasses.dataclass(slots=True)
class KeyValue:
    value: Any
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclasses.dataclass(slots=True)
class Lease:
    ttl_s: int
    expires_at: float
    keys: set[str] = dataclasses.field(default_factory=set)


# A compare: (target, key, expected), target "mod", "create" or "value" (etcd's Compare).
Compare = tuple[str, str, Any]
# An operation: ("put", key, value, lease) or ("delete", key).
Operation = tuple[Any, ...]


class MetaStore:
    """The store's state and its request handler (endpoint ``etcd``)."""

    def __init__(self, sched: Scheduler, network: Network) -> None:
        self.sched = sched
        self.net = network
        self.revision = 1
        self.kv: dict[str, KeyValue] = {}
        self.leases: dict[int, Lease] = {}
        self._next_lease = 0x1000
        self.up = True
        network.register(ENDPOINT, self._gate)

    def _gate(self) -> float | None:
        return self.sched.now if self.up else None

    # -- the wire -------------------------------------------------------------------------------

    def call(
        self, src: str, op: str, args: tuple[Any, ...], reply: Callable[[Any], None] | None
    ) -> None:
        """`src` sends a request; `reply(result)` runs at `src` if the answer gets back."""
        self.net.send(src, ENDPOINT, self._handle, src, op, args, reply)

    def _handle(
        self, src: str, op: str, args: tuple[Any, ...], reply: Callable[[Any], None] | None
    ) -> None:
        result = getattr(self, op)(*args)
        self.sched.record("etcd", src, op, self.revision)
        if reply is not None:
            self.net.send(ENDPOINT, src, reply, result)

    # -- leases ---------------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        assert ttl_s >= 1, ttl_s
        self._next_lease += 1
        lease_id = self._next_lease
        self.leases[lease_id] = Lease(ttl_s, self.sched.now + ttl_s)
        self.sched.at(self.sched.now + ttl_s, self._expire, lease_id)
        return lease_id

    def keep_alive(self, lease_id: int) -> int:
        lease = self.leases.get(lease_id)
        if lease is None:
            return 0
        lease.expires_at = self.sched.now + lease.ttl_s
        self.sched.at(lease.expires_at, self._expire, lease_id)
        return lease.ttl_s

    def revoke(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        self._delete_keys(lease)
        return True

    def _expire(self, lease_id: int) -> None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.expires_at > self.sched.now:
            return  # renewed since (its own event follows) or gone
        del self.leases[lease_id]
        self.sched.record("etcd", "expired", lease_id)
        self._delete_keys(lease)

    def _delete_keys(self, lease: Lease) -> None:
        if not lease.keys:
            return
        self.revision += 1
        for key in sorted(lease.keys):
            self.kv.pop(key, None)

    def leases_of(self, name: str) -> list[int]:
        """A node's leases: its membership's, and the leadership's if it leads
        (`ClusterMetadata.leases_of`: two reads)."""
        leases = []
        member = self.kv.get(f"nodes/{name}")
        if member is not None and member.lease:
            leases.append(member.lease)
        leader = self.kv.get("leader")
        if leader is not None and leader.value == name and leader.lease:
            leases.append(leader.lease)
        return leases

    # -- keys -----------------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        found = self.kv.get(key)
        return None if found is None else dataclasses.replace(found)

    def range(self, prefix: str) -> dict[str, KeyValue]:
        return {
            k: dataclasses.replace(v) for k, v in sorted(self.kv.items()) if k.startswith(prefix)
        }

    def put(self, key: str, value: Any, lease: int = 0) -> int | None:
        """Returns the revision, or None when `lease` is not alive (etcd: lease not found)."""
        return self.txn([], [("put", key, value, lease)], [])[1]

    def read_many(self, keys: tuple[str, ...], prefixes: tuple[str, ...]) -> dict[str, Any]:
        """One consistent read of several keys and prefixes (a serializable etcd txn)."""
        found: dict[str, Any] = {key: self.get(key) for key in keys}
        for prefix in prefixes:
            found[prefix] = self.range(prefix)
        found["__revision__"] = self.revision
        return found

    def txn(
        self, compares: list[Compare], success: list[Operation], failure: list[Operation]
    ) -> tuple[bool, int | None]:
        """etcd's Txn: if every compare holds, apply `success`, else `failure`, at one
        revision. Returns (succeeded, the revision after, or None if a put named a dead lease)."""
        holds = all(self._holds(compare) for compare in compares)
        operations = success if holds else failure
        for op in operations:
            if op[0] == "put" and op[3] and op[3] not in self.leases:
                return holds, None
        if operations:
            self.revision += 1
        for op in operations:
            if op[0] == "put":
                _, key, value, lease = op
                old = self.kv.get(key)
                if old is not None and old.lease and old.lease in self.leases:
                    self.leases[old.lease].keys.discard(key)
                created = old.create_revision if old is not None else self.revision
                self.kv[key] = KeyValue(value, created, self.revision, lease)
                if lease:
                    self.leases[lease].keys.add(key)
            else:
                old = self.kv.pop(op[1], None)
                if old is not None and old.lease in self.leases:
                    self.leases[old.lease].keys.discard(op[1])
        return holds, self.revision

    def _holds(self, compare: Compare) -> bool:
        target, key, expected = compare
        found = self.kv.get(key)
        if target == "mod":
            return (found.mod_revision if found else 0) == expected
        if target == "create":
            return (found.create_revision if found else 0) == expected
        assert target == "value", compare
        return (found.value if found else None) == expected
