"""WriteBatch.put_columns (a replica's run of mutations kept as columns) against put_body one
by one: the same store after commit (records, item count, metadata), and the same refusal,
naming the same item, when one is bad (a key not in its body, a body saying another seqno, a
datatype or CAS out of range, a seqno not above the high seqno)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.dcp_items import MUTATION_EXTRAS
from changefeed.storage import Op
from changefeed.storage.batch import CLEAN_RUN_MIN

from .test_put_bodies import fresh_store, snapshot

BAD = ("none", "key", "seqno", "datatype", "cas", "old seqno")

# (key, value, datatype) per mutation; keys repeat (a run that is not clean goes one by one)
mutations = st.lists(
    st.tuples(
        st.sampled_from([b"k1", b"k2", b"k3", b"long-key-" * 3]),
        st.binary(max_size=30),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=25,
)


def columns(
    spec: list[tuple[bytes, bytes, int]], bad: str, bad_at: int, unique: bool = False
) -> tuple[list[int], list[bytes], list[bytes], list[int], list[int]]:
    """The run's columns; with `unique`, each key made distinct (a clean run, put whole
    when long enough); `bad` spoils item `bad_at` (mod the length)."""
    seqnos = list(range(2, 2 + len(spec)))
    keys = [key + b"-%d" % n if unique else key for n, (key, _, _) in enumerate(spec)]
    spec = [(key, value, datatype) for key, (_, value, datatype) in zip(keys, spec, strict=True)]
    extras = [MUTATION_EXTRAS.pack(s, 1 + s % 3, s % 7, 0, 0, 0, 0) for s in seqnos]
    bodies = [e + key + value for e, (key, value, _) in zip(extras, spec, strict=True)]
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
        bodies[at] = MUTATION_EXTRAS.pack(seqnos[at] + 1, 1, 0, 0, 0, 0, 0) + bodies[at][31:]
    elif bad == "datatype":
        datatypes[at] = 0x80
    elif bad == "cas":
        cases[at] = 2**64
    elif bad == "old seqno":
        seqnos[0] = 1  # the store holds seqno 1 already; the body says 1 too
        bodies[0] = MUTATION_EXTRAS.pack(1, 1, 0, 0, 0, 0, 0) + bodies[0][31:]
    return seqnos, keys, bodies, cases, datatypes


@settings(max_examples=150, deadline=None, derandomize=True)
@given(spec=mutations, bad=st.sampled_from(BAD), bad_at=st.integers(0, 30), unique=st.booleans())
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
        assert snapshot(run, 0) == snapshot(one, 0)
        assert run.item_count(0) == one.item_count(0)
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
        assert snapshot(run, 0) == snapshot(one, 0)
        assert len(snapshot(run, 0)[0]) == 21  # and the one stored before
