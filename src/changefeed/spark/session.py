"""A SparkSession configured the way changefeed needs it (spark-python-datasource.md §7).

Workers must run this interpreter (``PYSPARK_PYTHON``), Spark must bind loopback, logs are
quiet, and the ``changefeed`` format is registered.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

CONF_DIR = Path(__file__).parent / "conf"


def prepare_environment() -> None:
    """Set the environment a Spark JVM and its Python workers read at start."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("SPARK_CONF_DIR", str(CONF_DIR))


def local_session(app_name: str = "changefeed", master: str = "local[2]", **conf: str) -> Any:
    """Build (or get) a session on ``master`` with the changefeed source registered."""
    prepare_environment()
    from pyspark.sql import SparkSession

    from changefeed.spark import register

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.driver.memory", conf.pop("driver_memory", "2g"))
    )
    for key, value in conf.items():
        builder = builder.config(key.replace("_", "."), value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark
