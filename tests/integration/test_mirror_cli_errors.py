"""``changefeed mirror`` mistakes are one line, found before Spark starts where they can be, and a
refused start leaves no directory behind (issue 30 item 5).

Each case runs the real command in a child process against a real node; the checks are the
ones of ``test_cli_errors.py`` (exit code, one ``Error:`` line, no traceback). Only the bad
``--schema`` case starts Spark (Spark's own parser decides what DDL is valid).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.cli.node_process import NodeProcess
from support.clients import free_port
from support.nodes import node_factory

from .test_cli_errors import QUIET_ENV, RUNTIME_FAILURE, USAGE_ERROR, assert_error, changefeed

pytestmark = pytest.mark.timeout(400)
SPARK_CLI_TIMEOUT_S = 300.0  # a Spark session starts in seconds, or minutes on a loaded machine


def changefeed_with_spark(*args: str) -> subprocess.CompletedProcess[str]:
    """``changefeed(*args)`` for the cases that start a Spark session."""
    return subprocess.run(
        [sys.executable, "-m", "changefeed", *args], capture_output=True, text=True,
        timeout=SPARK_CLI_TIMEOUT_S, env={**os.environ, **QUIET_ENV}, stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    with node_factory(tmp_path_factory.mktemp("mirror-errors")) as factory:
        yield factory(vbuckets=4, args=["--no-durable"])


def mirror(node: NodeProcess, tables: Path, *extra: str) -> list[str]:
    return ["mirror", "--cluster", node.address, "--tables", str(tables), "--once", *extra]


def test_wrong_password_is_one_line_and_makes_nothing(node: NodeProcess, tmp_path: Path) -> None:
    tables = tmp_path / "tables"
    result = changefeed(*mirror(node, tables, "--password", "wrong"))
    line = assert_error(result, RUNTIME_FAILURE, node.address, "'Administrator'", "AUTH_ERROR")
    assert "refused" in line, line
    assert not tables.exists()


def test_status_wrong_password_is_one_line(node: NodeProcess, tmp_path: Path) -> None:
    import pyarrow as pa
    from deltalake import write_deltalake

    write_deltalake(str(tmp_path / "mirror"), pa.table({"key": pa.array([], pa.binary())}))
    result = changefeed("mirror", "status", "--cluster", node.address, "--tables",
                        str(tmp_path), "--password", "wrong")  # fmt: skip
    assert_error(result, RUNTIME_FAILURE, node.address, "AUTH_ERROR")


def test_no_such_bucket_is_one_line(node: NodeProcess, tmp_path: Path) -> None:
    result = changefeed(*mirror(node, tmp_path / "tables", "--bucket", "nosuch"))
    assert_error(result, RUNTIME_FAILURE, "'nosuch'")
    assert not (tmp_path / "tables").exists()


def test_unreachable_cluster_is_one_line(tmp_path: Path) -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    result = changefeed("mirror", "--cluster", address, "--tables", str(tmp_path / "t"), "--once")
    assert_error(result, RUNTIME_FAILURE, "cannot reach the cluster", address)
    assert not (tmp_path / "t").exists()


def test_tables_naming_a_file(node: NodeProcess, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    assert_error(changefeed(*mirror(node, afile)), USAGE_ERROR, "--tables", str(afile), "a file")
    assert afile.read_text() == "mine\n"
    under = afile / "tables"
    assert_error(changefeed(*mirror(node, under)), USAGE_ERROR, "--tables", str(under), "a file")


def test_checkpoint_naming_a_file(node: NodeProcess, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    result = changefeed(*mirror(node, tmp_path / "tables", "--checkpoint", str(afile)))
    assert_error(result, USAGE_ERROR, "--checkpoint", str(afile))
    assert not (tmp_path / "tables").exists()


@pytest.mark.parametrize("pair", ["spark.ui.enabled", "=x"])
def test_conf_not_key_value(node: NodeProcess, tmp_path: Path, pair: str) -> None:
    result = changefeed(*mirror(node, tmp_path / "tables", "--conf", pair))
    assert_error(result, USAGE_ERROR, "--conf", repr(pair))


@pytest.mark.parametrize(
    ("schema", "fragments"),
    [
        ("name strin, age int", ("STRIN", "pos 5")),  # the position in the user's text
        ("name string, seqno bigint", ("'seqno'", "metadata column")),
    ],
)
def test_bad_schema_is_one_line_and_leaves_nothing(
    node: NodeProcess, tmp_path: Path, schema: str, fragments: tuple[str, ...]
) -> None:
    tables = tmp_path / "tables"
    result = changefeed_with_spark(*mirror(node, tables, "--schema", schema))
    line = assert_error(result, USAGE_ERROR, "--schema", *fragments)
    assert "vbucket int" not in line, line  # about the user's text, not the metadata DDL
    assert not tables.exists(), sorted(tables.rglob("*"))


@pytest.mark.slow
def test_a_start_refused_by_spark_removes_what_it_made(node: NodeProcess, tmp_path: Path) -> None:
    """Spark refuses the trigger only at ``start``, after the checkpoint directory was made:
    the run removes the tables and checkpoint directories it made."""
    tables, checkpoint = tmp_path / "tables", tmp_path / "elsewhere" / "checkpoint"
    result = changefeed_with_spark(
        "mirror", "--cluster", node.address, "--tables", str(tables),
        "--trigger", "bogus", "--checkpoint", str(checkpoint),
    )  # fmt: skip
    # Spark's JVM prints its own start-up lines before ours: the error is the one last line.
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == RUNTIME_FAILURE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert [line for line in lines if line.startswith("Error:")] == lines[-1:], lines
    assert "did not start" in lines[-1] and "'bogus'" in lines[-1], lines[-1]
    assert not tables.exists() and not checkpoint.exists()
    assert (tmp_path / "elsewhere").exists()  # made by mkdir -p: the parent is not ours to remove


@pytest.mark.slow
def test_an_empty_bucket_is_mirrored_not_refused(node: NodeProcess, tmp_path: Path) -> None:
    """Nothing to infer a schema from (the module's node holds no documents) was an empty
    ``schema`` option, which the source refused with a worker's traceback."""
    tables = tmp_path / "tables"
    result = changefeed_with_spark(*mirror(node, tables))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert (tables / "mirror").is_dir() or (tables / "_checkpoint").is_dir()
