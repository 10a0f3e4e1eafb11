"""WriteBatch.put_bodies (the flusher's run of one vbucket) against put_body one by one: the
same store after commit, records and metadata; a bad item refuses like put_body does."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.dcp_items import DELETION_V2_EXTRAS, MUTATION_EXTRAS
from changefeed.storage import Op, Store
from changefeed.storage.batch import CLEAN_RUN_MIN


@dataclasses.dataclass(frozen=True)
class Body:
    """What put_bodies reads of an item (storage's BodyItem): fields and the encoded body."""

    key: bytes
    seqno: int
    op: Op
    datatype: int
    cas: int
    body: bytes


def body_item(seqno: int, key: bytes, op: Op, value: bytes, *, datatype: int = 0) -> Body:
    if op is Op.MUTATION:
        extras = MUTATION_EXTRAS.pack(seqno, 1 + seqno % 3, seqno % 7, 0, 0, 0, 0)
    else:
        extras = DELETION_V2_EXTRAS.pack(seqno, 2, 1_700_000_000 + seqno, 0)
    return Body(key, seqno, op, datatype, 10_000 + seqno, extras + key + value)


def snapshot(store: Store, vb: int) -> tuple[list[tuple[object, ...]], object]:
    records: list[tuple[object, ...]] = [
        (r.seqno, r.key, r.op, r.value, r.cas, r.rev_seqno, r.flags, r.datatype, r.delete_time)
        for r in store.scan(vb, 0, store.high_seqno(vb))
    ]
    return records, store.vbucket_meta(vb)


def fresh_store(path: Path) -> Store:
    store = Store(path, durable=False)
    with store.write_batch() as batch:
        batch.set_vbucket_meta(0, state="replica", failover_log=[(7, 0)])
        batch.set(0, b"k1", 1, b"before", cas=5)  # a committed version the run may replace
    return store


changes = st.lists(
    st.tuples(
        st.sampled_from([b"k1", b"k2", b"k3", b"long-key-" * 3]),
        st.sampled_from([Op.MUTATION, Op.DELETION, Op.EXPIRATION]),
        st.binary(max_size=30),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(changes=changes)
def test_put_bodies_writes_what_put_body_writes_one_by_one(
    tmp_path_factory: pytest.TempPathFactory, changes: list[tuple[bytes, Op, bytes, int]]
) -> None:
    items = [
        body_item(seqno, key, op, value, datatype=datatype)
        for seqno, (key, op, value, datatype) in enumerate(changes, 2)
    ]
    one, run = (fresh_store(tmp_path_factory.mktemp(name)) for name in ("one", "run"))
    with one, run:
        with one.write_batch() as batch:
            for it in items:
                batch.put_body(
                    0, it.key, it.seqno, it.op, datatype=it.datatype, cas=it.cas, body=it.body
                )
        with run.write_batch() as batch:
            batch.put_bodies(0, items)
        assert snapshot(run, 0) == snapshot(one, 0)
        assert run.item_count(0) == one.item_count(0)
        one._check_invariants()
        run._check_invariants()


def _bad_key(seqno: int) -> Body:
    return dataclasses.replace(body_item(seqno, b"k", Op.MUTATION, b"v"), key=b"x")


def _bad_seqno(seqno: int) -> Body:
    return dataclasses.replace(body_item(seqno, b"k", Op.MUTATION, b"v"), seqno=seqno + 1)


@pytest.mark.parametrize(
    ("bad", "message"), [(_bad_key, "does not hold"), (_bad_seqno, "another seqno")]
)
def test_a_body_that_does_not_hold_its_key_and_seqno(
    tmp_path: Path, bad: Callable[[int], Body], message: str
) -> None:
    """put_body checks the body, and so does put_bodies for a run too short for the
    whole-run passes; a longer run relies on the BodyItem contract (the checkpoint builds
    bodies from the fields) and checks it at the run's ends, refusing as put_body does (not
    an assert: it holds under python -O too). So does put_runs, per run."""
    with fresh_store(tmp_path / "short") as store, store.write_batch() as batch:
        item = bad(4)
        with pytest.raises(ValueError, match=message):
            batch.put_body(
                0, item.key, item.seqno, item.op, datatype=item.datatype, cas=item.cas,
                body=item.body,
            )  # fmt: skip
        with pytest.raises(ValueError, match=message):
            batch.put_bodies(0, [body_item(3, b"g", Op.MUTATION, b"good"), item])
    with fresh_store(tmp_path / "long") as store, store.write_batch() as batch:
        good = [body_item(seqno, b"g%d" % seqno, Op.MUTATION, b"good") for seqno in range(3, 14)]
        assert len(good) >= CLEAN_RUN_MIN
        with pytest.raises(ValueError, match=message):
            batch.put_bodies(0, [*good, bad(14)])
    with fresh_store(tmp_path / "runs") as store, store.write_batch() as batch:
        batch.set_vbucket_meta(1, state="active")
        short = [
            body_item(3, b"s", Op.MUTATION, b"ok"),
            bad(4),
            body_item(5, b"t", Op.MUTATION, b"ok"),
        ]
        with pytest.raises(ValueError, match=message):  # in the middle of a short run
            batch.put_runs([(0, short), (1, [body_item(1, b"u", Op.MUTATION, b"ok")])])


def multi_store(path: Path, vbuckets: int) -> Store:
    store = Store(path, durable=False)
    with store.write_batch() as batch:
        for vb in range(vbuckets):
            batch.set_vbucket_meta(vb, state="active", failover_log=[(7, 0)])
        batch.set(1, b"k1", 1, b"before", cas=5)  # a committed version a run may replace
    return store


# Per vbucket (0..3, rising), a run of changes; a run may repeat a key (not clean) or carry a
# datatype out of range (refused).
vb_runs = st.lists(
    st.tuples(st.integers(0, 3), changes), min_size=1, max_size=4, unique_by=lambda r: r[0]
).map(sorted)


@settings(max_examples=80, deadline=None)
@given(runs=vb_runs, bad_datatype=st.booleans())
def test_put_runs_writes_what_put_bodies_writes_per_vbucket(
    tmp_path_factory: pytest.TempPathFactory,
    runs: list[tuple[int, list[tuple[bytes, Op, bytes, int]]]],
    bad_datatype: bool,
) -> None:
    """A flush round's runs put together: the same stores, item counts and metadata as one
    put_bodies per vbucket, and the same refusal when an item is bad."""
    items = [
        (vb, [
            body_item(seqno, key, op, value, datatype=datatype)
            for seqno, (key, op, value, datatype) in enumerate(changes, 2)
        ])
        for vb, changes in runs
    ]  # fmt: skip
    if bad_datatype:
        vb, last = items[-1]
        last[-1] = dataclasses.replace(last[-1], datatype=0x80)
    each, together = (multi_store(tmp_path_factory.mktemp(n), 4) for n in ("each", "together"))
    with each, together:
        errors: list[str] = []
        for store, put in (
            (each, lambda b: [b.put_bodies(vb, run) for vb, run in items]),
            (together, lambda b: b.put_runs(items)),
        ):
            try:
                with store.write_batch() as batch:
                    put(batch)
            except ValueError as error:
                errors.append(str(error))
        assert len(errors) in (0, 2) and len(set(errors)) <= 1, errors
        assert bool(errors) == bad_datatype
        for vb in range(4):
            assert snapshot(together, vb) == snapshot(each, vb)
            assert together.item_count(vb) == each.item_count(vb)
        together._check_invariants()
