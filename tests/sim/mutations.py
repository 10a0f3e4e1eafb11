"""Deliberately broken rules, to show the simulator catches each within the CI seed budget.

Each mutant wraps the production function it breaks and is installed with pytest's
`monkeypatch` on the function's own module (the simulator looks rules up there at call time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from changefeed.cluster import failover as cluster_failover
from changefeed.cluster import rules as cluster_rules
from changefeed.server import sync_writes


def commit_one_ack_short(real: Callable[..., bool]) -> Callable[..., bool]:
    """`durability_met` that commits with one ack fewer than it needs: the slowest replica
    (of the chain, and of the required ones) counts as holding the prepare."""

    def mutant(
        seqno: int,
        active_persisted: int,
        replica_acks: Sequence[int],
        required_acks: Sequence[int] = (),
        **kw: Any,
    ) -> bool:
        acks = sorted(replica_acks)
        if acks:
            acks[0] = max(acks[0], seqno)
        required = sorted(required_acks)
        if required:
            required[0] = max(required[0], seqno)
        if required:
            return real(seqno, active_persisted, acks, required)
        return real(seqno, active_persisted, acks)

    mutant.__wrapped__ = real  # type: ignore[attr-defined]
    return mutant


def promote_out_of_sync(real: Callable[..., Any]) -> Callable[..., Any]:
    """`plan_failover` whose eligibility ignores the in-sync record: any live replica may be
    promoted (the most advanced by its published seqno), in sync or not."""

    def mutant(current: Any, live: Any, in_sync: Any, high_seqnos: Any, **kw: Any) -> Any:
        return real(current, live, {}, high_seqnos, **{**kw, "force": True})

    mutant.__wrapped__ = real  # type: ignore[attr-defined]
    return mutant


def take_any_activation(real: Callable[..., bool]) -> Callable[..., bool]:
    """`refuses_activation` that never refuses: a node restarted after the map made it a
    vbucket's active takes the vbucket with whatever its disk kept (issue 25's crash race)."""

    def mutant(*args: Any, **kw: Any) -> bool:
        return False

    mutant.__wrapped__ = real  # type: ignore[attr-defined]
    return mutant


MUTANTS: dict[str, tuple[Any, str, Callable[[Callable[..., Any]], Callable[..., Any]]]] = {
    "commit_one_ack_short": (sync_writes, "durability_met", commit_one_ack_short),
    "promote_out_of_sync": (cluster_failover, "plan_failover", promote_out_of_sync),
    "take_any_activation": (cluster_rules, "refuses_activation", take_any_activation),
}
