"""The chaos suite's checker: pure functions from what a run recorded and the final states to
counts that must all be zero, in the style of Jepsen's checkers (lost-write, nonmonotonic-poll,
unseen; ``../shared/reference/replication-anchors.md`` §1.8).

1. ``check_writes``: every write acknowledged at a durable level (majority...) is in the final
   store with its value or a later one. Jepsen's rules for what a write may have done: an
   acknowledged write took effect; a definitely failed one did not; an ambiguous one may
   have, at any moment up to the end (so a final value from an ambiguous write never counts
   as stale). Writes acknowledged without durability may be lost by a failover (their active
   died before replicating them): counted, but as information.
2. ``check_replicas``: after healing, every replica copy equals its active's on every key's
   newest change and all its metadata (``support.cluster.same_copy``) and on the high seqno.
3. ``check_monotonic``: the streaming consumer's seqnos rise within each vbucket, except
   right after a rollback to a point below them.
4. ``check_state``: the consumer's and the mirror's final states hold every key of the store
   with the store's newest change (missing) and nothing else or older (stale).

``ChaosReport`` gathers the counts with the operations run and the faults injected, and prints
them with the seed that replays the schedule. Two more lines are information, not failures:
acknowledged non-durable writes lost, and writes that failed far from any fault
(``unexplained_errors``: availability, which the counts above do not judge); each fault's
line says how many writes were not ok until the next one.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from support.cluster import same_copy
from support.consumer import Change

from .history import FaultRecord, Outcome, Version, WriteRecord, version_of

EXAMPLES = 5  # problems shown per count in the report


@dataclass
class WriteCheck:
    """Check 1. ``lost_durable`` and ``phantom`` fail the run; ``lost_non_durable`` is
    information (writes acknowledged without durability may be lost on failover)."""

    lost_durable: list[str] = field(default_factory=list)
    lost_non_durable: list[str] = field(default_factory=list)
    phantom: list[str] = field(default_factory=list)  # a value no write could have left
    keys: int = 0


def check_writes(writes: Iterable[WriteRecord], final: Mapping[bytes, bytes | None]) -> WriteCheck:
    """Compare each key's writes with its final value (``final``: key -> value, None or absent
    when the key does not exist at the end).

    Per key: ``durable`` = the newest version acknowledged at a durable level, ``acked`` = the
    newest acknowledged at all. The final value must be a version that was acknowledged or
    ambiguous (else ``phantom``), and not an acknowledged version older than ``durable``
    (``lost_durable``; older than ``acked`` only: ``lost_non_durable``). A missing key loses
    ``durable`` (or ``acked``). An ambiguous version may have landed late, so any ambiguous
    version is accepted as the final value.
    """
    by_key: dict[bytes, dict[int, WriteRecord]] = {}
    for write in writes:
        by_key.setdefault(write.key, {})[write.version] = write
    result = WriteCheck(keys=len(by_key))
    for key, versions in sorted(by_key.items()):
        acked = [v for v, w in versions.items() if w.outcome is Outcome.OK]
        durable = max((v for v in acked if versions[v].durable), default=0)
        newest_acked = max(acked, default=0)
        value = final.get(key)
        if value is None:
            if durable:
                result.lost_durable.append(f"{key!r}: missing, v{durable} was acked durable")
            elif newest_acked:
                result.lost_non_durable.append(f"{key!r}: missing, v{newest_acked} was acked")
            continue
        found = version_of(key, value)
        winner = versions.get(found) if found is not None else None
        if found is None or winner is None or winner.outcome is Outcome.FAILED:
            what = "never written" if winner is None else f"failed: {winner.error}"
            result.phantom.append(f"{key!r}: final value {value[:40]!r} ({what})")
            continue
        if winner.outcome is Outcome.AMBIGUOUS:
            continue  # it may have taken effect after any later write
        if found < durable:
            result.lost_durable.append(f"{key!r}: final v{found}, v{durable} was acked durable")
        elif found < newest_acked:
            result.lost_non_durable.append(f"{key!r}: final v{found}, v{newest_acked} was acked")
    return result


@dataclass(frozen=True, slots=True)
class Copy:
    """One node's copy of one vbucket after healing: key -> newest change (DCP from that
    node, ``follow_map=False``), its high seqno and its purge seqno."""

    node: str
    changes: Mapping[bytes, Change]
    high_seqno: int
    purge_seqno: int = 0


def check_replicas(copies: Mapping[int, tuple[Copy, Sequence[Copy]]]) -> list[str]:
    """Check 2: per vbucket ``(active, replicas)``; one problem per replica copy that differs
    from its active (high seqno, or any key's newest change and its metadata)."""
    problems = []
    for vb, (active, replicas) in sorted(copies.items()):
        for replica in replicas:
            differ = same_copy(
                dict(active.changes), active.purge_seqno, dict(replica.changes), replica.purge_seqno
            )
            if replica.high_seqno != active.high_seqno:
                differ.insert(0, f"high seqno {replica.high_seqno} vs {active.high_seqno}")
            if differ:
                problems.append(
                    f"vb {vb}: {replica.node} differs from active {active.node} "
                    f"({len(differ)}): {differ[:2]}"
                )
    return problems


def check_monotonic(timelines: Mapping[int, Sequence[tuple[str, int]]]) -> list[str]:
    """Check 3: within each vbucket, every item's seqno is above the previous item's, or above
    the rollback point received since (a rollback lowers the bar to its seqno)."""
    problems = []
    for vb, timeline in sorted(timelines.items()):
        last = 0
        for position, (kind, seqno) in enumerate(timeline):
            if kind == "rollback":
                last = min(last, seqno)
            elif seqno <= last:
                problems.append(f"vb {vb}: seqno {seqno} after {last} (event {position})")
            else:
                last = seqno
    return problems


@dataclass
class StateCheck:
    """Check 4 for one reader: keys of the store it lacks, and keys it holds with another
    change than the store's newest (or that the store does not hold)."""

    missing: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)


def check_state(truth: Mapping[bytes, Version], got: Mapping[bytes, Version]) -> StateCheck:
    """Compare a reader's final state with the store's (``truth``, from each vbucket's active).

    A key deleted in the store may be absent from the reader (a mirror holds no tombstones, a
    consumer may never have seen a purged one); otherwise every field of ``Version`` must be
    equal."""
    result = StateCheck()
    for key in sorted(set(truth) | set(got)):
        want, have = truth.get(key), got.get(key)
        if want == have:
            continue
        if have is None:
            if want is not None and not want.deleted:
                result.missing.append(f"{key!r}: store {want}")
            continue
        if want is None and have.deleted:
            continue
        result.stale.append(f"{key!r}: store {want}, reader {have}")
    return result


def unexplained_errors(
    writes: Iterable[WriteRecord], faults: Iterable[FaultRecord], *, grace_s: float = 10.0
) -> list[WriteRecord]:
    """Writes that failed or were ambiguous while no fault was under way, nor had ended less
    than ``grace_s`` before (a restarted node catches up, a failover settles). Not a safety
    count, information for availability: a healthy cluster should take every write."""
    windows = [(f.at_s, f.healed_s + grace_s) for f in faults]
    return [
        w
        for w in writes
        if w.outcome is not Outcome.OK
        and not any(start <= w.ended_s and w.started_s <= end for start, end in windows)
    ]


@dataclass
class ChaosReport:
    """Everything the run prints: the seed, the operations, the faults, and the counts."""

    seed: int
    schedule: str
    durability: str
    writes: Sequence[WriteRecord] = ()
    faults: Sequence[FaultRecord] = ()
    write_check: WriteCheck = field(default_factory=WriteCheck)
    replica_problems: list[str] = field(default_factory=list)
    monotonic_problems: list[str] = field(default_factory=list)
    consumer: StateCheck = field(default_factory=StateCheck)
    mirror: StateCheck | None = None  # None: no mirror in this run
    healed_s: float | None = None  # when every node was running again, after the last fault
    notes: list[str] = field(default_factory=list)
    # More counts that must be zero, from other checkers (the test hosts' SDK writer: lost
    # CAS updates...): name -> the problems found.
    extra: dict[str, list[str]] = field(default_factory=dict)
    replay: str = ""  # the command that replays this run (printed with the seed)

    def counts(self) -> dict[str, int]:
        """The counts that must be zero."""
        out = {
            "lost acknowledged durable writes": len(self.write_check.lost_durable),
            "phantom values (never written, or failed)": len(self.write_check.phantom),
            "replica copies diverging from their active": len(self.replica_problems),
            "consumer non-monotonic seqnos": len(self.monotonic_problems),
            "keys missing from the consumer": len(self.consumer.missing),
            "keys stale in the consumer": len(self.consumer.stale),
        }
        if self.mirror is not None:
            out["keys missing from the mirror"] = len(self.mirror.missing)
            out["keys stale in the mirror"] = len(self.mirror.stale)
        out.update({name: len(problems) for name, problems in self.extra.items()})
        return out

    @property
    def failed(self) -> bool:
        return any(self.counts().values())

    def operations(self) -> dict[str, int]:
        found = Counter(w.outcome.value for w in self.writes)
        return {o.value: found.get(o.value, 0) for o in Outcome}

    def _errors_per_fault(self) -> list[int]:
        """Writes not ok that started after each fault and before the next one."""
        starts = [f.at_s for f in self.faults]
        counts = [0] * len(starts)
        for write in self.writes:
            if write.outcome is Outcome.OK:
                continue
            index = bisect.bisect_right(starts, write.started_s) - 1
            if index >= 0:
                counts[index] += 1
        return counts

    def render(self) -> str:
        lines = [
            f"chaos run: schedule {self.schedule}, durability {self.durability}, seed {self.seed}"
            f" (replay: {self.replay or f'CHANGEFEED_CHAOS_SEED={self.seed}'})",
            "operations: "
            + ", ".join(f"{n} {k}" for k, n in self.operations().items())
            + f" ({len(self.writes)} writes over {self.write_check.keys} keys)",
            f"faults injected ({len(self.faults)}): "
            + ", ".join(f"{n} {k}" for k, n in Counter(f.kind for f in self.faults).items()),
            *(
                f"  {fault}  -> {errors} writes not ok until the next fault"
                for fault, errors in zip(self.faults, self._errors_per_fault(), strict=True)
            ),
        ]
        examples = {
            "lost acknowledged durable writes": self.write_check.lost_durable,
            "phantom values (never written, or failed)": self.write_check.phantom,
            "replica copies diverging from their active": self.replica_problems,
            "consumer non-monotonic seqnos": self.monotonic_problems,
            "keys missing from the consumer": self.consumer.missing,
            "keys stale in the consumer": self.consumer.stale,
        }
        if self.mirror is not None:
            examples["keys missing from the mirror"] = self.mirror.missing
            examples["keys stale in the mirror"] = self.mirror.stale
        examples.update(self.extra)
        for name, count in self.counts().items():
            lines.append(f"{'FAIL' if count else 'ok  '} {count:6d} {name}")
            lines.extend(f"         e.g. {p}" for p in examples[name][:EXAMPLES])
        lost = self.write_check.lost_non_durable
        lines.append(f"info {len(lost):6d} acknowledged non-durable writes lost (allowed)")
        lines.extend(f"         e.g. {p}" for p in lost[:EXAMPLES])
        calm = unexplained_errors(self.writes, self.faults)
        lines.append(f"info {len(calm):6d} writes not ok more than 10 s after any fault")
        lines.extend(
            f"         e.g. {w.key!r} v{w.version} {w.outcome.value} {w.error} "
            f"at {w.started_s:.1f}-{w.ended_s:.1f}s"
            for w in calm[:EXAMPLES]
        )
        if self.healed_s is not None:
            after = [
                w
                for w in self.writes
                if w.outcome is not Outcome.OK and w.started_s >= self.healed_s
            ]
            lines.append(
                f"info {len(after):6d} writes not ok after every node was healed "
                f"(at {self.healed_s:.1f}s)"
            )
            lines.extend(
                f"         e.g. {w.key!r} v{w.version} {w.outcome.value} {w.error} "
                f"at {w.started_s:.1f}s"
                for w in after[:EXAMPLES]
            )
        if self.mirror is None:
            lines.append("info        mirror not run")
        lines.extend(f"note {note}" for note in self.notes)
        return "\n".join(lines)
