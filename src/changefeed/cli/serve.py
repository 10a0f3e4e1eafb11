"""``changefeed serve`` and ``changefeed user``: run a node, manage its users file."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import click

from changefeed.server.config import ConfigError, NodeConfig, load_config
from changefeed.server.users import Users, UsersError


def run_loop(coroutine: object) -> None:
    """Run on uvloop when installed (the faster loop), else asyncio's."""
    try:
        import uvloop

        uvloop.run(coroutine)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(coroutine)  # type: ignore[arg-type]


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, exists=True),
    help="TOML file; flags override it.",
)
@click.option("--data-dir", type=click.Path(path_type=Path), help="Default ./data.")
@click.option("--host", help="Listen address. Default 127.0.0.1.")
@click.option("--port", type=int, help="KV/DCP port. Default 11210 (0 = any free port).")
@click.option("--vbuckets", type=int, help="Partitions of the bucket. Default 64.")
@click.option("--bucket", help="Bucket name. Default 'default'.")
@click.option("--metrics-port", type=int, help="Prometheus /metrics port. Default off.")
@click.option("--checkpoint-quota-bytes", type=int, help="Checkpoint memory. Default 256 MiB.")
@click.option("--durable/--no-durable", default=None, help="fsync every flush. Default on.")
@click.option("--ready-file", type=click.Path(), help="Write the bound port here once serving.")
@click.option("--log-level", help="DEBUG, INFO, WARNING. Default INFO.")
def serve(config_file: Path | None, ready_file: str | None, **flags: object) -> None:
    """Run a node on the embedded single-node default (no cluster metadata service needed)."""
    try:
        config = load_config(config_file, **flags)
    except ConfigError as error:
        raise click.ClickException(str(error)) from None
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from changefeed.server.node import Node

    async def main() -> None:
        node = Node(config)
        await node.run(ready_file=ready_file)

    try:
        run_loop(main())
    except UsersError as error:
        raise click.ClickException(str(error)) from None


@click.group()
def user() -> None:
    """Manage the users file (salted SCRAM keys; passwords are never stored)."""


@user.command("add")
@click.argument("name")
@click.option("--password", prompt=True, hide_input=True, confirmation_prompt=True)
@click.option(
    "--data-dir", type=click.Path(path_type=Path), default=NodeConfig().data_dir, show_default=True
)
def user_add(name: str, password: str, data_dir: Path) -> None:
    """Add NAME (or change its password)."""
    path = NodeConfig(data_dir=data_dir).users_path
    try:
        users = Users.load(path) if path.exists() else Users()
        users.add(name, password)
        users.save(path)
    except UsersError as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"user {name} saved in {path}")


@user.command("list")
@click.option(
    "--data-dir", type=click.Path(path_type=Path), default=NodeConfig().data_dir, show_default=True
)
def user_list(data_dir: Path) -> None:
    try:
        users = Users.load(NodeConfig(data_dir=data_dir).users_path)
    except UsersError as error:
        raise click.ClickException(str(error)) from None
    for name in users.names():
        click.echo(name)
