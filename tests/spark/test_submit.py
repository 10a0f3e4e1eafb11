"""The mirror as a spark-submit application, with a packed slim environment for executors
(issue 30 item 2).

- The packed environment (``changefeed.spark.pack``) imports the source and the writer with
  pyspark from Spark's own zip, as executors do, and holds none of the node's stack.
- ``spark-submit changefeed/cli/submit/__main__.py ...`` takes its master from spark-submit's
  configuration (here the user's ``spark-defaults.conf`` in ``SPARK_CONF_DIR``), reads with
  as many tasks as the cluster has cores, and mirrors equal to the store.
- Slow: on a standalone cluster of two workers, executors run the packed environment shipped
  with ``--archives`` (the driver's planning too, unpacked in its directory), and the mirror
  equals the store.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.cli.submit import APP
from changefeed.spark.pack import build_env, pack
from changefeed.spark.session import CONF_DIR
from support.nodes import NodeFactory

from .helpers import assert_changelog_once, assert_typed_mirror_matches, write
from .standalone import SPARK_HOME, Standalone

pytestmark = pytest.mark.timeout(600)

SPARK_SUBMIT = str(SPARK_HOME / "bin" / "spark-submit")
SPARK_PYTHONPATH = os.pathsep.join(
    str(p) for p in sorted((SPARK_HOME / "python/lib").glob("*.zip"))
)
SERVER_STACK = ("lmdb", "duckdb", "click", "rich", "aetcd", "uvloop", "prometheus_client",
                "cryptography", "atomicshm", "pandas")  # fmt: skip
RUN_TIMEOUT_S = 420.0


def documents(node: NodeProcess, rng: random.Random, count: int) -> None:
    write(node.port, [
        (f"d{i:05d}", json.dumps({"id": i, "amount": rng.random(), "tag": f"t{i % 7}"}).encode())
        for i in range(count)
    ])  # fmt: skip
    write(node.port, [(f"d{rng.randrange(count):05d}", None) for _ in range(count // 20)])


def submitted(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPARK_SUBMIT, *args], cwd=cwd, env={**os.environ, **env}, capture_output=True,
        text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def start_line(done: subprocess.CompletedProcess[str]) -> str:
    """The mirror's "mirroring ..." line (spark-submit merges the driver's stderr into its
    stdout)."""
    output = done.stdout + done.stderr
    lines = [line for line in output.splitlines() if line.startswith("mirroring ")]
    assert len(lines) == 1, output[-4000:]
    return lines[0]


def test_the_packed_env_runs_the_source_without_the_server_stack(tmp_path: Path) -> None:
    env = tmp_path / "env"
    names = build_env(env)
    assert any(n.startswith("pyarrow==") for n in names), names
    probe = (  # every module of changefeed.spark but the driver's tools (submit, pack)
        "import sys, json, importlib, pkgutil\n"
        "import changefeed.spark as spark\n"
        "for m in pkgutil.iter_modules(spark.__path__):\n"
        "    if m.name not in ('submit', 'pack'):\n"
        "        importlib.import_module('changefeed.spark.' + m.name)\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules})\n"
        "try:\n    import changefeed.storage.store\n    stack = 'importable'\n"
        "except ModuleNotFoundError as error:\n    stack = error.name\n"
        "print(json.dumps({'loaded': loaded, 'stack': stack, 'prefix': sys.prefix}))\n"
    )
    done = subprocess.run(
        [str(env / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": SPARK_PYTHONPATH, "PATH": os.environ["PATH"]}, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert Path(report["prefix"]) == env, report["prefix"]  # its own site-packages, not ours
    assert not set(report["loaded"]) & set(SERVER_STACK), report["loaded"]
    assert report["stack"] == "lmdb", "the server stack is not in the executors' environment"


def test_spark_submit_takes_the_users_spark_defaults(
    nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    documents(node, rng, 1500)
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "log4j2.properties").write_text((CONF_DIR / "log4j2.properties").read_text())
    (conf / "spark-defaults.conf").write_text("spark.master  local[1]\n")
    tables = tmp_path / "tables"
    done = submitted(
        [str(APP), "--cluster", node.address, "--tables", str(tables), "--once"],
        tmp_path, {"SPARK_CONF_DIR": str(conf), "PYSPARK_PYTHON": sys.executable},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    line = start_line(done)
    assert " on local[1], 1 read tasks " in line, line  # spark-defaults.conf's master, its cores
    assert_typed_mirror_matches(tables, node)
    assert_changelog_once(tables)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    standalone = Standalone(tmp_path_factory.mktemp("submit-standalone"), workers=2)
    try:
        standalone.start()
        yield standalone
    finally:
        standalone.stop()


@pytest.mark.slow
def test_submit_with_a_packed_env_on_two_workers(
    cluster: Standalone, nodes: NodeFactory, tmp_path: Path, rng: random.Random
) -> None:
    node = nodes(args=["--no-durable"])
    documents(node, rng, 6000)
    archive = tmp_path / "env.tar.gz"
    pack(archive)
    driver = tmp_path / "driver"
    (driver / "env").mkdir(parents=True)
    with tarfile.open(archive) as tar:  # the driver plans with ./env/bin/python too
        tar.extractall(driver / "env", filter="tar")
    tables = tmp_path / "tables"
    done = submitted(
        [
            "--master", cluster.url, "--archives", f"{archive}#env",
            "--conf", "spark.pyspark.python=./env/bin/python",
            "--conf", f"spark.pyspark.driver.python={sys.executable}",
            "--conf", "spark.executor.memory=512m", "--conf", "spark.cores.max=2",
            str(APP), "--cluster", node.address, "--tables", str(tables), "--once",
            "--max-offsets-per-trigger", "2000", "--partitions", "4",
        ],
        driver, {"SPARK_CONF_DIR": str(CONF_DIR)},
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert f" on {cluster.url}, 4 read tasks " in start_line(done)
    unpacked = sorted(cluster.root.glob("worker*/app-*/*/env/bin/python"))
    assert len({p.parts[-6] for p in unpacked}) == 2, unpacked  # both workers got the env
    assert_typed_mirror_matches(tables, node)
    assert_changelog_once(tables)
