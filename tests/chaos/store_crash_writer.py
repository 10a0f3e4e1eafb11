"""The writer process of test_store_crash.py, and the plan and model both sides share.

Run as a script, it opens a store and executes steps `start, start + 1, ...` of a deterministic
plan, printing "committed i" (flushed) after step i has committed, until it is killed:

    python store_crash_writer.py PATH START DURABLE(0|1) STEPS_MAX

Step i is a pure function of i and the vbuckets' high seqnos before it (`plan_step`), so the
writer can resume on a store holding steps 0..START-1 by reading the high seqnos from it, and the
test can replay steps 0..k-1 in `Model`, a plain-dict store written without the storage code.
Most steps are one write batch; a few are a rollback or a compaction of one vbucket (each one
transaction, so every step commits atomically).
"""

from __future__ import annotations

import dataclasses
import random
import sys
from typing import Any

from changefeed.storage import Op, Store

VBS = 4
KEYS_PER_VB = 64
TOMBSTONE_AGE_S = 30  # compaction at step i purges tombstones written at steps <= i - 30
VALUE_SIZES = (0, 10, 100, 100, 1000, 5000)
LARGE_VALUE_SIZE = 300_000  # an LMDB overflow value: its commit writes ~75 pages

# A record as the model keeps it: everything a Record carries except the derived body.
Fields = tuple[int, int, bytes, int, int, int, int, int, int, bytes]  # see record_fields


@dataclasses.dataclass(frozen=True)
class Step:
    """One committed unit: a batch of ops, a rollback, or a compaction of one vbucket."""

    index: int
    kind: str  # "batch" | "rollback" | "compact"
    ops: tuple[tuple[Any, ...], ...] = ()
    vb: int = 0
    seqno: int = 0


def plan_step(index: int, highs: dict[int, int]) -> Step:
    """Step `index` given each vb's high seqno before it; the same on both sides."""
    rng = random.Random(index)
    if index == 0:
        ops = tuple(("meta", vb, "active", [(vb + 1, 0)], 0, 0) for vb in range(VBS))
        return Step(index, "batch", ops)
    roll = rng.random()
    vb = rng.randrange(VBS)
    if roll < 0.05:
        return Step(index, "rollback", vb=vb, seqno=max(0, highs[vb] - rng.randint(1, 40)))
    if roll < 0.12:
        return Step(index, "compact", vb=vb)
    return Step(index, "batch", _batch_ops(rng, index, dict(highs)))


def _batch_ops(
    rng: random.Random, index: int, highs: dict[int, int]
) -> tuple[tuple[Any, ...], ...]:
    ops: list[tuple[Any, ...]] = []
    first: dict[int, int] = {}
    for _ in range(rng.randint(1, 60)):
        vb = rng.randrange(VBS)
        key = b"key-%03d" % rng.randrange(KEYS_PER_VB)
        highs[vb] += 1
        seqno = highs[vb]
        first.setdefault(vb, seqno)
        kind = rng.random()
        if kind < 0.7:
            large = rng.random() < 0.01
            size = LARGE_VALUE_SIZE if large else rng.choice(VALUE_SIZES)
            ops.append(("set", vb, key, seqno, rng.randbytes(size), rng.getrandbits(64), index))
        else:
            ops.append(("delete", vb, key, seqno, rng.getrandbits(64), index, kind > 0.9))
    for vb, start in sorted(first.items()):
        log = [(index + 1, start), (vb + 1, 0)] if rng.random() < 0.1 else None
        ops.append(("meta", vb, None, log, start, highs[vb]))
    return tuple(ops)


def apply_to_store(store: Store, step: Step) -> None:
    """Execute one step on the store as one transaction."""
    if step.kind == "rollback":
        store.rollback(step.vb, step.seqno)
        return
    if step.kind == "compact":
        store.compact(tombstone_age_s=TOMBSTONE_AGE_S, now=step.index, vbuckets=[step.vb])
        return
    with store.write_batch() as batch:
        for op in step.ops:
            if op[0] == "set":
                _, vb, key, seqno, value, cas, flags = op
                batch.set(vb, key, seqno, value, cas=cas, flags=flags, rev_seqno=seqno)
            elif op[0] == "delete":
                _, vb, key, seqno, cas, delete_time, expiration = op
                batch.delete(
                    vb, key, seqno, cas=cas, delete_time=delete_time, expiration=expiration
                )
            else:
                _, vb, state, log, snap_start, snap_end = op
                batch.set_vbucket_meta(
                    vb, state=state, failover_log=log, snap_start=snap_start, snap_end=snap_end
                )


@dataclasses.dataclass
class ModelVb:
    state: str = ""
    failover_log: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    high_seqno: int = 0
    purge_seqno: int = 0
    snap_start: int = 0
    snap_end: int = 0
    records: dict[bytes, Fields] = dataclasses.field(default_factory=dict)


class Model:
    """The store's contract in plain dicts; `steps` is how many plan steps it has applied."""

    def __init__(self) -> None:
        self.vbs: dict[int, ModelVb] = {}
        self.steps = 0

    def highs(self) -> dict[int, int]:
        return {vb: self.vbs[vb].high_seqno if vb in self.vbs else 0 for vb in range(VBS)}

    def advance(self) -> None:
        step = plan_step(self.steps, self.highs())
        if step.kind == "rollback":
            self._rollback(self.vbs[step.vb], step.seqno)
        elif step.kind == "compact":
            self._compact(self.vbs[step.vb], step.index - TOMBSTONE_AGE_S)
        else:
            for op in step.ops:
                self._apply_op(op)
        self.steps += 1

    def _apply_op(self, op: tuple[Any, ...]) -> None:
        if op[0] == "meta":
            _, vb, state, log, snap_start, snap_end = op
            model = self.vbs.setdefault(vb, ModelVb())
            model.state = state or model.state
            model.failover_log = list(log) if log is not None else model.failover_log
            model.snap_start, model.snap_end = snap_start, snap_end
            return
        model = self.vbs[op[1]]
        if op[0] == "set":
            _, vb, key, seqno, value, cas, flags = op
            fields = (seqno, int(Op.MUTATION), key, cas, flags, 0, 0, seqno, 0, value)
        else:
            _, vb, key, seqno, cas, delete_time, expiration = op
            kind = Op.EXPIRATION if expiration else Op.DELETION
            fields = (seqno, int(kind), key, cas, 0, 0, delete_time, 1, 0, b"")
        model.records[key] = fields
        model.high_seqno = seqno

    @staticmethod
    def _rollback(model: ModelVb, seqno: int) -> None:
        if seqno >= model.high_seqno:
            return
        # Store.rollback's rule: a discarded record that is not its key's first version
        # (rev_seqno > 1) cannot be undone exactly, so the vbucket goes back to 0.
        if any(r[0] > seqno and r[7] > 1 for r in model.records.values()):
            seqno = 0
        model.records = {k: r for k, r in model.records.items() if r[0] <= seqno}
        model.high_seqno = model.snap_start = model.snap_end = seqno
        model.purge_seqno = min(model.purge_seqno, seqno)

    @staticmethod
    def _compact(model: ModelVb, delete_time_max: int) -> None:
        purged = [
            r for r in model.records.values() if r[1] != Op.MUTATION and r[6] <= delete_time_max
        ]
        for record in purged:
            del model.records[record[2]]
        model.purge_seqno = max([model.purge_seqno] + [record[0] for record in purged])

    def snapshot(self) -> dict[int, tuple[Any, ...]]:
        """Per vb: metadata, live count and records in seqno order, as `store_snapshot`."""
        result = {}
        for vb, model in sorted(self.vbs.items()):
            records = sorted(model.records.values())
            live = sum(record[1] == Op.MUTATION for record in records)
            meta = (model.state, model.failover_log, model.high_seqno, model.purge_seqno,
                    model.snap_start, model.snap_end)  # fmt: skip
            result[vb] = (meta, live, records)
        return result


def store_snapshot(store: Store) -> dict[int, tuple[Any, ...]]:
    """What the store holds, in the shape of `Model.snapshot`."""
    result = {}
    for vb in store.vbuckets():
        meta = store.vbucket_meta(vb)
        assert meta is not None
        records = [record_fields(record) for record in store.scan(vb, 0, 2**64 - 1)]
        state = (meta.state, meta.failover_log, meta.high_seqno, meta.purge_seqno,
                 meta.snap_start, meta.snap_end)  # fmt: skip
        result[vb] = (state, store.item_count(vb), records)
    return result


def record_fields(record: Any) -> Fields:
    return (
        record.seqno, int(record.op), record.key, record.cas, record.flags, record.expiry,
        record.delete_time, record.rev_seqno, record.datatype, record.value,
    )  # fmt: skip


def main(argv: list[str]) -> None:
    path, start, durable, steps_max = argv[1], int(argv[2]), argv[3] == "1", int(argv[4])
    store = Store(path, durable=durable)
    print(f"opened {int(store.was_clean_shutdown)}", flush=True)
    for index in range(start, steps_max):
        highs = {vb: store.high_seqno(vb) for vb in range(VBS)}
        apply_to_store(store, plan_step(index, highs))
        print(f"committed {index}", flush=True)
    store.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv)
