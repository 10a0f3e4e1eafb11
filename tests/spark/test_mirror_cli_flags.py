"""``changefeed mirror``'s writer flags (``--writer``, ``--mirror-tasks``, ``--mirror-groups``,
``--driver-batch-max``, ``--storage-option``): each in ``--help``; a bad value, or one that
does not fit the others or the tables, is one line naming it, before Spark starts and before
any directory is made (no node is needed to refuse them: the checks come first). The slow
test runs the command against a real node and reads the flags' effect in the tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable
from hypothesis import given, settings
from hypothesis import strategies as st

from changefeed.cli.main import cli
from changefeed.cli.mirror_flags import (
    WriterFlags,
    is_url,
    mended,
    storage_options,
    writer_flags,
)
from support.nodes import NodeFactory

from .helpers import write
from .test_dist_mirror import s3  # noqa: F401  (the fixture: a moto S3 server)

UNREACHABLE = "127.0.0.1:1"  # nothing listens: a check that reached the cluster would say so


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["mirror", "--cluster", UNREACHABLE, *args])
    return result.exit_code, result.output


def test_help_lists_every_writer_flag() -> None:
    code, text = run("--help")
    assert code == 0, text
    for flag in ("--writer", "--mirror-tasks", "--mirror-groups", "--driver-batch-max",
                 "--storage-option"):  # fmt: skip
        assert flag in text, flag


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--mirror-groups", "2000"], "2000"),
        (["--mirror-groups", "0"], "0"),
        (["--mirror-tasks", "0"], "0"),
        (["--mirror-tasks", "two"], "two"),
        (["--driver-batch-max", "-1"], "-1"),
        (["--writer", "fast"], "fast"),
        (["--storage-option", "novalue"], "novalue"),
        (["--storage-option", "=x", "--tables", "s3://b/t", "--checkpoint", "ck"], "=x"),
        (["--storage-option", "AWS_REGION=x"], "AWS_REGION"),  # local tables
        (["--writer", "local", "--mirror-tasks", "2"], "--mirror-tasks"),
        (["--writer", "local", "--mirror-groups", "4"], "--mirror-groups"),
        (["--writer", "local", "--driver-batch-max", "5"], "--driver-batch-max"),
        (["--writer", "local", "--tables", "s3://b/t", "--checkpoint", "ck"], "s3://b/t"),
        (["--tables", "s3://b/t"], "--checkpoint"),
    ],
)
def test_a_bad_value_is_one_line_naming_it(
    args: list[str], named: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    if "--tables" not in args:
        args = [*args, "--tables", str(tmp_path / "tables")]
    code, text = run(*args)
    assert code == 2, text
    error = [line for line in text.splitlines() if line.startswith("Error:")]
    assert len(error) == 1 and named in error[0], text
    assert "Traceback" not in text
    assert list(tmp_path.iterdir()) == [], "a refused start made a directory"


def test_flags_become_the_writer_options() -> None:
    flags = writer_flags("distributed", 3, 8, ("AWS_REGION=eu", "AWS_ALLOW_HTTP=true"), "s3://b/t")
    assert flags.source_options() == {
        "mirrorWriter": "distributed", "mirrorTasks": "3", "mirrorGroups": "8",
    }  # fmt: skip
    assert flags.storage_options == {"AWS_REGION": "eu", "AWS_ALLOW_HTTP": "true"}
    never = writer_flags(None, None, None, (), "/t", driver_batch_max=0)
    assert never.source_options() == {"mirrorDriverBatchMax": "0"}
    assert WriterFlags().source_options() == {}


@settings(deadline=None)
@given(st.dictionaries(st.from_regex(r"[A-Z_]{1,12}", fullmatch=True), st.text(max_size=20)))
def test_storage_options_round_trip(options: dict[str, str]) -> None:
    pairs = tuple(f"{key}={value}" for key, value in options.items())
    assert storage_options(pairs) == options


@pytest.mark.parametrize(
    ("tables", "url", "as_written"),
    [("s3://b/t", True, "s3://b/t"), ("s3:/b/t", True, "s3://b/t"),
     ("/data/tables", False, "/data/tables"), ("./t:/x", False, "t:/x"),
     ("tables", False, "tables"), ("gs://b", True, "gs://b")],
)  # fmt: skip
def test_a_url_is_told_from_a_path(tables: str, url: bool, as_written: str) -> None:
    assert is_url(tables) is url
    assert mended(str(Path(tables))) == as_written  # click gives --tables as a Path


@pytest.mark.slow
def test_groups_and_tasks_reach_the_tables(nodes: NodeFactory, tmp_path: Path) -> None:
    """The command with ``--mirror-groups 3 --mirror-tasks 2 --writer distributed``: the mirror
    table records 3 vbucket groups and its files sit in partitions 0..2 only."""
    node = nodes(args=["--no-durable"])
    write(node.port, [(f"k{i}", b'{"n": %d}' % i) for i in range(600)])
    tables = tmp_path / "tables"
    done = subprocess.run(
        [sys.executable, "-m", "changefeed", "mirror", "--cluster", node.address, "--tables",
         str(tables), "--once", "--writer", "distributed", "--mirror-groups", "3",
         "--mirror-tasks", "2"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    mirror = DeltaTable(str(tables / "mirror"))
    assert json.loads(mirror.metadata().description)["changefeed"]["vbucketGroups"] == 3
    files = pa.table(mirror.get_add_actions(flatten=True))
    groups = {int(g) for g in files.column("partition._vb_group").to_pylist()}
    assert groups <= {0, 1, 2} and groups, groups
    assert mirror.to_pyarrow_table().num_rows == 600


@pytest.mark.slow
def test_storage_options_reach_s3_tables(
    nodes: NodeFactory,
    tmp_path: Path,
    s3: dict[str, str],  # noqa: F811  (the fixture imported above)
) -> None:
    """``--tables s3://...`` with the endpoint and keys given only as ``--storage-option``
    (none in the environment): the driver's commits and the tasks' files reach the server."""
    from changefeed.spark.mirror_status import mirror_status

    node = nodes(args=["--no-durable"])
    write(node.port, [(f"k{i}", b'{"n": %d}' % i) for i in range(500)])
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    pairs = [arg for key, value in s3.items() for arg in ("--storage-option", f"{key}={value}")]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "changefeed", "mirror", "--cluster", node.address, "--tables",
         "s3://mirror/cli/tables", "--checkpoint", str(tmp_path / "ck"), "--once", *pairs],
        capture_output=True, text=True, timeout=300, check=False, env=env, cwd=cwd,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    status = mirror_status("s3://mirror/cli/tables", s3)
    assert status.rows == 500, status
    assert list(cwd.iterdir()) == [], "no local directory named like the URL"
