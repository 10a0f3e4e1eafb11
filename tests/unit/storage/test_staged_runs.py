"""A write batch whose clean runs are held as columns (staged_runs.py) against the same
versions put one by one (`put_body`: the dicts alone): after every commit the two stores hold
byte-identical LMDB contents (by_seqno, by_key, vbmeta), item counts and high seqnos. The
batches mix clean runs (`put_columns`, `put_bodies`, `put_runs` over two vbuckets) with single
writes (`put_body`, `set`, `delete`) drawn from a small key pool, so a later write of a run's
key in the same batch — which moves the run into the dicts — and runs that overlap happen
often; some batches end in an exception (nothing of them may remain)."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.storage import Op, Store
from changefeed.storage.batch import CLEAN_RUN_MIN

from .test_put_bodies import Body, body_item

KEYS = [b"k%d" % n for n in range(14)]
VBUCKETS = 3

run_keys = st.lists(st.sampled_from(KEYS), min_size=CLEAN_RUN_MIN, max_size=10, unique=True)
step = st.one_of(
    st.tuples(st.just("columns"), st.integers(0, VBUCKETS - 1), run_keys),
    st.tuples(st.just("bodies"), st.integers(0, VBUCKETS - 1), run_keys),
    st.tuples(st.just("runs"), st.integers(0, VBUCKETS - 2), run_keys),
    st.tuples(st.just("set"), st.integers(0, VBUCKETS - 1), st.sampled_from(KEYS)),
    st.tuples(st.just("delete"), st.integers(0, VBUCKETS - 1), st.sampled_from(KEYS)),
)
batches = st.lists(
    st.tuples(st.lists(step, min_size=1, max_size=6), st.booleans()), min_size=1, max_size=4
)


class Abort(Exception):
    """Ends a batch with an exception: nothing of it may be committed."""


def dump(store: Store) -> tuple[list[tuple[bytes, bytes]], ...]:
    """Every pair of the databases a batch writes, as LMDB holds them."""
    with store._env.begin() as txn:
        return tuple(
            list(txn.cursor(db=db)) for db in (store._by_seqno, store._by_key, store._vbmeta)
        )


def versions(
    steps: list[tuple[str, int, object]], seqnos: dict[int, int]
) -> list[tuple[str, list[tuple[int, Body]]]]:
    """Each step's versions (vb, item), seqnos rising per vbucket from `seqnos` (updated)."""

    def item(vb: int, key: bytes, op: Op) -> tuple[int, Body]:
        seqnos[vb] += 1 + len(key) % 2  # gaps, as after deduplication
        return vb, body_item(seqnos[vb], key, op, b"value-%d" % seqnos[vb])

    out = []
    for kind, vb, what in steps:
        if kind == "runs":  # one run in vb, another in vb + 1, put together
            keys = list(what)  # type: ignore[call-overload]
            out.append((kind, [item(vb + n % 2, key, Op.MUTATION) for n, key in enumerate(keys)]))
        elif kind in ("columns", "bodies"):
            out.append((kind, [item(vb, key, Op.MUTATION) for key in what]))  # type: ignore[attr-defined]
        else:
            op = Op.MUTATION if kind == "set" else Op.DELETION
            out.append((kind, [item(vb, what, op)]))  # type: ignore[arg-type]
    return out


def put(batch: Store.WriteBatch, kind: str, items: list[tuple[int, Body]]) -> None:
    """The step through the method it names."""
    vb = items[0][0]
    if kind == "columns":
        bodies = [it for _, it in items]
        batch.put_columns(
            vb, [it.seqno for it in bodies], [it.key for it in bodies],
            [it.body for it in bodies], [it.cas for it in bodies],
            [it.datatype for it in bodies],
        )  # fmt: skip
    elif kind == "bodies":
        batch.put_bodies(vb, [it for _, it in items])
    elif kind == "runs":
        runs = [(v, [it for at, it in items if at == v]) for v in (vb, vb + 1)]
        batch.put_runs(sorted((v, run) for v, run in runs if run))
    else:
        one_by_one(batch, items)


def one_by_one(batch: Store.WriteBatch, items: list[tuple[int, Body]]) -> None:
    for vb, it in items:
        batch.put_body(vb, it.key, it.seqno, it.op, datatype=it.datatype, cas=it.cas, body=it.body)


def open_store(path: Path) -> Store:
    store = Store(path, durable=False)
    with store.write_batch() as batch:
        for vb in range(VBUCKETS):
            batch.set_vbucket_meta(vb, state="replica", failover_log=[(7, 0)])
    return store


@settings(max_examples=80, deadline=None, derandomize=True)
@given(batches)
def test_runs_held_as_columns_write_what_one_by_one_writes(
    tmp_path_factory: pytest.TempPathFactory,
    batches: list[tuple[list[tuple[str, int, object]], bool]],
) -> None:
    columns, single = (open_store(tmp_path_factory.mktemp(name)) for name in ("cols", "one"))
    seqnos = dict.fromkeys(range(VBUCKETS), 0)
    with columns, single:
        for steps, aborts in batches:
            planned = versions(steps, seqnos)
            for store, whole in ((columns, True), (single, False)):
                with pytest.raises(Abort) if aborts else _no_error(), store.write_batch() as b:
                    for kind, items in planned:
                        put(b, kind, items) if whole else one_by_one(b, items)
                    if aborts:
                        raise Abort
            if aborts:  # the seqnos of an aborted batch may be used again
                seqnos = {vb: single.high_seqno(vb) for vb in range(VBUCKETS)}
            assert dump(columns) == dump(single)
            for vb in range(VBUCKETS):
                assert columns.item_count(vb) == single.item_count(vb), vb
                assert columns.high_seqno(vb) == single.high_seqno(vb), vb
            columns._check_invariants()


class _no_error:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def test_a_later_write_of_a_runs_key_replaces_it_in_the_same_batch(tmp_path: Path) -> None:
    """Explicit: a clean run, then a single write of its third key, then a clean run that
    overlaps the first (it goes one by one): the newest version of each key is stored."""
    with open_store(tmp_path / "s") as store:
        keys = [b"a%d" % n for n in range(CLEAN_RUN_MIN + 2)]
        first = [body_item(seqno, key, Op.MUTATION, b"one") for seqno, key in enumerate(keys, 1)]
        with store.write_batch() as batch:
            batch.put_bodies(0, first)
            batch.delete(0, keys[2], len(keys) + 1, cas=9)
            again = [
                body_item(seqno, key, Op.MUTATION, b"two")
                for seqno, key in enumerate(keys[3:], len(keys) + 2)
            ]
            batch.put_bodies(0, again)
            held = [*first[:2], *again]  # the first run's a2.. were replaced
            assert batch.stored_bytes == sum(12 + len(it.body) for it in held) + 12 + 21 + 2
        assert store.get(0, keys[2]).op is Op.DELETION  # type: ignore[union-attr]
        assert store.get(0, keys[0]).value == b"one"  # type: ignore[union-attr]
        assert store.get(0, keys[-1]).value == b"two"  # type: ignore[union-attr]
        assert store.item_count(0) == len(keys) - 1
        store._check_invariants()


def test_lmdb_is_not_touched_before_apply(tmp_path: Path) -> None:
    """A batch with a clean run held as columns that ends in an exception leaves nothing."""
    with open_store(tmp_path / "s") as store:
        before = dump(store)
        items = [body_item(s, b"k%d" % s, Op.MUTATION, b"v") for s in range(1, 10)]
        with pytest.raises(Abort), store.write_batch() as batch:
            batch.put_bodies(1, items)
            raise Abort
        assert dump(store) == before
        assert store.high_seqno(1) == 0
        assert isinstance(store._env, lmdb.Environment)


def test_a_write_moves_the_run_that_holds_its_key_not_another(tmp_path: Path) -> None:
    """A review's mutant (move the vbucket's first held run whatever key is written) passed
    the twin, whose key pool rarely makes two disjoint runs in one vbucket: a0.. then b0..,
    then a write of b2; the newest version of every key is stored, each once."""
    with open_store(tmp_path / "s") as store:
        a = [body_item(s, b"a%d" % s, Op.MUTATION, b"a") for s in range(1, 7)]
        b = [body_item(s, b"b%d" % s, Op.MUTATION, b"b") for s in range(7, 13)]
        with store.write_batch() as batch:
            batch.put_bodies(0, a)
            batch.put_bodies(0, b)
            batch.delete(0, b[2].key, 13, cas=9)
        assert store.get(0, b[2].key).op is Op.DELETION  # type: ignore[union-attr]
        for it in [*a, *b[:2], *b[3:]]:
            got = store.get(0, it.key)
            assert got is not None and (got.seqno, got.value) == (it.seqno, it.body[-1:])
        assert store.item_count(0) == len(a) + len(b) - 1
        store._check_invariants()


def test_runs_of_vbuckets_that_do_not_rise_are_refused(tmp_path: Path) -> None:
    """A review's find: put_runs of one vbucket twice was held as one run covering it twice;
    a later write of one of its keys raised KeyError. The contract says vbuckets rise."""
    with open_store(tmp_path / "s") as store:
        first = [body_item(s, b"c%d" % s, Op.MUTATION, b"v") for s in range(1, 4)]
        second = [body_item(s, b"c%d" % s, Op.MUTATION, b"v") for s in range(4, 7)]
        refused = pytest.raises(ValueError, match=r"vbuckets \[1, 1\] do not rise")
        with refused, store.write_batch() as batch:
            batch.put_runs([(1, first), (1, second)])
        assert store.high_seqno(1) == 0
