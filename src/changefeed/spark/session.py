"""A SparkSession for changefeed, on the user's Spark configuration (spark-python-datasource.md §7).

Settings come in three layers, later ones winning:

1. changefeed's defaults (``DEFAULTS``; ``LOOPBACK_DEFAULTS`` too when the master is on this
   host): quiet progress, 2 GB driver, no UI, a loopback driver address and Hadoop's
   FileSystem API for the checkpoint logs (``FILE_SYSTEM_CHECKPOINTS``) for local runs;
2. the user's Spark configuration: ``spark-defaults.conf`` in ``SPARK_CONF_DIR`` (or
   ``SPARK_HOME/conf``), or, under ``spark-submit``, everything spark-submit was given;
3. what the caller passes (``changefeed mirror --conf k=v``, ``--master``).

So a cluster's ``spark-defaults.conf`` and a ``spark-submit --conf`` are obeyed, and nothing
forces the driver onto loopback when executors run elsewhere. Python workers run this
interpreter unless ``PYSPARK_PYTHON`` (or ``spark.pyspark.python``) names another, e.g. a packed
environment shipped with ``--archives`` (docs/spark.md, *Submitting*).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

CONF_DIR: Final = (
    Path(__file__).parent / "conf"
)  # quiet log4j2 settings, used when the user has none
DEFAULT_MASTER: Final = "local[2]"
DEFAULTS: Final[Mapping[str, str]] = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.adaptive.enabled": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.driver.memory": "2g",
}
# Spark's offset and commit logs through Hadoop's FileSystem API (a temporary file, then rename)
# instead of FileContext's, which costs ~40 ms more per log entry on a local disk (two entries a
# micro-batch: walCommit + commitOffsets 58 + 50 -> 14 + 11 ms, load ~7). Atomic where rename is,
# as a local file system's rename(2) is: a driver process killed mid-write leaves the temporary
# file, never a partial entry (tests/spark/test_checkpoint_log.py). That covers a process crash
# only: neither manager fsyncs the file or its directory, so a power loss (or a kernel crash)
# can leave the last entry empty, as it can with Spark's default. FileContext is kept for
# clusters, whose checkpoints live on shared storage Spark's default was chosen for.
FILE_SYSTEM_CHECKPOINTS: Final = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
)
CHECKPOINT_MANAGER_KEY: Final = "spark.sql.streaming.checkpointFileManagerClass"
# Only for a master on this host: executors elsewhere must reach the driver by a routable address.
LOOPBACK_DEFAULTS: Final[Mapping[str, str]] = {
    "spark.ui.enabled": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    CHECKPOINT_MANAGER_KEY: FILE_SYSTEM_CHECKPOINTS,
}
_LOOPBACK_MASTER = re.compile(
    r"^(local(\[.*\])?|local-cluster\[.*\]|spark://(127\.0\.0\.1|localhost)(:\d+)?)$"
)


class SessionError(RuntimeError):
    """A session that cannot work as configured; the message says what to change."""


def check_worker_python(settings: Mapping[str, str]) -> None:
    """The Python that Spark's workers run must exist for the driver too: the driver runs the
    source's planning in Python workers of the same path. A relative path (a packed env from
    ``--archives env.tar#env``: ``./env/bin/python``) is looked up in the driver's working
    directory, which Spark does not unpack archives into in client mode.

    Raises:
        SessionError: naming the path and the directory.
    """
    python = settings.get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON", "")
    if python and not Path(python).is_absolute() and "/" in python and not Path(python).exists():
        raise SessionError(
            f"the workers' Python {python} is not in the driver's directory {Path.cwd()}: the "
            "driver runs the source's planning with it too; unpack the packed environment "
            "there as well (e.g. mkdir env && tar -xf env.tar -C env)"
        )


def under_spark_submit() -> bool:
    """True in a driver that ``spark-submit`` started (its JVM is already up, configured)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def user_conf_dir() -> Path | None:
    """Where the user's ``spark-defaults.conf`` lives, as spark-submit looks for it."""
    if os.environ.get("SPARK_CONF_DIR"):
        return Path(os.environ["SPARK_CONF_DIR"])
    home = os.environ.get("SPARK_HOME")
    if not home:
        import pyspark

        home = str(Path(pyspark.__file__).parent)
    return Path(home) / "conf"


def prepare_environment() -> None:
    """Set what a Spark JVM and its Python workers read at start, where the user has not.

    The user's ``SPARK_CONF_DIR`` (or ``SPARK_HOME/conf``) is kept when there is one; else it
    points at changefeed's quiet logging settings. No driver address is forced here: a local
    master gets loopback through ``LOOPBACK_DEFAULTS``, which the user's conf overrides."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if not under_spark_submit():
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    conf_dir = user_conf_dir()
    if conf_dir is None or not conf_dir.is_dir():
        os.environ["SPARK_CONF_DIR"] = str(CONF_DIR)


def parse_properties(text: str) -> dict[str, str]:
    """``spark-defaults.conf`` lines (``key value``, ``key=value`` or ``key: value``; ``#``
    and ``!`` comments), as Java's ``Properties`` reads them (continuation lines aside)."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        match = re.match(r"([^\s=:]+)\s*[=:\s]\s*(.*)$", line)
        if match:
            out[match.group(1)] = match.group(2).strip()
        else:
            out[line] = ""
    return out


def spark_defaults() -> dict[str, str]:
    """The user's ``spark-defaults.conf`` (empty without one)."""
    conf_dir = user_conf_dir()
    path = conf_dir / "spark-defaults.conf" if conf_dir else None
    if path is None or not path.is_file():
        return {}
    return parse_properties(path.read_text(errors="replace"))


def submitted_conf() -> dict[str, str]:
    """What spark-submit gave the driver's JVM (``--conf``, ``--master``, its defaults file)."""
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM; starts nothing
    return dict(SparkConf().getAll())


def session_conf(
    master: str | None, given: Mapping[str, str], user: Mapping[str, str]
) -> dict[str, str]:
    """The settings of a session: changefeed's defaults, then ``user``'s (spark-defaults.conf
    or spark-submit's), then ``given``; ``master`` (when not None) over all of them, else the
    user's ``spark.master``, else ``local[2]``."""
    chosen = master or given.get("spark.master") or user.get("spark.master") or DEFAULT_MASTER
    conf = dict(DEFAULTS)
    if _LOOPBACK_MASTER.match(chosen):
        conf |= LOOPBACK_DEFAULTS
    conf |= user
    conf |= given
    conf["spark.master"] = chosen
    return conf


def spark_session(
    app_name: str = "changefeed", master: str | None = None, conf: Mapping[str, str] | None = None
) -> Any:
    """Build (or get) a session with the ``changefeed`` format registered (layers: module doc)."""
    prepare_environment()
    from pyspark.sql import SparkSession

    from changefeed.spark import register

    user = submitted_conf() if under_spark_submit() else spark_defaults()
    settings = session_conf(master, conf or {}, user)
    check_worker_python(settings)
    builder = SparkSession.builder.appName(settings.pop("spark.app.name", app_name))
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def local_session(app_name: str = "changefeed", master: str = DEFAULT_MASTER, **conf: str) -> Any:
    """A session on ``master`` (keyword settings spelled with ``_`` for ``.``:
    ``spark_executor_memory="512m"``; ``driver_memory`` for ``spark.driver.memory``)."""
    settings = {key.replace("_", "."): value for key, value in conf.items()}
    if "driver.memory" in settings:
        settings["spark.driver.memory"] = settings.pop("driver.memory")
    return spark_session(app_name, master, settings)
