"""Clients writing at every durability level and doing CAS read-modify-write on hot keys.

Each client is an endpoint of its own (so a split can put clients on both sides) with one
request outstanding at a time. It routes by the map it holds (adopting a newer one from any
NOT_MY_VBUCKET answer, and polling a random node for the map as the SDKs' config poll does),
and records what it was told in the `History` (checker.py):

- plain sets (no durability) of unique keys: acknowledged, but allowed to be lost;
- durable sets of unique keys at `majority`, `majorityAndPersistActive`, `persistToMajority`;
- CAS read-modify-write on a few hot keys: read the value and CAS, append a token of its own,
  write with that CAS and a durability level; an acknowledged update's token must survive.

A write answered AMBIGUOUS or never answered may or may not be there; neither is checked.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from changefeed.protocol.frame_info import DurabilityLevel
from changefeed.vbmap import ClusterMap, vbucket_for_key

from .node import Request

if TYPE_CHECKING:
    from .cluster import SimCluster

HOT_KEYS = (b"hot-0", b"hot-1", b"hot-2")
LEVELS = (
    DurabilityLevel.MAJORITY,
    DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
    DurabilityLevel.PERSIST_TO_MAJORITY,
)
DURABLE_TIMEOUT_S = 1.5  # the durability frame's timeout
REPLY_WAIT_S = 2.0  # the client gives up on an answer after this
RETRIES_MAX = 8


@dataclasses.dataclass(slots=True)
class Op:
    kind: str  # "plain", "durable", "rmw"
    key: bytes
    value: bytes = b""
    level: int = 0
    cas: int = 0
    token: bytes = b""
    phase: str = "write"  # rmw: "read" then "write"
    retries: int = 0


class Client:
    def __init__(self, cluster: SimCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name
        self.sched = cluster.sched
        self.rng = cluster.sched.stream(f"client:{name}")
        self.map: ClusterMap | None = None
        self.running = False
        self.op: Op | None = None
        self.req_id = 0
        self.sent_at = 0.0
        self.count = 0
        cluster.net.register(name, lambda: self.sched.now)

    def start(self, cluster_map: ClusterMap) -> None:
        self.map = cluster_map
        self.running = True
        self.sched.after(self.rng.uniform(0.0, 0.02), self._next)
        self.sched.after(1.0, self._config_poll)

    def stop(self) -> None:
        self.running = False

    # -- choosing work --------------------------------------------------------------------------

    def _next(self) -> None:
        if not self.running or self.op is not None:
            return
        self.count += 1
        roll = self.rng.random()
        config = self.cluster.config
        if roll < config.plain_share:
            key = f"{self.name}-p{self.count}".encode()
            self.op = Op("plain", key, value=b"v" + key)
        elif roll < config.plain_share + config.durable_share:
            key = f"{self.name}-d{self.count}".encode()
            self.op = Op("durable", key, value=b"v" + key, level=self.rng.choice(LEVELS))
        else:
            key = self.rng.choice(HOT_KEYS)
            token = f"{self.name}.{self.count};".encode()
            self.op = Op("rmw", key, level=self.rng.choice(LEVELS), token=token, phase="read")
        self._send()

    def _send(self) -> None:
        op = self.op
        assert op is not None and self.map is not None
        vb = vbucket_for_key(op.key, self.map.vbuckets)
        active = self.map.active(vb)
        self.req_id += 1
        self.sent_at = self.sched.now
        if active is None:
            self._retry(0.1)
            return
        if op.phase == "read":
            request = Request(self.name, self.req_id, "get", vb, op.key)
        else:
            kind = "add" if op.kind == "rmw" and not op.cas else "set"
            request = Request(
                self.name, self.req_id, kind, vb, op.key, op.value, op.cas, op.level,
                DURABLE_TIMEOUT_S,
            )  # fmt: skip
        node = self.cluster.nodes_by_name[active.name]
        self.cluster.net.send(self.name, active.name, node.on_request, request)
        self.sched.after(REPLY_WAIT_S, self._gave_up, self.req_id)

    def _retry(self, delay_s: float) -> None:
        op = self.op
        assert op is not None
        op.retries += 1
        if op.retries > RETRIES_MAX:
            self._done()
            return
        self.sched.after(delay_s, self._resend, self.req_id)

    def _resend(self, req_id: int) -> None:
        if self.op is not None and req_id == self.req_id:
            self._send()

    def _done(self) -> None:
        self.op = None
        if self.running:
            self.sched.after(self.rng.uniform(*self.cluster.config.think_s), self._next)

    # -- answers --------------------------------------------------------------------------------

    def _gave_up(self, req_id: int) -> None:
        if req_id != self.req_id or self.op is None:
            return
        self.cluster.history.unknown(self.name, self.op)
        self._config_poll_once()
        self._done()

    def on_reply(self, req_id: int, outcome: str, detail: Any) -> None:
        op = self.op
        if op is None or req_id != self.req_id:
            return  # a late or duplicated answer
        self.req_id += 1  # answers to this request are stale from now on
        history = self.cluster.history
        self.sched.record("client", self.name, req_id, outcome)
        if outcome == "nmvb":
            if isinstance(detail, ClusterMap) and (self.map is None or detail.rev > self.map.rev):
                self.map = detail
            else:
                self._config_poll_once()
            self._retry(0.02)
        elif outcome == "tmpfail":
            self._retry(0.05)
        elif outcome == "ok" and op.phase == "read":
            value, cas = detail if detail is not None else (b"", 0)
            op.value, op.cas, op.phase = value + op.token, cas, "write"
            self._send()
        elif outcome == "ok":
            history.acked(self.name, op, detail, self.sched.now)
            self._done()
        elif outcome == "cas_mismatch":
            op.phase = "read"
            self._retry(0.01)
        elif outcome == "impossible":
            self._done()
        else:  # ambiguous, error
            history.unknown(self.name, op)
            self._done()

    # -- maps -----------------------------------------------------------------------------------

    def _config_poll(self) -> None:
        if self.running:
            self._config_poll_once()
            self.sched.after(1.0, self._config_poll)

    def _config_poll_once(self) -> None:
        names = sorted(self.cluster.nodes_by_name)
        target = self.rng.choice(names)
        node = self.cluster.nodes_by_name[target]
        self.cluster.net.send(self.name, target, node.on_config, self.name)

    def on_config(self, cluster_map: ClusterMap | None) -> None:
        if cluster_map is not None and (self.map is None or cluster_map.rev > self.map.rev):
            self.map = cluster_map
