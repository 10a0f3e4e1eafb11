"""``changefeed compact``: which vbuckets it asks for, and one-line errors."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from changefeed.cli.compact import parse_vbuckets
from changefeed.cli.main import cli
from support.clients import free_port


def test_vbucket_lists() -> None:
    assert parse_vbuckets("all", 4) == [0, 1, 2, 3]
    assert parse_vbuckets("2", 4) == [2]
    assert parse_vbuckets("0-1,3,1", 4) == [0, 1, 3]
    for spec in ("4", "x", "1-", "-1", "2-1", "0-9"):
        with pytest.raises(click.BadParameter):
            parse_vbuckets(spec, 4)


def test_an_unreachable_node_is_one_line() -> None:
    result = CliRunner().invoke(cli, ["compact", "--port", str(free_port()), "--purge-age", "0"])
    assert result.exit_code == 1
    assert "cannot reach the node" in result.output, result.output
    assert "Traceback" not in result.output


def test_a_negative_purge_age_is_refused() -> None:
    result = CliRunner().invoke(cli, ["compact", "--purge-age", "-1"])
    assert result.exit_code == 2
    assert "--purge-age" in result.output
