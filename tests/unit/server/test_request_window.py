"""RequestWindow (server/request_window.py) against a simple model: applying its layers does
each vbucket's writes in request order, and no write of the window follows a GET of its key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.set_run import SetRun
from changefeed.server.request_window import (
    GETS_PER_WINDOW_MAX,
    RequestWindow,
    StatProviders,
    window_counters,
)

KEYS = [b"a", b"b", b"c", b"d"]
Op = tuple[str, int, bytes]  # (kind, vbucket, key)

ops = st.lists(
    st.tuples(
        st.sampled_from(["set", "set", "get", "delete"]), st.integers(0, 3), st.sampled_from(KEYS)
    ),
    max_size=60,
)


def set_run(writes: list[Op]) -> SetRun:
    return SetRun(
        [vb for _, vb, _ in writes],
        list(range(len(writes))),
        [key for _, _, key in writes],
        [b"v"] * len(writes),
        [0] * len(writes),
        [0] * len(writes),
        [0] * len(writes),
        checked=True,
    )


def frame(kind: str, vb: int, key: bytes) -> Frame:
    opcode = Opcode.GET if kind == "get" else Opcode.DELETE
    return Frame(Magic.REQUEST, opcode, vbucket=vb, key=key)


def windows(requests: list[Op]) -> list[tuple[RequestWindow, list[Op]]]:
    """Feed `requests` as the connection does (runs of SETs, single frames); a refused frame
    or a returned rest starts the next window. Each window comes with its requests."""
    out: list[tuple[RequestWindow, list[Op]]] = []
    window, taken = RequestWindow(), []
    at = 0
    while at < len(requests):
        kind, vb, key = requests[at]
        if kind == "set":
            end = at
            while end < len(requests) and requests[end][0] == "set":
                end += 1
            batch = requests[at:end]
            rest = window.add_run(set_run(batch))
            kept = len(batch) - (len(rest) if rest is not None else 0)
            taken += batch[:kept]
            if rest is not None:
                out.append((window, taken))
                window, taken = RequestWindow(), []
                assert window.add_run(rest) is None
                taken += batch[kept:]
            at = end
            continue
        request = frame(kind, vb, key)
        if not window.joins(request, request.key):
            out.append((window, taken))
            window, taken = RequestWindow(), []
            assert window.joins(request, request.key)
        window.add_frame(request, request.key)
        taken.append(requests[at])
        at += 1
    out.append((window, taken))
    return out


@settings(max_examples=300, deadline=None)
@given(ops)
def test_layers_keep_each_vbuckets_write_order(requests: list[Op]) -> None:
    fed: list[Op] = []
    for window, taken in windows(requests):
        fed += taken
        assert len(window) == len(taken)
        # Request order as the window recorded it.
        recorded = [
            ("set", window.run.vbuckets[op], window.run.keys[op]) if op >= 0
            else (window.frames[~op].opcode.name.lower(), window.frames[~op].vbucket,
                  window.frames[~op].key)
            for op in window.order
        ]  # fmt: skip
        assert recorded == taken
        # Applying the layers writes each vbucket's keys in request order.
        applied: list[int] = []  # positions in `taken`
        set_at = [i for i, op in enumerate(window.order) if op >= 0]
        frame_at = {~op: i for i, op in enumerate(window.order) if op < 0}
        for layer in window.layers():
            applied += [set_at[i] for i in layer.sets]
            applied += [frame_at[j] for j in layer.deletes]
        writes = [i for i, (kind, _, _) in enumerate(taken) if kind != "get"]
        assert sorted(applied) == writes
        for vb in range(4):
            mine = [i for i in applied if taken[i][1] == vb]
            assert mine == sorted(mine), (vb, mine)
        # A GET is answered after every write: no write of the window follows it on its key.
        for i, (kind, vb, key) in enumerate(taken):
            if kind == "get":
                assert not any(
                    k != "get" and (v, kk) == (vb, key) for k, v, kk in taken[i + 1 :]
                ), (i, taken)
    assert fed == requests


def test_a_window_takes_at_most_so_many_gets() -> None:
    window = RequestWindow()
    for n in range(GETS_PER_WINDOW_MAX):
        window.add_frame(frame("get", 0, b"k%d" % n), b"k%d" % n)
    assert not window.joins(frame("get", 0, b"another"), b"another")
    assert window.joins(frame("delete", 0, b"another"), b"another")


def test_only_classic_gets_and_deletes_join() -> None:
    window = RequestWindow()
    assert not window.joins(Frame(Magic.ALT_REQUEST, Opcode.GET, key=b"k"), b"k")
    assert not window.joins(Frame(Magic.REQUEST, Opcode.NOOP), b"k")
    assert not window.joins(Frame(Magic.REQUEST, Opcode.SET, key=b"k"), b"k")
    assert window.joins(Frame(Magic.REQUEST, Opcode.DELETE, key=b"k"), b"k")


def test_reads_are_of_stored_keys_not_of_the_keys_as_sent() -> None:
    """A collections connection's GET sends LEB128 id | key; the window remembers the key as
    stored, so a later DELETE of that stored key (however it was sent) ends the window, and a
    DELETE of the same wire key in another collection does not."""
    window = RequestWindow()
    window.add_frame(frame("get", 0, b"\x08k"), b"\xff\x08k")
    assert not window.joins(frame("delete", 0, b"\x08k"), b"\xff\x08k")
    assert window.joins(frame("delete", 0, b"\x08k"), b"\xff\x09k")
    assert window.add_run(set_run([("set", 0, b"\xff\x08k")])) is not None


def test_window_counters_are_one_stat_group_per_node() -> None:
    providers: StatProviders = {}
    counters = window_counters(providers)
    assert window_counters(providers) is counters
    window = RequestWindow()
    window.add_run(set_run([("set", 0, b"a"), ("set", 1, b"b")]))
    window.add_frame(frame("get", 0, b"c"), b"c")
    window.add_frame(frame("delete", 1, b"d"), b"d")
    counters.count(window)
    assert dict(providers["kv_window"]()) == {
        "kv_window_windows": "1",
        "kv_window_sets": "2",
        "kv_window_gets": "1",
        "kv_window_deletes": "1",
    }
