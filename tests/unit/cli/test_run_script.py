"""``./run`` says what it is doing before pip's quiet minute (issue 26), and nothing when there
is nothing to install. Run on a copy of the script in a temporary directory, with a stand-in
``.venv/bin/python`` that logs its arguments, so no real install happens."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _sandbox(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "run", tmp_path / "run")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "python $*" >&2\n')
    python.chmod(0o755)
    return tmp_path


def _run(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(directory / "run"), "no-such-command"],
        capture_output=True, text=True, timeout=30, check=False, env=dict(os.environ),
    )  # fmt: skip


def test_run_says_it_installs_before_pip_runs(tmp_path: Path) -> None:
    directory = _sandbox(tmp_path)
    first = _run(directory)
    assert first.returncode == 2, first.stderr  # the usage error, after the install
    lines = first.stderr.splitlines()
    pip = next(i for i, line in enumerate(lines) if line.startswith("python -m pip"))
    said = [line for line in lines[:pip] if line.startswith("run: installing")]
    assert said and "pip" in said[0], first.stderr
    assert any(line.startswith("run: installed in ") for line in lines[pip:]), first.stderr

    again = _run(directory)  # installed: nothing to say, nothing run
    assert "run:" not in again.stderr and "python -m pip" not in again.stderr, again.stderr
    assert again.stderr.startswith("usage: ./run"), again.stderr
