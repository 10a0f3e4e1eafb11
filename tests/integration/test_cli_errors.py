"""CLI errors are one line that says what failed and with which value, never a traceback.

Every case runs the real ``changefeed`` command in a child process (``python -m changefeed``), so
what is checked is what a user sees: the exit code (1 = a runtime failure, 2 = a usage error, as
click does) and stderr. A runtime failure prints exactly one line, ``Error: ...``; a usage error
prints click's usage hint and then its one ``Error: ...`` line. Either way no traceback, and no
"Future exception was never retrieved" at exit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.cli.node_process import HOST, NodeProcess
from changefeed.storage.store import Store
from support.clients import free_port
from support.nodes import node_factory

pytestmark = pytest.mark.timeout(180)

CLI_TIMEOUT_S = 60.0
RUNTIME_FAILURE = 1
USAGE_ERROR = 2
# A node's first start logs a warning when it creates the users file with the default password;
# setting the password keeps stderr to the one error line.
QUIET_ENV = {"CHANGEFEED_PASSWORD": "password"}


def changefeed(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``changefeed ARGS`` to completion (with a deadline) and return what it printed."""
    return subprocess.run(
        [sys.executable, "-m", "changefeed", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        cwd=cwd,
        env={**os.environ, **QUIET_ENV},
        stdin=subprocess.DEVNULL,
    )


def assert_error(result: subprocess.CompletedProcess[str], exit_code: int, *fragments: str) -> str:
    """The command failed with ``exit_code`` and one ``Error:`` line holding ``fragments``;
    returns that line."""
    stderr = result.stderr
    context = f"exit {result.returncode}, stderr:\n{stderr}"
    assert "Traceback" not in stderr, context
    assert "never retrieved" not in stderr, context
    assert result.returncode == exit_code, context
    lines = stderr.strip().splitlines()
    assert lines, context
    if exit_code == RUNTIME_FAILURE:
        assert len(lines) == 1, context
    errors = [line for line in lines if line.startswith("Error:")]
    assert errors == [lines[-1]], context
    for fragment in fragments:
        assert fragment in lines[-1], (fragment, context)
    return lines[-1]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for the client-command cases (they only read, or fail before writing)."""
    with node_factory(tmp_path_factory.mktemp("cli-errors")) as factory:
        yield factory(vbuckets=8, args=["--no-durable"])


# -- changefeed serve ---------------------------------------------------------------------------


def test_serve_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = changefeed(
            "serve", "--host", HOST, "--port", str(port), "--data-dir", str(tmp_path / "data")
        )
    line = assert_error(result, RUNTIME_FAILURE, f"{HOST}:{port}", "address already in use")
    assert line.startswith("Error: cannot listen on"), line


@pytest.mark.parametrize(
    ("host", "reason"),
    [("nosuch.invalid", "does not resolve"), ("192.0.2.1", "cannot assign requested address")],
)
def test_serve_bad_host(tmp_path: Path, host: str, reason: str) -> None:
    result = changefeed("serve", "--host", host, "--port", "0", "--data-dir", str(tmp_path / "d"))
    assert_error(result, RUNTIME_FAILURE, f"cannot listen on {host}:0", reason)


def test_serve_metrics_port_in_use_names_the_metrics_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = changefeed(
            "serve", "--host", HOST, "--port", "0", "--metrics-port", str(port),
            "--data-dir", str(tmp_path / "data"),
        )  # fmt: skip
    assert_error(result, RUNTIME_FAILURE, f"{HOST}:{port}", "metrics", "address already in use")
    # The node had opened its store before the listener failed: it closed it cleanly.
    store = Store(tmp_path / "data" / "default", durable=False)
    try:
        assert store.was_clean_shutdown
    finally:
        store.close()


def test_serve_bad_log_level(tmp_path: Path) -> None:
    result = changefeed("serve", "--port", "0", "--data-dir", str(tmp_path), "--log-level", "LOUD")
    assert_error(result, USAGE_ERROR, "'LOUD'", "DEBUG")


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_serve_port_out_of_range(tmp_path: Path, port: str) -> None:
    result = changefeed("serve", "--port", port, "--data-dir", str(tmp_path))
    assert_error(result, USAGE_ERROR, "--port", port)


def test_serve_data_dir_is_a_file(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_text("not a directory\n")
    result = changefeed("serve", "--port", "0", "--data-dir", str(data))
    assert_error(result, RUNTIME_FAILURE, f"data dir {data}", "not a directory")
    under = data / "below"
    result = changefeed("serve", "--port", "0", "--data-dir", str(under))
    assert_error(result, RUNTIME_FAILURE, f"data dir {under}", "not a directory")


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot write to. Root ignores permission bits, so as root it is
    a sysfs directory (root may not create files there either), or the test is skipped."""
    if os.geteuid() != 0:
        target = tmp_path / "read-only"
        target.mkdir()
        target.chmod(0o500)
        return target
    for candidate in (Path("/sys/kernel"), Path("/sys")):
        try:
            (candidate / "changefeed-probe").touch()
        except OSError:
            return candidate
    pytest.skip("running as root with no unwritable directory to use")


def test_serve_data_dir_not_writable(tmp_path: Path) -> None:
    target = unwritable_directory(tmp_path)
    result = changefeed("serve", "--port", "0", "--data-dir", str(target))
    assert_error(result, RUNTIME_FAILURE, f"data dir {target}", "not writable")


def test_serve_config_value_of_the_wrong_type(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text('[node]\ndurable = "no"\n')
    result = changefeed("serve", "--config", str(config), "--data-dir", str(tmp_path / "d"))
    assert_error(result, USAGE_ERROR, "'durable'", str(config), "bool", "'no'")


def test_user_add_refuses_an_empty_password(tmp_path: Path) -> None:
    result = changefeed("user", "add", "alice", "--password", "", "--data-dir", str(tmp_path))
    assert_error(result, USAGE_ERROR, "password", "empty")
    assert not (tmp_path / "users.json").exists()


# -- client commands ----------------------------------------------------------------------------


def connection_args(node: NodeProcess) -> list[str]:
    return ["--host", HOST, "--port", str(node.port)]


@pytest.mark.parametrize(
    "command",
    [["stats"], ["load", "--count", "10"], ["stream", "--to-latest"]],
    ids=["stats", "load", "stream"],
)
def test_wrong_password(node: NodeProcess, command: list[str]) -> None:
    result = changefeed(*command, *connection_args(node), "--password", "wrong")
    assert_error(
        result,
        RUNTIME_FAILURE,
        f"authentication failed for user 'Administrator' at {HOST}:{node.port}",
    )


@pytest.mark.parametrize("command", [["stats"], ["load", "--count", "10"], ["stream"]])
def test_node_not_reachable(command: list[str]) -> None:
    port = free_port()
    result = changefeed(*command, "--host", HOST, "--port", str(port))
    assert_error(result, RUNTIME_FAILURE, f"cannot reach the node at {HOST}:{port}")


def test_unknown_bucket(node: NodeProcess) -> None:
    result = changefeed("stats", *connection_args(node), "--bucket", "nosuch")
    assert_error(result, RUNTIME_FAILURE, f"{HOST}:{node.port}", "no such bucket")


@pytest.mark.parametrize("spec", ["x-y", "3-1", "1,,2", "-4", "0-"])
def test_stream_malformed_vbuckets(node: NodeProcess, spec: str) -> None:
    result = changefeed("stream", *connection_args(node), "--vbuckets", spec)
    assert_error(result, USAGE_ERROR, "--vbuckets", repr(spec))


@pytest.mark.parametrize("spec", ["8", "6-9", "0,100"])
def test_stream_vbuckets_outside_the_node(node: NodeProcess, spec: str) -> None:
    result = changefeed("stream", "--to-latest", *connection_args(node), "--vbuckets", spec)
    assert_error(result, USAGE_ERROR, "--vbuckets", "0-7", f"{HOST}:{node.port}")


def test_stream_refuses_to_append_to_output_without_state(
    node: NodeProcess, tmp_path: Path
) -> None:
    output = tmp_path / "out.jsonl"
    output.write_text('{"vb": 0}\n')
    result = changefeed("stream", "--to-latest", *connection_args(node), "--output", str(output))
    assert_error(result, USAGE_ERROR, "--output", str(output), "--state")
    assert output.read_text() == '{"vb": 0}\n'  # untouched


def test_stats_load_stream_json(node: NodeProcess, tmp_path: Path) -> None:
    """Every command that prints results has ``--json`` (the stream's changes are JSON lines;
    its summary becomes a JSON object)."""
    loaded = changefeed("load", *connection_args(node), "--count", "50", "--json")
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout)["ops"] == 50
    stats = changefeed("stats", *connection_args(node), "--json")
    assert stats.returncode == 0, stats.stderr
    assert isinstance(json.loads(stats.stdout), dict)
    output = tmp_path / "out.jsonl"
    streamed = changefeed(
        "stream", "--to-latest", *connection_args(node), "--output", str(output), "--json"
    )
    assert streamed.returncode == 0, streamed.stderr
    summary = json.loads(streamed.stderr)
    assert summary["changes"] == len(output.read_text().splitlines()) > 0, summary
    users = changefeed("user", "list", "--data-dir", str(node.data_dir), "--json")
    assert users.returncode == 0, users.stderr
    assert json.loads(users.stdout) == ["Administrator"]


def test_serve_refuses_a_store_whose_data_file_is_gone(tmp_path: Path) -> None:
    """A node whose data.mdb was deleted used to start empty without a word."""
    node = NodeProcess(tmp_path / "n", vbuckets=4)
    node.start()
    node.stop()
    (node.data_dir / "default" / "data.mdb").unlink()
    result = changefeed("serve", "--data-dir", str(node.data_dir), "--port", "0", "--vbuckets", "4")
    assert_error(result, 1, "data.mdb is missing", "--start-fresh")
    fresh = NodeProcess(tmp_path / "n", vbuckets=4, args=["--start-fresh"])
    fresh.start()
    try:
        assert "damaged store files moved to" in fresh.log_text()
    finally:
        fresh.stop()
