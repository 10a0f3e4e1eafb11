"""The mirror job as a ``spark-submit`` application.

``spark-submit`` runs a Python file: this one. Its arguments are ``changefeed mirror``'s; the
master, deploy mode and settings are spark-submit's (``--master``, ``--conf``, ``--archives``,
``SPARK_CONF_DIR``'s ``spark-defaults.conf``), which the session takes as given::

    spark-submit --master spark://host:7077 --conf spark.executor.memory=2g \\
        "$(python -m changefeed.cli.submit --path)" --cluster node:11210 --tables /shared/t

``python -m changefeed.cli.submit ARGS`` runs the same job without spark-submit (as
``changefeed mirror ARGS``); ``--path`` prints this file's path. docs/spark.md, *Submitting*.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file (spark-submit), Python puts this file's directory first on sys.path; nothing
# else is in it, and the package is imported by its full name.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    del sys.path[0]


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--path"]:
        print(Path(__file__).resolve())
        return
    from changefeed.cli.mirror import mirror

    mirror.main(args=args, prog_name="changefeed.cli.submit")


if __name__ == "__main__":
    main()
