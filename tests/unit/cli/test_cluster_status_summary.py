"""`cluster status`'s summary (issue 26), from a report as `_status` builds it: nodes up and
down, actives/replicas/in sync per node, the worst lag; one screen whatever the vbuckets."""

from __future__ import annotations

from typing import Any

from changefeed.cli.cluster import _render, summarize


def _copy(node: str | None, role: str, high: int | None, **replica: Any) -> dict[str, Any]:
    copy: dict[str, Any] = {"node": node, "role": role, "high_seqno": high, "persisted_seqno": high}
    if role != "active":
        copy["lag_items"] = replica.pop("lag", None)
        if replica:
            copy["replication"] = replica
    return copy


def _report(vbuckets: int) -> dict[str, Any]:
    nodes = [
        {"name": "a", "address": "127.0.0.1:1", "live": True, "reachable": True, "error": None},
        {"name": "b", "address": "127.0.0.1:2", "live": True, "reachable": True, "error": None},
        {"name": "c", "address": "127.0.0.1:3", "live": False, "reachable": False,
         "error": "ConnectionRefusedError: refused"},
    ]  # fmt: skip
    rows = []
    for vb in range(vbuckets):
        lag = 7 if vb == 4 else 0
        if vb % 3 == 2:  # c's actives: c is down, so nobody reports on their replicas
            active, replica = _copy("c", "active", None), _copy("a", "replica1", 10, lag=None)
        elif vb % 3 == 0:
            active = _copy("a", "active", 10)
            replica = _copy("b", "replica1", 10, lag=0, in_sync=1, lag_s=0.0)
        else:
            active = _copy("b", "active", 10)
            replica = _copy(
                "a", "replica1", 10 - lag, lag=lag, in_sync=int(lag == 0), lag_s=lag / 10
            )
        copies = [active, replica]
        rows.append({"vb": vb, "copies": copies})
    return {
        "cluster": "default", "etcd": "http://127.0.0.1:2379", "orchestrator": None,
        "live_nodes": ["a", "b", "d"], "stale_registrations": ["e"],
        "map": {"rev": 4, "vbuckets": vbuckets, "replicas": 1, "etcd_mod_revision": 9},
        "nodes": nodes, "vbuckets": rows, "rebalance": None,
    }  # fmt: skip


def test_the_summary_counts_per_node_and_finds_the_worst_lag() -> None:
    summary = summarize(_report(9))
    assert (summary["nodes_up"], summary["nodes_down"]) == (2, 1)
    by_name = {n["name"]: n for n in summary["nodes"]}
    assert [by_name[n]["actives"] for n in "abc"] == [3, 3, 3]
    assert [by_name[n]["replicas"] for n in "abc"] == [6, 3, 0]
    assert by_name["a"]["replicas_in_sync"] == 2  # vb 1 and 7 (vb 4 lags)
    assert by_name["a"]["replicas_unknown"] == 3  # c's vbuckets
    assert by_name["b"]["replicas_in_sync"] == 3
    assert by_name["c"]["down_because"] == "not registered, unreachable"
    assert summary["worst_lag_items"] == {"items": 7, "vb": 4, "node": "a"}
    assert summary["worst_lag_s"] == {"s": 0.7, "vb": 4, "node": "a"}
    assert summary["replicas_in_sync"] == 5 and summary["replicas"] == 9


def test_the_summary_comes_first_and_fits_one_screen() -> None:
    report = _report(1024)
    report["summary"] = summarize(report)
    lines = _render(report).splitlines()
    details = lines.index("") + 1
    assert details < 20 and len(lines) == details + 1 + 1024
    head = "\n".join(lines[:details])
    assert "nodes: 2 up, 1 down" in head
    assert "worst lag: 7 items (vb 4 on a); 0.700 s (vb 4 on a)" in head
    assert "unreported)" in head and "not registered, unreachable (" in head
    assert "e          not in the map; registered but not answering" in head
    assert "live, not in the map: d" in head
    assert max(len(line) for line in lines[details:]) < 100
    # The summary too, with every suffix a node's line can take (a node whose replicas are
    # not reported yet made a 101-column line in a full-suite run).
    assert max(len(line) for line in lines[:details]) < 100, lines[:details]
    assert _render(report, details=False).splitlines() == lines[: details - 1]
