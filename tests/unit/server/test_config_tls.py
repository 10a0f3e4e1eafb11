"""The TLS and connection-budget keys of the node configuration."""

from __future__ import annotations

from pathlib import Path

import pytest

from changefeed import limits
from changefeed.server.config import ConfigError, NodeConfig, load_config


def test_budget_defaults_come_from_limits() -> None:
    config = NodeConfig()
    assert config.max_unauthenticated_connections == limits.UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT
    assert config.admin_connections_reserved == limits.ADMIN_CONNECTIONS_RESERVED_DEFAULT
    assert config.max_connections_per_user == limits.CONNECTIONS_PER_USER_MAX_DEFAULT
    assert config.tls_port == 0  # plain TCP only unless asked


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"tls_port": 11207}, "tls_port needs tls_cert and tls_key"),
        ({"tls_cert": "n.pem", "tls_key": "n.key"}, "need tls_port"),
        ({"tls_port": 11210, "tls_cert": "n.pem", "tls_key": "n.key"}, "must differ from port"),
        ({"max_unauthenticated_connections": 0}, "max_unauthenticated_connections 0"),
        ({"max_connections_per_user": 0}, "max_connections_per_user 0"),
        ({"admin_connections_reserved": -1}, "admin_connections_reserved -1"),
    ],
)
def test_bad_settings_name_the_key(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, **overrides)


def test_tls_paths_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('tls_port = 11207\ntls_cert = "certs/n1.pem"\ntls_key = "certs/n1.key"\n')
    config = load_config(path)
    assert (config.tls_cert, config.tls_key) == (Path("certs/n1.pem"), Path("certs/n1.key"))
    assert load_config(None, admin_connections_reserved=0).admin_connections_reserved == 0
