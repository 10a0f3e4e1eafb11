"""WriteBatch.put_bodies (the flusher's run of one vbucket) against put_body one by one: the
same store after commit, records and metadata; a bad item refuses like put_body does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.dcp_items import DELETION_V2_EXTRAS, MUTATION_EXTRAS
from changefeed.storage import Op, Store


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


def snapshot(store: Store, vb: int) -> tuple[list[object], object]:
    records = [
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


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dataclasses.replace(body_item(3, b"k", Op.MUTATION, b"v"), seqno=2), "high seqno"),
        (dataclasses.replace(body_item(4, b"k", Op.MUTATION, b"v"), datatype=8), "datatype"),
        (dataclasses.replace(body_item(4, b"k", Op.MUTATION, b"v"), cas=-1), "out of range"),
    ],
)
def test_a_bad_item_refuses_and_keeps_the_items_before_it(
    tmp_path: Path, bad: object, message: str
) -> None:
    good = body_item(3, b"g", Op.MUTATION, b"good")
    with fresh_store(tmp_path) as store:
        with store.write_batch() as batch:
            with pytest.raises(ValueError, match=message):
                batch.put_bodies(0, [good, bad])  # type: ignore[list-item]
            batch.put_bodies(0, [body_item(4, b"after", Op.MUTATION, b"a")])  # 3 was taken
        assert [r.key for r in store.scan(0, 0, store.high_seqno(0))] == [b"k1", b"g", b"after"]


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (dataclasses.replace(body_item(4, b"k", Op.MUTATION, b"v"), key=b"x"), "does not hold"),
        (dataclasses.replace(body_item(4, b"k", Op.MUTATION, b"v"), seqno=5), "another seqno"),
    ],
)
def test_a_body_that_does_not_hold_its_key_and_seqno(
    tmp_path: Path, bad: Body, message: str
) -> None:
    """put_body checks the body; put_bodies relies on the BodyItem contract (the checkpoint
    builds bodies from the fields) and asserts it at a run's ends."""
    with fresh_store(tmp_path) as store, store.write_batch() as batch:
        with pytest.raises(ValueError, match=message):
            batch.put_body(
                0, bad.key, bad.seqno, bad.op, datatype=bad.datatype, cas=bad.cas, body=bad.body
            )
        with pytest.raises(AssertionError):
            batch.put_bodies(0, [body_item(3, b"g", Op.MUTATION, b"good"), bad])
