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
        (["status", "--etcd", "https://x:1"], 1, "is not http://HOST:PORT"),
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
