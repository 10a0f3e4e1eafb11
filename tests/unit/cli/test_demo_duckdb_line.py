"""The demo's DuckDB line runs as printed (issue 30 item 5): it names this interpreter (which has
duckdb and deltalake), quotes the tables' path for the shell, and queries the mirror."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake

from changefeed.cli.demo import duckdb_command


def test_the_duckdb_line_runs_in_a_shell(tmp_path: Path) -> None:
    tables = tmp_path / "my tables 'q' $HOME"  # spaces, quotes and a $ survive the shell
    seqnos = pa.array([3, 9, 4], pa.int64())
    write_deltalake(str(tables / "mirror"), pa.table({"key": ["a", "b", "c"], "seqno": seqnos}))
    command = duckdb_command(tables)
    assert "\n" not in command
    done = subprocess.run(
        ["sh", "-c", command], capture_output=True, text=True, timeout=120, env={}
    )  # no PATH: the line must not rely on a `python` found there
    assert done.returncode == 0, done.stderr
    row = [line for line in done.stdout.splitlines() if line.strip().startswith("│")][-1]
    assert [cell.strip() for cell in row.strip().strip("│").split("│")] == ["3", "9"], done.stdout
