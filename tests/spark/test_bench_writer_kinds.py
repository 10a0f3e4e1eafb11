"""``bench_spark.py --mirror-writers`` kinds: an unknown ``:modifier`` is one line naming it
(before: a bare ``KeyError: 'g3'`` traceback)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_spark.py"


def bench_spark() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_spark_kinds", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_an_unknown_modifier_is_one_line_naming_it(tmp_path: Path) -> None:
    bench = bench_spark()
    with pytest.raises(SystemExit) as refused:
        bench.mirror_writer(tmp_path / "t", {"cluster": "127.0.0.1:1"}, "adaptive:g4:g3")
    message = str(refused.value)
    assert "'g3'" in message and "adaptive:g4:g3" in message and "\n" not in message
    assert "g4" in message.split("known:")[1]  # the modifiers there are


def test_known_modifiers_set_the_writers_options(tmp_path: Path) -> None:
    bench = bench_spark()
    writer = bench.mirror_writer(
        tmp_path / "t", {"cluster": "127.0.0.1:1"}, "adaptive:sparkread:g8"
    )
    try:
        assert writer.options["mirrorDriverRead"] == "false"
        assert writer.options["mirrorGroups"] == "8"
    finally:
        writer.close()
