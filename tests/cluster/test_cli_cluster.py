"""``changefeed cluster start | status | stop``: real etcd and node processes on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from changefeed.cli.main import cli
from changefeed.cluster.etcd_server import EtcdServer, free_port, process_runs, stop_pid
from changefeed.cluster.metadata import ClusterMetadata
from changefeed.cluster.placement import initial_map
from changefeed.vbmap import NodeAddress

CLI_TIMEOUT_S = 120.0


def changefeed(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run the real command in its own process (as a user would: the nodes outlive it)."""
    begun = time.monotonic()
    try:
        return _changefeed(args, timeout_s)
    finally:
        print(f"changefeed {' '.join(args[:2])}: {time.monotonic() - begun:.2f} s")


def _changefeed(args: tuple[str, ...], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "changefeed", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def invoke(*args: str) -> Result:
    """Run ``changefeed cluster ARGS`` in this process (quicker than a new interpreter)."""
    return CliRunner().invoke(cli, ["cluster", *args])


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory for `cluster start`; whatever it recorded is stopped by pid at the end."""
    directory = tmp_path / "cluster"
    yield directory
    record_path = directory / "cluster.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        for node in record["nodes"]:
            stop_pid(node["pid"], node["data_dir"], timeout_s=30)
        if record.get("etcd_pid"):
            stop_pid(record["etcd_pid"], record["etcd_data_dir"])


def test_start_status_stop(cluster_dir: Path) -> None:
    started = changefeed(
        "cluster", "start", "--nodes", "3", "--replicas", "1", "--vbuckets", "8",
        "--dir", str(cluster_dir), "--json",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    record = json.loads(started.stdout)
    assert record == json.loads((cluster_dir / "cluster.json").read_text())
    assert [n["name"] for n in record["nodes"]] == ["node0", "node1", "node2"]
    assert "is up: map rev 1" in started.stderr
    pids = [n["pid"] for n in record["nodes"]] + [record["etcd_pid"]]
    assert all(process_runs(n["pid"], n["data_dir"]) for n in record["nodes"])

    again = invoke("start", "--dir", str(cluster_dir))
    assert again.exit_code == 1 and "already runs" in again.output

    written = changefeed(
        "load", "--port", str(record["nodes"][0]["port"]), "--count", "300", "--json"
    )
    assert written.returncode == 0, written.stderr
    report = _status_when_caught_up(cluster_dir)
    assert report["map"]["rev"] == 1 and report["map"]["replicas"] == 1
    assert report["live_nodes"] == ["node0", "node1", "node2"]
    assert all(node["reachable"] for node in report["nodes"])
    expected = initial_map(
        [NodeAddress(n["name"], n["host"], n["port"]) for n in record["nodes"]], 1, 8
    )
    total = 0
    for row in report["vbuckets"]:
        active, replica = row["copies"]
        chain = expected.chains[row["vb"]]
        assert (active["node"], replica["node"]) == (f"node{chain[0]}", f"node{chain[1]}")
        assert active["high_seqno"] == replica["high_seqno"] and replica["lag_items"] == 0
        total += active["high_seqno"]
    assert total >= json.loads(written.stdout)["sets"]  # every write numbered on its active

    text = invoke("status", "--dir", str(cluster_dir))
    assert text.exit_code == 0 and "map rev 1: 8 vbuckets, 1 replicas" in text.output

    stopped = changefeed("cluster", "stop", "--dir", str(cluster_dir), "--json")
    assert stopped.returncode == 0, stopped.stderr
    assert json.loads(stopped.stdout)["stopped"] == {
        "node0": True, "node1": True, "node2": True, "etcd": True,
    }  # fmt: skip
    assert not any(_alive(pid) for pid in pids)
    for node in record["nodes"]:  # a clean shutdown: SIGTERM, not a kill
        assert " ERROR " not in Path(node["log"]).read_text()
    gone = invoke("status", "--dir", str(cluster_dir))
    assert gone.exit_code == 1 and record["etcd"] in gone.output

    # Started again on the same directory: the same ports, map and data.
    other = invoke("start", "--nodes", "2", "--dir", str(cluster_dir))
    assert other.exit_code == 1 and "restart it with the same options" in other.output
    again = changefeed(
        "cluster", "start", "--nodes", "3", "--replicas", "1", "--vbuckets", "8",
        "--dir", str(cluster_dir), "--json",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    restarted = json.loads(again.stdout)
    assert [n["port"] for n in restarted["nodes"]] == [n["port"] for n in record["nodes"]]
    after = _status_when_caught_up(cluster_dir)
    assert after["map"] == report["map"]
    assert [[c["high_seqno"] for c in row["copies"]] for row in after["vbuckets"]] == [
        [c["high_seqno"] for c in row["copies"]] for row in report["vbuckets"]
    ]
    assert changefeed("cluster", "stop", "--dir", str(cluster_dir)).returncode == 0


def _status_when_caught_up(cluster_dir: Path, timeout_s: float = 30.0) -> dict[str, Any]:
    """`cluster status --json` once every replica has caught up (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = invoke("status", "--dir", str(cluster_dir), "--json")
        assert result.exit_code == 0, result.output
        report: dict[str, Any] = json.loads(result.output)
        lags = [c.get("lag_items") for row in report["vbuckets"] for c in row["copies"][1:]]
        if all(lag == 0 for lag in lags) or time.monotonic() > deadline:
            return report
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and ") Z" not in Path(f"/proc/{pid}/stat").read_text()


def test_status_shows_the_map_and_unreachable_nodes(etcd: EtcdServer, cluster_name: str) -> None:
    nodes = [NodeAddress(f"n{i}", "127.0.0.1", free_port()) for i in range(3)]  # none serve

    async def write_map() -> None:
        async with await ClusterMetadata.connect(etcd.endpoint, cluster_name) as md:
            leadership = await md.campaign("orch", ttl_s=5)
            assert await md.write_map(initial_map(nodes, 2, 4), None, leadership)
            await leadership.resign()

    asyncio.run(write_map())
    runner = CliRunner()
    args = ["cluster", "status", "--etcd", etcd.endpoint, "--cluster", cluster_name]
    result = runner.invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["map"]["rev"] == 1 and report["orchestrator"] is None
    assert [n["reachable"] for n in report["nodes"]] == [False] * 3
    assert [len(row["copies"]) for row in report["vbuckets"]] == [3] * 4
    assert report["vbuckets"][0]["copies"][1]["high_seqno"] is None  # unknown, not 0
    text = runner.invoke(cli, args)
    assert text.exit_code == 0 and "unreachable" in text.output and "?/?" in text.output

    empty = runner.invoke(cli, ["cluster", "status", "--etcd", etcd.endpoint, "--cluster", "none"])
    assert empty.exit_code == 0 and "no map yet" in empty.output


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["start", "--nodes", "0", "--dir", "D"], 2, "--nodes"),
        (["start", "--replicas", "4", "--dir", "D"], 2, "--replicas"),
        (["start", "--nodes", "3"], 2, "--dir"),
        (["start", "--base-port", "65535", "--dir", "D"], 2, "past port 65535"),
        (["status"], 2, "give --dir DIR or --etcd URL"),
        (["status", "--dir", "D"], 1, "no cluster in"),
        (["stop", "--dir", "D"], 1, "no cluster in"),
        (["status", "--etcd", "ftp://x:1"], 1, "is not http://HOST:PORT"),
        (["status", "--etcd", "https://x:1"], 1, "CHANGEFEED_ETCD_CERTS"),
    ],
)
def test_usage_and_missing_cluster_errors(
    tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    args = [str(tmp_path / "d") if a == "D" else a for a in args]
    result = CliRunner().invoke(cli, ["cluster", *args])
    assert result.exit_code == code, result.output
    assert message in result.output
    assert not (tmp_path / "d" / "cluster.json").exists()


def test_start_with_an_unreachable_etcd_fails_fast(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{free_port()}"
    begun = time.monotonic()
    result = changefeed("cluster", "start", "--dir", str(tmp_path / "c"), "--etcd", endpoint)
    assert result.returncode == 1
    assert time.monotonic() - begun < 15
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and endpoint in errors[0]
    assert not list((tmp_path / "c").glob("node*"))  # no node was started


def test_stop_pid_leaves_a_reused_pid_alone(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as server:
        assert not stop_pid(server.pid, str(tmp_path / "elsewhere"))
        assert server.alive
        assert stop_pid(server.pid, str(server.data_dir))
        server.process.wait(10)  # type: ignore[union-attr]
        assert server.process is not None and server.process.returncode == -signal.SIGTERM


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, **extra}


def changefeed_env(
    env: dict[str, str], *args: str, timeout_s: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """`changefeed ARGS` in its own process, with `env`."""
    return subprocess.run(
        [sys.executable, "-m", "changefeed", *args],
        capture_output=True, text=True, timeout=timeout_s, check=False, env=env,
    )  # fmt: skip


def test_start_honours_changefeed_password(cluster_dir: Path) -> None:
    env = _env(CHANGEFEED_PASSWORD="not-the-default")
    begun = time.monotonic()
    started = changefeed_env(
        env, "cluster", "start", "--nodes", "2", "--replicas", "1", "--vbuckets", "4",
        "--dir", str(cluster_dir), "--json",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert "Traceback" not in started.stderr
    assert time.monotonic() - begun < 60
    status = changefeed_env(env, "cluster", "status", "--dir", str(cluster_dir), "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert all(node["reachable"] for node in report["nodes"]), report["nodes"]
    assert report["summary"]["nodes_up"] == 2
    # The default password is refused: the nodes really use the one given.
    refused = changefeed_env(
        _env(CHANGEFEED_PASSWORD="password"), "cluster", "status", "--dir", str(cluster_dir),
        "--json",
    )  # fmt: skip
    assert [n["reachable"] for n in json.loads(refused.stdout)["nodes"]] == [False, False]
    assert changefeed("cluster", "stop", "--dir", str(cluster_dir)).returncode == 0


def test_restart_brings_a_killed_node_back_in_place(cluster_dir: Path) -> None:
    started = changefeed(
        "cluster", "start", "--nodes", "3", "--replicas", "1", "--vbuckets", "8",
        "--dir", str(cluster_dir), "--json",
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    record = json.loads(started.stdout)
    victim = record["nodes"][0]
    written = changefeed("load", "--port", str(victim["port"]), "--count", "300", "--json")
    assert written.returncode == 0, written.stderr
    before = _status_when_caught_up(cluster_dir)

    os.kill(victim["pid"], signal.SIGKILL)  # a crash
    deadline = time.monotonic() + 10
    while _alive(victim["pid"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    down = invoke("status", "--dir", str(cluster_dir), "--json")
    assert json.loads(down.output)["summary"]["nodes_down"] == 1

    restarted = changefeed("cluster", "restart", "node0", "--dir", str(cluster_dir), "--json")
    assert restarted.returncode == 0, restarted.stderr
    outcome = json.loads(restarted.stdout)
    assert outcome["node"] == "node0" and outcome["was"] == "stopped"
    assert outcome["port"] == victim["port"] and outcome["pid"] != victim["pid"]
    now = json.loads((cluster_dir / "cluster.json").read_text())
    assert [n["name"] for n in now["nodes"]] == ["node0", "node1", "node2"]  # in place
    assert now["nodes"][0]["pid"] == outcome["pid"]
    assert process_runs(outcome["pid"], victim["data_dir"])

    after = _status_when_caught_up(cluster_dir)
    assert after["summary"]["nodes_up"] == 3
    assert {n["name"] for n in after["nodes"]} == {"node0", "node1", "node2"}  # no rebalance
    lags = [c["lag_items"] for row in after["vbuckets"] for c in row["copies"][1:]]
    assert lags == [0] * 8  # it caught up
    highs = [max(c["high_seqno"] for c in row["copies"]) for row in after["vbuckets"]]
    assert highs == [row["copies"][0]["high_seqno"] for row in before["vbuckets"]]

    # A running node is stopped cleanly first; an unknown one is refused.
    again = invoke("restart", "node1", "--dir", str(cluster_dir), "--json")
    assert again.exit_code == 0, again.output
    assert json.loads(again.output.splitlines()[-1])["was"] == "running"
    unknown = invoke("restart", "node9", "--dir", str(cluster_dir))
    assert unknown.exit_code == 1 and "no node 'node9'" in unknown.output

    final = json.loads((cluster_dir / "cluster.json").read_text())
    stopped = changefeed("cluster", "stop", "--dir", str(cluster_dir), "--json")
    assert json.loads(stopped.stdout)["stopped"] == {
        "node0": True, "node1": True, "node2": True, "etcd": True,
    }  # fmt: skip
    assert not any(_alive(n["pid"]) for n in final["nodes"])


def test_status_leads_with_a_summary_and_drops_a_removed_node(cluster_dir: Path) -> None:
    started = changefeed(
        "cluster", "start", "--nodes", "3", "--replicas", "1", "--vbuckets", "8",
        "--dir", str(cluster_dir),
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    report = _status_when_caught_up(cluster_dir)
    summary = report["summary"]
    assert summary["nodes_up"] == 3 and summary["nodes_down"] == 0
    assert sum(n["actives"] for n in summary["nodes"]) == 8
    assert sum(n["replicas"] for n in summary["nodes"]) == 8
    assert summary["worst_lag_items"]["items"] == 0
    text = invoke("status", "--dir", str(cluster_dir)).output.splitlines()
    first = text.index(next(line for line in text if line.startswith("vb ")))
    assert first < 15 and any(line.startswith("nodes: 3 up, 0 down") for line in text[:first])
    # The summary fits a screen's width (the per-vbucket details may run wider with seqnos and
    # flags such as "NOT IN SYNC, disconnected").
    assert all(len(line) < 100 for line in text[:first]), [
        line for line in text[:first] if len(line) >= 100
    ]
    brief = invoke("status", "--dir", str(cluster_dir), "--brief").output.splitlines()
    # The summary alone (another call: its figures may have moved, its shape may not).
    assert len(brief) == first - 1 and brief[0] == text[0]
    assert [line.split(":")[0] for line in brief] == [
        line.split(":")[0] for line in text[: first - 1]
    ]

    removed = invoke("remove", "node2", "--dir", str(cluster_dir), "--json")
    assert removed.exit_code == 0, removed.output
    after = invoke("status", "--dir", str(cluster_dir), "--json")
    report = json.loads(after.output)
    assert report["live_nodes"] == ["node0", "node1"]  # not node2, whose lease still runs
    assert [n["name"] for n in report["summary"]["nodes"]] == ["node0", "node1"]
    assert changefeed("cluster", "stop", "--dir", str(cluster_dir)).returncode == 0
