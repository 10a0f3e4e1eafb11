"""Rebalance: move vbuckets onto a new set of nodes with no acknowledged write lost.

``changefeed cluster add NODE`` / ``remove NODE`` write a request (``rebalance/request`` in
etcd: the wanted node names). The orchestrator — the only map writer, every write fenced by its
leader token — drives it one step at a time (``Rebalancer.step`` from ``Orchestrator._step``),
so a rebalance survives the orchestrator: the next one reads the request, the target stored in
``rebalance/status`` and the moves in progress, which live in the map itself
(``ClusterMap.moves``), and carries on.

A vbucket whose chain changes is moved as Couchbase moves it (a replica stream, then a
takeover), each step a map revision:

1. **Copy.** The map gets a ``VbMove`` for it: nodes of the target chain that hold no copy
   yet become replicas fed by the active (node_agent starts their replica feeds); clients,
   failover and the in-sync set ignore them. It waits until every new copy, and the future
   active, has acknowledged up to ``CATCHUP_LAG_MAX`` items behind the active's high seqno
   (the active publishes its replicas' acked seqnos for moving vbuckets in its status).
2. **Takeover** (only when the active changes). The move is marked ``takeover``: the active
   sets the vbucket PENDING — it answers writes NOT_MY_VBUCKET (``KvClient`` retries), but
   its streams go on, so the future active receives every write it acknowledged. Once the
   active's status (at the current map revision: the fence is applied, its high seqno is
   final) shows the future active has acknowledged that high seqno, and the future active's
   own status shows it holds and has persisted it,
3. **Switch.** The map gets the target chain: the new active becomes ACTIVE (a new failover
   entry, as on any promotion), the old one a replica or DEAD (its streams end with
   STATE_CHANGED; consumers re-request from the new active), copies that leave go DEAD.

At most ``MOVES_MAX`` vbuckets move at once (Couchbase: 4 per node), so catch-up streams do
not starve clients. Takeovers go one at a time, and the map revisions that fence, switch or
lift one change nothing else: a replica feed is restarted when its set of vbuckets changes,
and a restarted feed cannot re-request a fenced (pending) vbucket, so no feed may change while
a vbucket is fenced.
A takeover not done in ``TAKEOVER_TIMEOUT_S`` (the future active lost its stream) is lifted —
the active takes writes again — and tried again later, so a fence never lasts.

A failover meanwhile writes a map without the moves (failover.py builds chains only): the
moves it aborts start again from the new map, and a fenced active becomes active again.
Nodes added join the map's node list first (the target names them); nodes removed leave it
once nothing is placed on them — a removed node then stops by itself (node_agent).

Why the target is stored by node *names*: indexes into the node list change when nodes are
appended or removed. Why a stored target at all: a new orchestrator must finish the same plan,
not compute a different one from a half-moved map.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from changefeed.cluster.metadata import ClusterMetadata
from changefeed.cluster.placement import rebalance_chains
from changefeed.vbmap import ClusterMap, NodeAddress, VbMove

log = logging.getLogger(__name__)

REQUEST_KEY = "rebalance/request"
STATUS_KEY = "rebalance/status"
MOVES_MAX = 4  # vbuckets moving at once (Couchbase's rebalanceMovesPerNode default is 4)
CATCHUP_LAG_MAX = 1000  # items a new copy may lag before the takeover fences writes
STEP_INTERVAL_S = 0.2  # how often the orchestrator looks while a rebalance runs
TAKEOVER_TIMEOUT_S = 5.0  # a fence not completed by then is lifted and tried again


@dataclasses.dataclass(frozen=True, slots=True)
class MovingCopy:
    """What the active of a moving vbucket published about it (node_agent ``_status``).

    Attributes:
        state: its vbucket state ("active", or "pending" once fenced).
        high: its high seqno (final once pending).
        acked: per replica streaming from it, the seqno it acknowledged as received.
    """

    state: str
    high: int
    acked: Mapping[str, int]


@dataclasses.dataclass(frozen=True, slots=True)
class NodeReport:
    """A node's published status, as far as the rebalance reads it.

    Attributes:
        rev: the map revision it has applied.
        moving: per moving vbucket it is the active of, what it says of it.
        copies: per moving vbucket it holds or builds a copy of in the move's chain, its
            (high seqno, persisted seqno).
    """

    rev: int
    moving: Mapping[int, MovingCopy]
    copies: Mapping[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @classmethod
    def parse(cls, status: Mapping[str, Any]) -> NodeReport:
        """From ``status/<name>`` (missing fields: nothing known yet)."""
        moving: dict[int, MovingCopy] = {}
        copies: dict[int, tuple[int, int]] = {}
        try:
            rev = int(status.get("rev", 0))
            for vb, info in dict(status.get("moving", {})).items():
                acked = {str(k): int(v) for k, v in dict(info["acked"]).items()}
                moving[int(vb)] = MovingCopy(str(info["state"]), int(info["high"]), acked)
            for vb, (high, persisted) in dict(status.get("copies", {})).items():
                copies[int(vb)] = (int(high), int(persisted))
        except (KeyError, TypeError, ValueError):
            return cls(0, {})
        return cls(rev, moving, copies)


@dataclasses.dataclass(frozen=True, slots=True)
class StepPlan:
    """One step: the next map (None: nothing to write now), vbuckets still to move, what the
    step waits for (one line each, for status and logs), and whether the rebalance is done."""

    new_map: ClusterMap | None
    remaining: int
    waiting: list[str]
    done: bool


def names_of(cluster_map: ClusterMap) -> list[list[str | None]]:
    """The map's chains by node name."""
    nodes = cluster_map.nodes
    return [[nodes[i].name if i != -1 else None for i in chain] for chain in cluster_map.chains]


def plan_step(
    current: ClusterMap,
    target: Sequence[Sequence[str | None]],
    target_nodes: Sequence[str],
    live: Mapping[str, NodeAddress],
    reports: Mapping[str, NodeReport],
    *,
    stalled: frozenset[int] = frozenset(),
    moves_max: int = MOVES_MAX,
    lag_max: int = CATCHUP_LAG_MAX,
) -> StepPlan:
    """The next step from `current` towards `target` (chains by name over `target_nodes`).

    Sans-IO: `live` are the registered nodes, `reports` their published statuses, `stalled`
    the vbuckets whose takeover has lasted too long (to lift). See the module docstring for
    the phases; every condition that lets a move advance is read from a status at the
    current map revision, so it reflects the map being acted on.
    """
    names = [n.name for n in current.nodes]
    missing = [n for n in target_nodes if n not in names]
    if missing:
        absent = [n for n in missing if n not in live]
        if absent:
            return StepPlan(
                None, len(target), [f"{n} is not registered in the cluster" for n in absent], False
            )
        nodes = (*current.nodes, *(live[n] for n in missing))
        grown = dataclasses.replace(current, rev=current.rev + 1, nodes=nodes)
        return StepPlan(grown, _remaining(current, target), [], False)
    index = {name: i for i, name in enumerate(names)}
    wanted = [tuple(index[n] if n is not None else -1 for n in chain) for chain in target]
    chains = list(current.chains)
    moves = {m.vb: m for m in current.moves}
    waiting: list[str] = []

    def report_of(vb: int) -> MovingCopy | None:
        """The active's word on a moving vb, if it is live and speaks of the current map."""
        active = chains[vb][0]
        if active == -1 or names[active] not in live:
            waiting.append(f"vb {vb}: its active is not live")
            return None
        report = reports.get(names[active])
        if report is None or report.rev < current.rev or vb not in report.moving:
            waiting.append(f"vb {vb}: {names[active]} has not applied map rev {current.rev}")
            return None
        return report.moving[vb]

    fenced = sorted(vb for vb, m in moves.items() if m.takeover)
    ready: list[int] = []  # copied, waiting for their takeover
    for vb, move in sorted(moves.items()):
        if fenced and not move.takeover:
            continue  # a fence is up: nothing else changes (see the module docstring)
        if move.takeover and vb in stalled:
            moves[vb] = dataclasses.replace(move, takeover=False)
            waiting.append(f"vb {vb}: takeover lifted after {TAKEOVER_TIMEOUT_S:g} s; again later")
            continue
        info = report_of(vb)
        if info is None:
            continue
        chain, new = chains[vb], move.chain
        if not move.takeover:
            # Copy phase: every new copy and the future active close to the active's end.
            # (Replicas that stay need not be: they go on from the new active.)
            checked = [
                i for i in new if i not in (-1, chain[0]) and (i not in chain or i == new[0])
            ]
            behind = [
                f"{names[i]} at {acked}"
                for i in checked
                if (acked := info.acked.get(names[i], -1)) < 0 or acked < info.high - lag_max
            ]
            if behind:
                waiting.append(f"vb {vb}: catching up to {info.high}: {', '.join(behind)}")
            elif new[0] == chain[0]:
                chains[vb] = new  # the active stays: no takeover, the chain is the target's
                del moves[vb]
            else:
                ready.append(vb)
            continue
        # Takeover: the active is fenced (pending) and the future active holds all it took,
        # by the active's tracker and by its own word, persisted (so a crash of the future
        # active now cannot lose what the old one acknowledged).
        got = info.acked.get(names[new[0]], -1)
        own = reports.get(names[new[0]])
        held = own.copies.get(vb, (-1, -1)) if own is not None and own.rev >= current.rev else None
        if info.state != "pending" or got < info.high or held is None or min(held) < info.high:
            waiting.append(
                f"vb {vb}: takeover by {names[new[0]]}: acked {got}, holds {held} of {info.high}"
            )
            continue
        chains[vb] = new
        del moves[vb]
    for vb in range(current.vbuckets):
        if fenced or len(moves) >= moves_max:
            break
        if vb in moves or chains[vb] == wanted[vb]:
            continue
        new = wanted[vb]
        absent = [names[i] for i in (chains[vb][0], *new) if i != -1 and names[i] not in live]
        if absent or chains[vb][0] == -1:
            waiting.append(f"vb {vb}: waiting for {', '.join(absent) or 'an active'}")
            continue
        if new[0] == chains[vb][0] and set(new) - {-1} <= set(chains[vb]):
            chains[vb] = new  # only copies leave (or change order): nothing to stream
        else:
            moves[vb] = VbMove(vb, new, False)
    if ready and tuple(chains) == current.chains and moves == {m.vb: m for m in current.moves}:
        # A fence goes up in a map revision that changes nothing else: no replica feed is
        # restarted while a vbucket is pending (a restarted feed could not re-request it).
        moves[ready[0]] = dataclasses.replace(moves[ready[0]], takeover=True)
        waiting.extend(f"vb {vb}: copied, waiting for another takeover" for vb in ready[1:])
    else:
        waiting.extend(f"vb {vb}: copied, its takeover next" for vb in ready)
    remaining = sum(1 for vb in range(current.vbuckets) if chains[vb] != wanted[vb])
    moved = tuple(sorted(moves.values(), key=lambda m: m.vb))
    if tuple(chains) != current.chains or moved != current.moves:
        changed = dataclasses.replace(
            current, rev=current.rev + 1, chains=tuple(chains), moves=moved
        )
        return StepPlan(changed, remaining, waiting, False)
    leaving = [n for n in names if n not in target_nodes]
    if remaining or moves:
        return StepPlan(None, remaining, waiting, False)
    if leaving:
        # Nothing is placed on the leaving nodes any more: drop them from the node list.
        kept = [i for i, n in enumerate(names) if n not in leaving]
        renumber = {old: new for new, old in enumerate(kept)}
        renumber[-1] = -1
        shrunk = ClusterMap(
            current.rev + 1,
            tuple(current.nodes[i] for i in kept),
            tuple(tuple(renumber[i] for i in chain) for chain in chains),
            current.replicas,
        )
        return StepPlan(shrunk, 0, [], False)
    return StepPlan(None, 0, [], True)


def _remaining(current: ClusterMap, target: Sequence[Sequence[str | None]]) -> int:
    return sum(1 for a, b in zip(names_of(current), target, strict=True) if a != list(b))


# -- etcd: the request and the status ----------------------------------------------------------


@dataclasses.dataclass(slots=True)
class RebalanceStatus:
    """``rebalance/status``: the orchestrator's progress on request ``id``.

    Attributes:
        id: the request it answers.
        nodes: the node names of the new map.
        target: per vbucket, the target chain by node name.
        total: vbuckets whose chain differed from the target when it began.
        moved: those that reached it.
        waiting: what the last step waited for (a few lines).
        done: the map is the target (and leaving nodes are out of it).
        rev: the map revision of the last step.
        error: why the request cannot be done (it is then abandoned).
    """

    id: str
    nodes: list[str]
    target: list[list[str | None]]
    total: int
    moved: int = 0
    waiting: list[str] = dataclasses.field(default_factory=list)
    done: bool = False
    rev: int = 0
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, document: Any) -> RebalanceStatus:
        """Raises: ValueError on a malformed document."""
        try:
            return cls(
                str(document["id"]),
                [str(n) for n in document["nodes"]],
                [[None if n is None else str(n) for n in c] for c in document["target"]],
                int(document["total"]),
                int(document["moved"]),
                [str(w) for w in document.get("waiting", [])],
                bool(document["done"]),
                int(document.get("rev", 0)),
                None if document.get("error") is None else str(document["error"]),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"not a rebalance status: {error!r}") from None


async def _get_json(metadata: ClusterMetadata, suffix: str) -> Any:
    kv = await metadata._call(metadata.client.get(metadata.key(suffix)), f"read {suffix}")
    if kv is None:
        return None
    try:
        return json.loads(kv.value)
    except ValueError:
        log.error("ignoring malformed %s", suffix)
        return None


async def _put_json(metadata: ClusterMetadata, suffix: str, document: Any) -> None:
    data = json.dumps(document, separators=(",", ":")).encode()
    await metadata._call(metadata.client.put(metadata.key(suffix), data), f"write {suffix}")


async def request_rebalance(metadata: ClusterMetadata, nodes: Sequence[str]) -> str:
    """Ask the orchestrator for a map over `nodes`; returns the request's id.

    Raises:
        MetadataUnavailableError: etcd did not answer.
    """
    request_id = uuid.uuid4().hex
    document = {"id": request_id, "nodes": sorted(set(nodes)), "at": time.time()}
    await _put_json(metadata, REQUEST_KEY, document)
    return request_id


async def read_request(metadata: ClusterMetadata) -> tuple[str, list[str]] | None:
    """The last request: (id, node names), or None."""
    document = await _get_json(metadata, REQUEST_KEY)
    try:
        return str(document["id"]), [str(n) for n in document["nodes"]]
    except (KeyError, TypeError):
        return None


async def read_status(metadata: ClusterMetadata) -> RebalanceStatus | None:
    document = await _get_json(metadata, STATUS_KEY)
    if document is None:
        return None
    try:
        return RebalanceStatus.from_json(document)
    except ValueError as error:
        log.error("%s", error)
        return None


class Rebalancer:
    """The orchestrator's rebalance driver: one ``step`` per orchestrator step."""

    def __init__(self, metadata: ClusterMetadata, candidate: str) -> None:
        self.metadata = metadata
        self.candidate = candidate
        self.running = False  # a request is being worked on (the orchestrator steps faster)
        self._logged: tuple[int, int] | None = None
        self._fenced: dict[int, float] = {}  # vb -> when its takeover was first seen

    async def step(self, live: Mapping[str, NodeAddress], current: ClusterMap) -> ClusterMap | None:
        """The next map of the rebalance requested, or None (nothing to do, or waiting).

        Raises:
            MetadataUnavailableError: etcd did not answer (the orchestrator retries).
        """
        request = await read_request(self.metadata)
        if request is None:
            self.running = False
            return None
        request_id, nodes = request
        status = await read_status(self.metadata)
        if status is not None and status.id == request_id and (status.done or status.error):
            self.running = False
            return None
        begun = status is None or status.id != request_id
        if status is None or status.id != request_id:
            status = self._begin(request_id, nodes, current)
            if status.error is not None:
                log.error("orchestrator %s: rebalance refused: %s", self.candidate, status.error)
                await _put_json(self.metadata, STATUS_KEY, status.to_json())
                self.running = False
                return None
            log.info(
                "orchestrator %s: rebalance %s to %s: %d vbuckets to move",
                self.candidate, request_id, ", ".join(status.nodes), status.total,
            )  # fmt: skip
        self.running = True
        reports = {
            name: NodeReport.parse(document)
            for name, document in (await self.metadata.node_statuses()).items()
        }
        now = time.monotonic()
        fenced = {m.vb for m in current.moves if m.takeover}
        self._fenced = {vb: self._fenced.get(vb, now) for vb in fenced}
        stalled = frozenset(
            vb for vb, since in self._fenced.items() if now - since > TAKEOVER_TIMEOUT_S
        )
        plan = plan_step(current, status.target, status.nodes, live, reports, stalled=stalled)
        before = status.to_json()
        status.moved = max(0, status.total - plan.remaining)
        status.waiting = plan.waiting[:8]
        status.done = plan.done
        status.rev = current.rev
        if begun or status.to_json() != before:
            await _put_json(self.metadata, STATUS_KEY, status.to_json())
        if (status.moved, status.total) != self._logged:
            self._logged = (status.moved, status.total)
            log.info(
                "orchestrator %s: rebalance %d/%d vbuckets moved",
                self.candidate, status.moved, status.total,
            )  # fmt: skip
        if plan.done:
            self.running = False
            log.info("orchestrator %s: rebalance %s done", self.candidate, request_id)
        return plan.new_map

    def _begin(self, request_id: str, nodes: list[str], current: ClusterMap) -> RebalanceStatus:
        """The status of a new request: its target, or an error if it cannot be done."""
        empty = RebalanceStatus(request_id, nodes, [], 0)
        if not nodes:
            empty.error = "a cluster needs at least one node"
            return empty
        try:
            target = rebalance_chains(names_of(current), nodes, current.replicas)
        except ValueError as error:
            empty.error = str(error)
            return empty
        chains = [list(chain) for chain in target]
        total = sum(1 for a, b in zip(names_of(current), chains, strict=True) if a != b)
        return RebalanceStatus(request_id, sorted(nodes), chains, total, rev=current.rev)
