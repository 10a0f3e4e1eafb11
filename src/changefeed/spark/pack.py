"""Pack a slim Python environment for Spark executors: ``--archives env.tar.gz#env``.

Executors only run the ``changefeed`` source's ``read`` (and the mirror writer's tasks): they
need pyarrow, numpy, scramp and deltalake (the ``executor`` extra, ``EXECUTOR_REQUIREMENTS``),
not the node's stack (lmdb, etcd, duckdb, the CLI). ``pyspark`` itself comes from the cluster's
Spark (its ``python/lib/pyspark.zip``), so it is left out too.

``python -m changefeed.spark.pack env.tar`` builds a virtual environment (``python -m venv``,
the interpreter this runs on) holding the ``changefeed`` package and the installed
distributions the executor requirements need, taken from this environment as they are (so the
versions match the driver's), and tars it (``.tar.gz``/``.tgz``: Spark unpacks those with the
system's ``tar``, which keeps file modes; a plain ``.tar`` loses them). This
is what venv-pack does for a whole venv, for the executor's share of it. The venv's
``bin/python`` is a copy of the base interpreter (Spark refuses to unpack a link leading out of
the archive) that takes the standard library from the base's path: workers need the same Python
at the same path (the same image), as with venv-pack.

Then::

    spark-submit --archives env.tar.gz#env --conf spark.pyspark.python=./env/bin/python ...
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# The source and the writer's imports on executors; pyproject.toml's ``executor`` extra says the
# same (tests/unit/spark/test_pack.py holds them equal).
EXECUTOR_REQUIREMENTS: Final = ("pyarrow>=15", "numpy>=1.26", "scramp>=1.4", "deltalake>=1.0")
PACKAGE: Final = "changefeed"
ARCHIVE_SUFFIXES: Final = (".tar.gz", ".tgz")


class PackError(RuntimeError):
    """The environment cannot be packed (a requirement is not installed here)."""


def closure(requirements: Iterable[str]) -> list[metadata.Distribution]:
    """The installed distributions ``requirements`` need, theirs included (markers evaluated
    for this interpreter, no extras), each once, in name order.

    Raises:
        PackError: a requirement is not installed in this environment.
    """
    found: dict[str, metadata.Distribution] = {}
    pending = [Requirement(r) for r in requirements]
    while pending:  # bounded: each distribution is expanded once
        requirement = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found or not (
            requirement.marker is None or requirement.marker.evaluate({"extra": ""})
        ):
            continue
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            raise PackError(f"{requirement} is needed but not installed here") from None
        found[name] = dist
        pending.extend(Requirement(text) for text in dist.requires or ())
    return [found[name] for name in sorted(found)]


def _place(source: Path, target: Path) -> None:
    """Hard-link ``source`` at ``target`` (same file system: no copy), else copy it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _site_packages(env: Path) -> Path:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return env / "lib" / version / "site-packages"


def _copy_distribution(dist: metadata.Distribution, site: Path) -> int:
    """The files of ``dist`` that live in site-packages (scripts in ``bin`` are not needed)."""
    copied = 0
    for file in dist.files or ():
        if file.parts and file.parts[0] == "..":
            continue
        source = Path(str(dist.locate_file(file)))
        if source.is_file() and "__pycache__" not in file.parts:
            _place(source, site / file)
            copied += 1
    return copied


def _copy_package(site: Path) -> None:
    """The ``changefeed`` package from where it is imported (an editable install has its
    sources elsewhere), with a dist-info so ``importlib.metadata`` knows its version."""
    root = Path(__file__).resolve().parents[1]  # this module is changefeed/spark/pack.py
    for source in root.rglob("*"):
        if source.is_file() and "__pycache__" not in source.parts:
            _place(source, site / PACKAGE / source.relative_to(root))
    version = metadata.version(PACKAGE)
    info = site / f"{PACKAGE}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    requires = "".join(f"Requires-Dist: {r}\n" for r in EXECUTOR_REQUIREMENTS)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {version}\n{requires}"
    )


def build_env(env: Path, requirements: Iterable[str] = EXECUTOR_REQUIREMENTS) -> list[str]:
    """Make the environment at ``env`` (it must not exist); returns the distributions in it.

    Raises:
        PackError: ``env`` exists, or a requirement is not installed here.
    """
    if env.exists():
        raise PackError(f"{env} exists; give a new directory")
    dists = closure(requirements)  # before anything is made: a missing one makes nothing
    base = Path(sysconfig.get_config_var("BINDIR") or Path(sys.executable).parent)
    python = base / f"python{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(
        [str(python if python.exists() else sys.executable), "-m", "venv", "--without-pip",
         "--copies", str(env)],
        check=True,
    )  # fmt: skip
    site = _site_packages(env)
    for dist in dists:
        _copy_distribution(dist, site)
    _copy_package(site)
    return [f"{dist.metadata['Name']}=={dist.version}" for dist in dists]


def pack(output: Path, work: Path | None = None) -> list[str]:
    """Build the environment and tar it at ``output`` (``bin/``, ``lib/``... at the top, so
    that ``--archives output#env`` unpacks it as ``env``); returns the distributions in it."""
    if not output.name.endswith(ARCHIVE_SUFFIXES):
        raise PackError(
            f"{output}: name it .tar.gz or .tgz (Spark unpacks a plain .tar without file modes: "
            "bin/python would not be executable)"
        )
    env = (work or output.parent) / f".{output.name}.env"
    if env.exists():
        shutil.rmtree(env)
    try:
        names = build_env(env)
        # Fast gzip: the archive is copied once per executor, the level hardly changes its size.
        with tarfile.open(output, "w:gz", compresslevel=1) as tar:
            for top in sorted(env.iterdir()):  # no "./" member: Spark's unpacking refuses it
                tar.add(top, arcname=top.name)
    finally:
        shutil.rmtree(env, ignore_errors=True)
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m changefeed.spark.pack",
        description="Pack a slim environment for Spark executors (--archives OUT#env).",
    )
    parser.add_argument("output", type=Path, help="the archive: .tar.gz or .tgz")
    args = parser.parse_args(argv)
    try:
        names = pack(args.output)
    except PackError as error:
        parser.exit(1, f"Error: {error}\n")
    size = args.output.stat().st_size / 2**20
    print(f"{args.output}: {size:,.0f} MiB, {PACKAGE} and {', '.join(names)}")


if __name__ == "__main__":
    main()
