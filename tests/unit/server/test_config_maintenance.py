"""Configuration of compaction and the expiry pager: defaults, file values, refusals by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from changefeed.server.config import ConfigError, NodeConfig, load_config


def test_defaults() -> None:
    config = NodeConfig()
    assert config.tombstone_purge_age_s == 3 * 24 * 3600  # Couchbase's metadata purge interval
    assert config.compaction_interval_s == 3600
    assert config.expiry_pager_interval_s == 60


def test_file_values(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text(
        "[node]\ntombstone_purge_age_s = 0\ncompaction_interval_s = 0.5\n"
        "expiry_pager_interval_s = 2\n"
    )
    config = load_config(path)
    assert (config.tombstone_purge_age_s, config.compaction_interval_s) == (0, 0.5)
    assert config.expiry_pager_interval_s == 2


@pytest.mark.parametrize(
    "line",
    [
        "tombstone_purge_age_s = -1",
        "compaction_interval_s = -0.5",
        "expiry_pager_interval_s = inf",
        'expiry_pager_interval_s = "60"',
        "compaction_interval_s = true",
        "tombstone_purge_age_s = nan",
    ],
)
def test_wrong_values_are_refused_naming_the_key(tmp_path: Path, line: str) -> None:
    path = tmp_path / "node.toml"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=line.split()[0]):
        load_config(path)
