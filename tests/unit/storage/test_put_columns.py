"""WriteBatch.put_columns (a replica's run of mutations kept as columns) against put_body one
by one: the same store after commit (records with every field, item count, metadata), and the
same refusal, naming the same item, when one is bad (a key not in its body, a body saying
another seqno, a datatype or CAS out of range, a seqno not above the high seqno). The bodies'
extras carry non-zero rev seqnos, flags and expiries, which the store reads back from them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.dcp_items import MUTATION_EXTRAS
from changefeed.storage import Op, Record, Store, VBucketMeta
from changefeed.storage.batch import CLEAN_RUN_MIN

from .test_put_bodies import fresh_store

BAD = ("none", "key", "seqno", "datatype", "cas", "old seqno")

# (key, value, datatype) per mutation; keys repeat (a run that is not clean goes one by one).
# The length is drawn first, evenly: left to st.lists, most runs were shorter than
# CLEAN_RUN_MIN and no example took the whole-run path.
mutations = st.integers(1, 25).flatmap(
    lambda n: st.lists(
        st.tuples(
            st.sampled_from([b"k1", b"k2", b"k3", b"long-key-" * 3]),
            st.binary(max_size=30),
            st.integers(0, 7),
        ),
        min_size=n,
        max_size=n,
    )
)


def snapshot(store: Store) -> tuple[list[Record], VBucketMeta | None, int]:
    """Every record of vbucket 0 (compared whole: each field and the body), its metadata and
    item count."""
    records = list(store.scan(0, 0, store.high_seqno(0)))
    return records, store.vbucket_meta(0), store.item_count(0)


def extras(seqno: int) -> bytes:
    """A mutation's extras with every field non-zero and differing by seqno."""
    return MUTATION_EXTRAS.pack(
        seqno, 2**40 + seqno, 0xDEAD_0000 + seqno, 1_700_000_000 + seqno, 0, 0, 0
    )


def columns(
    spec: list[tuple[bytes, bytes, int]], bad: str, bad_at: int, unique: bool = False
) -> tuple[list[int], list[bytes], list[bytes], list[int], list[int]]:
    """The run's columns; with `unique`, each key made distinct (a clean run, put whole
    when long enough); `bad` spoils item `bad_at` (mod the length)."""
    seqnos = list(range(2, 2 + len(spec)))
    keys = [key + b"-%d" % n if unique else key for n, (key, _, _) in enumerate(spec)]
    spec = [(key, value, datatype) for key, (_, value, datatype) in zip(keys, spec, strict=True)]
    bodies = [extras(s) + key + value for s, (key, value, _) in zip(seqnos, spec, strict=True)]
    cases = [10_000 + s for s in seqnos]
    datatypes = [datatype for _, _, datatype in spec]
    at = bad_at % len(spec)
    if bad in ("key", "seqno") and len(spec) >= CLEAN_RUN_MIN:
        # A long run's bodies hold their keys and seqnos by construction (the decoder read
        # those from them), checked at its ends only, as put_bodies checks BodyItems.
        at = 0 if bad_at % 2 else len(spec) - 1
    if bad == "key":
        keys[at] = b"not-" + keys[at]
    elif bad == "seqno":
        bodies[at] = extras(seqnos[at] + 1) + bodies[at][31:]
    elif bad == "datatype":
        datatypes[at] = 0x80
    elif bad == "cas":
        cases[at] = 2**64
    elif bad == "old seqno":
        seqnos[0] = 1  # the store holds seqno 1 already; the body says 1 too
        bodies[0] = extras(1) + bodies[0][31:]
    return seqnos, keys, bodies, cases, datatypes


@settings(max_examples=150, deadline=None, derandomize=True)
# Half the examples clean: only a clean long run takes the whole-run path to the end.
@given(
    spec=mutations,
    bad=st.one_of(st.just("none"), st.sampled_from(BAD)),
    bad_at=st.integers(0, 30),
    unique=st.booleans(),
)
def test_put_columns_writes_what_put_body_writes_one_by_one(
    tmp_path_factory: pytest.TempPathFactory,
    spec: list[tuple[bytes, bytes, int]],
    bad: str,
    bad_at: int,
    unique: bool,
) -> None:
    seqnos, keys, bodies, cases, datatypes = columns(spec, bad, bad_at, unique)
    one, run = (fresh_store(tmp_path_factory.mktemp(name)) for name in ("one", "run"))
    errors: list[str] = []
    with one, run:
        for store, put in (
            (one, lambda batch: [
                batch.put_body(0, k, s, Op.MUTATION, datatype=d, cas=c, body=b)
                for s, k, b, c, d in zip(seqnos, keys, bodies, cases, datatypes, strict=True)
            ]),
            (run, lambda batch: batch.put_columns(0, seqnos, keys, bodies, cases, datatypes)),
        ):  # fmt: skip
            try:
                with store.write_batch() as batch:
                    put(batch)
            except ValueError as error:
                errors.append(str(error))
        assert len(errors) in (0, 2) and len(set(errors)) <= 1, errors  # the same item named
        assert bool(errors) == (bad != "none")
        assert snapshot(run) == snapshot(one)
        one._check_invariants()
        run._check_invariants()


def test_a_long_clean_run_goes_in_whole(tmp_path: Path) -> None:
    """Twenty new keys (the whole-run path): every record as put_body stores it."""
    spec = [(b"key-%d" % n, b"v" * n, n % 8) for n in range(20)]
    seqnos, keys, bodies, cases, datatypes = columns(spec, "none", 0)
    one, run = (fresh_store(tmp_path / name) for name in ("one", "run"))
    with one, run:
        with one.write_batch() as batch:
            for s, k, b, c, d in zip(seqnos, keys, bodies, cases, datatypes, strict=True):
                batch.put_body(0, k, s, Op.MUTATION, datatype=d, cas=c, body=b)
        with run.write_batch() as batch:
            batch.put_columns(0, seqnos, keys, bodies, cases, datatypes)
        records = snapshot(run)[0]
        assert snapshot(run) == snapshot(one)
        assert len(records) == 21  # and the one stored before
        for record, seqno in zip(records[1:], seqnos, strict=True):
            assert (record.rev_seqno, record.flags, record.expiry) == (
                2**40 + seqno, 0xDEAD_0000 + seqno, 1_700_000_000 + seqno
            )  # fmt: skip
            assert record.cas == cases[seqno - 2] and record.datatype == datatypes[seqno - 2]


def test_columns_of_different_lengths_are_refused(tmp_path: Path) -> None:
    spec = [(b"key-%d" % n, b"v", 0) for n in range(8)]
    seqnos, keys, bodies, cases, datatypes = columns(spec, "none", 0)
    with fresh_store(tmp_path) as store, store.write_batch() as batch:
        for short in range(5):
            given: list[Sequence[object]] = [seqnos, keys, bodies, cases, datatypes]
            given[short] = given[short][:-1]
            with pytest.raises(ValueError, match="columns of different lengths"):
                batch.put_columns(0, *given)  # type: ignore[arg-type]
