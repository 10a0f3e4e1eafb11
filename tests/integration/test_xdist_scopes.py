"""``support.xdist_scopes``: how ``./run test`` shares the suite between two xdist workers.

The scheduling test runs pytest for real (``-n 2 --dist loadgroup``) on a small suite laid out
like ours, with this repository's conftest hook, and reads back which worker ran each test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.xdist_scopes import scope_of

TESTS = Path(__file__).parents[1]


@pytest.mark.parametrize(
    ("nodeid", "scope"),
    [
        ("tests/hosts/test_smoke.py::test_a", "hosts"),
        ("tests/chaos/test_chaos_cluster.py::test_chaos_short", "hosts"),
        ("tests/spark/test_mirror.py::test_b[x]", "spark"),
        ("tests/unit/protocol/test_dcp.py::test_c[a::b]", "tests/unit/protocol/test_dcp.py"),
        ("tests/sdk/test_cluster_sdk.py::test_d", "tests/sdk/test_cluster_sdk.py"),
        ("tests/test_top.py::test_e", "tests/test_top.py"),
    ],
)
def test_a_test_is_scheduled_with_its_directory_or_its_module(nodeid: str, scope: str) -> None:
    assert scope_of(nodeid) == scope


RECORD = """
import json, os
from pathlib import Path

def record(name):
    with open(os.environ["SCOPES_OUT"], "a") as out:
        out.write(json.dumps([name, os.environ.get("PYTEST_XDIST_WORKER")]) + "\\n")
"""
MODULE = """
from record import record
STATE = []

def test_first():
    record(__name__ + ".first")
    STATE.append(1)

def test_second():  # builds on test_first: only right if both run in one worker, in order
    record(__name__ + ".second")
    assert STATE == [1]
"""
CONFTEST = """
import importlib.util
spec = importlib.util.spec_from_file_location("repository_conftest", {conftest!r})
repository = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repository)
# The repository's hooks: the scheduler, and each worker's network of its own.
pytest_xdist_make_scheduler = repository.pytest_xdist_make_scheduler
pytest_configure = repository.pytest_configure
"""


def test_two_workers_run_each_module_whole_and_each_directory_scope_in_one(
    tmp_path: Path,
) -> None:
    tests = tmp_path / "tests"
    for folder in ("unit", "sdk", "spark", "hosts", "chaos"):
        (tests / folder).mkdir(parents=True)
        for i in range(3):
            (tests / folder / f"test_{folder}{i}.py").write_text(MODULE)
    (tests / "record.py").write_text(RECORD)
    (tests / "conftest.py").write_text(CONFTEST.format(conftest=str(TESTS / "conftest.py")))
    (tmp_path / "pytest.ini").write_text("[pytest]\npythonpath = tests\n")
    out = tmp_path / "scopes.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "tests"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
        env={**os.environ, "SCOPES_OUT": str(out), "PYTHONPATH": str(TESTS)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(ran) == 5 * 3 * 2, ran
    workers: dict[str, set[str]] = {}
    for name, worker in ran:
        module = name.rsplit(".", 1)[0]
        folder = module.removeprefix("test_").rstrip("0123456789")
        scope = {"chaos": "hosts"}.get(folder, folder) if folder in DIRS else module
        workers.setdefault(scope, set()).add(worker)
    assert all(len(w) == 1 for w in workers.values()), workers
    assert {w for ws in workers.values() for w in ws} == {"gw0", "gw1"}, workers


DIRS = ("spark", "hosts", "chaos")
