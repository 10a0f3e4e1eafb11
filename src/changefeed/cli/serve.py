"""``changefeed serve`` and ``changefeed user``: run a node, manage its users file.

Errors a user can cure print one line naming the value at fault, never a traceback: a flag or
config value that is wrong is a usage error (exit 2, as click's own); a port that cannot be
bound, a data directory that is a file or not writable, a store that cannot be opened are
runtime failures (exit 1). The checks that need no node (data directory, log level) run before
the node opens anything.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import sys
import tempfile
from pathlib import Path

import click

from changefeed.server.config import ConfigError, NodeConfig, load_config
from changefeed.server.privileges import ROLE_PRIVILEGES
from changefeed.server.users import Users, UsersError
from changefeed.storage.errors import StorageError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
PORT = click.IntRange(0, 65535)
# asyncio and uvloop word a failed bind alike: "error while attempting to bind on address
# ('127.0.0.1', 11210): address already in use" (IPv6 tuples have four fields).
_BIND_FAILURE = re.compile(r"bind on address \('([^']*)', (\d+)[^)]*\): (.+)$")


class UsageFailure(click.ClickException):
    """A flag or config value found wrong after parsing: one ``Error:`` line, and exit 2, the
    code click gives its own usage errors (1 stays for runtime failures)."""

    exit_code = 2


def run_loop(coroutine: object) -> None:
    """Run on uvloop when installed (the faster loop), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coroutine)  # type: ignore[arg-type]
        return
    # Outside the try: an ImportError raised while serving must not run the coroutine twice.
    uvloop.run(coroutine)  # type: ignore[arg-type]


@click.command()
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path, exists=True),
    help="TOML file; flags override it.",
)
@click.option("--data-dir", type=click.Path(path_type=Path), help="Default ./data.")
@click.option("--host", help="Listen address. Default 127.0.0.1.")
@click.option("--port", type=PORT, help="KV/DCP port. Default 11210 (0 = any free port).")
@click.option("--vbuckets", type=int, help="Partitions of the bucket. Default 64.")
@click.option("--bucket", help="Bucket name. Default 'default'.")
@click.option("--metrics-port", type=PORT, help="Prometheus /metrics port. Default off.")
@click.option("--checkpoint-quota-bytes", type=int, help="Checkpoint memory. Default 256 MiB.")
@click.option("--durable/--no-durable", default=None, help="fsync every flush. Default on.")
@click.option(
    "--start-fresh",
    is_flag=True,
    default=None,
    help="If the data file is missing, empty or truncated, move it aside and start empty "
    "(consumers roll back to 0). Without it such a node refuses to start.",
)
@click.option(
    "--etcd",
    help="Join the cluster whose metadata lives in this etcd (http://host:port; several "
    "members comma-separated, tried in turn; https: the node presents --tls-cert/--tls-key "
    "and trusts --tls-ca).",
)
@click.option("--cluster", help="Cluster name (its etcd key prefix). Default 'default'.")
@click.option("--node-name", help="This node's unique name in the cluster. Default 'n0'.")
@click.option("--replicas", type=click.IntRange(0, 3), help="Replicas per vbucket. Default 0.")
@click.option("--expected-nodes", type=int, help="Nodes to wait for before the first map.")
@click.option("--replica-lag-max-s", type=float, help="In-sync window of a replica. Default 10.")
@click.option(
    "--failover-timeout-s",
    type=int,
    help="Lease TTL: a node silent this long is failed over. Default 5.",
)
@click.option(
    "--crash-failover/--no-crash-failover",
    default=None,
    help="Fail a node over as soon as its crash is confirmed (its port refuses connections), "
    "without waiting out its lease. Default on.",
)
@click.option(
    "--shm",
    "shm_groups",
    type=click.IntRange(0),
    help="Publish the changes to local readers over shared memory, in this many vbucket "
    "groups (services <bucket>-<port>-g<i>; see `changefeed stream --local`). Default 0: off.",
)
@click.option("--shm-dir", type=click.Path(path_type=Path), help="Where shm services live.")
@click.option(
    "--tls-port",
    type=PORT,
    help="Also serve KV/DCP over TLS on this port (Couchbase uses 11207). Default off.",
)
@click.option(
    "--tls-cert",
    type=click.Path(path_type=Path),
    help="The node's certificate chain, PEM (`changefeed certs create` makes one).",
)
@click.option("--tls-key", type=click.Path(path_type=Path), help="The node's private key, PEM.")
@click.option(
    "--tls-ca",
    type=click.Path(path_type=Path),
    help="The cluster's CA, PEM: a client certificate it signed authenticates that node "
    "without a password (replica streams), and replica feeds dial other nodes over TLS "
    "trusting it. Default: no client certificates; replicas dial plain TCP.",
)
@click.option(
    "--tls-crl",
    type=click.Path(path_type=Path),
    help="Revoked node certificates, a PEM CRL (`changefeed certs revoke` writes it).",
)
@click.option(
    "--max-unauthenticated-connections",
    type=click.IntRange(1),
    help="Connections still authenticating; one more closes the oldest. Default 256.",
)
@click.option(
    "--admin-connections-reserved",
    type=click.IntRange(0),
    help="Connection slots only admins (and replica streams) may take. Default 64.",
)
@click.option(
    "--max-connections-per-user",
    type=click.IntRange(1),
    help="Connections one user may hold (its longest-idle makes room). Default 256.",
)
@click.option("--ready-file", type=click.Path(), help="Write the bound port here once serving.")
@click.option("--log-level", help="DEBUG, INFO, WARNING, ERROR, CRITICAL. Default INFO.")
def serve(config_file: Path | None, ready_file: str | None, **flags: object) -> None:
    """Run a node: alone on the embedded single-node default, or, with --etcd, as a member of
    a cluster (replica vbuckets, failover metadata in etcd)."""
    try:
        config = load_config(config_file, **flags)
    except ConfigError as error:
        raise UsageFailure(str(error)) from None
    level = config.log_level.upper()
    if level not in LOG_LEVELS:
        raise UsageFailure(f"log level {config.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    _prepare_data_dir(config.data_dir)
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        run_loop(_serve(config, ready_file))
    except UsersError as error:
        raise click.ClickException(str(error)) from None
    except StorageError as error:
        raise click.ClickException(f"cannot open the store in {config.data_dir}: {error}") from None


async def _serve(config: NodeConfig, ready_file: str | None) -> None:
    from changefeed.server.node import Node

    try:
        node = Node(config)
    except ConfigError as error:  # a TLS certificate or key that cannot be used
        raise click.ClickException(str(error)) from None
    except OSError as error:  # the users file or the store's files
        where = f"{error.filename}: " if error.filename is not None else ""
        raise click.ClickException(f"cannot start the node: {where}{error.strerror}") from None
    companion = None
    if config.etcd:
        from changefeed.cluster.node_agent import NodeAgent

        companion = NodeAgent(node)
    try:
        await node.run(ready_file=ready_file, companion=companion)
    except ConnectionError as error:  # etcd unreachable (MetadataUnavailableError)
        logging.disable(logging.INFO)
        try:
            await node.stop()
        finally:
            logging.disable(logging.NOTSET)
        raise click.ClickException(f"cannot join cluster {config.cluster!r}: {error}") from None
    except OSError as error:  # from binding a listener or writing the ready file
        # The store is open: close it cleanly, so the next start is a clean one. Its INFO
        # lines ("shutting down") would only bury the one line that says what went wrong.
        logging.disable(logging.INFO)
        try:
            await node.stop()
        finally:
            logging.disable(logging.NOTSET)
        raise click.ClickException(_start_failure(error, config)) from None


def _start_failure(error: OSError, config: NodeConfig) -> str:
    """One line naming the address (or file) a node could not start with, and why."""
    if error.filename is not None:
        return f"cannot write {error.filename}: {error.strerror}"
    if isinstance(error, socket.gaierror):
        return (
            f"cannot listen on {_address(config.host, config.port)}: host {config.host!r} "
            f"does not resolve ({error.strerror})"
        )
    bind = _BIND_FAILURE.search(str(error))
    if bind is None:
        return f"cannot listen on {_address(config.host, config.port)}: {error.strerror or error}"
    host, port, reason = bind.group(1), int(bind.group(2)), bind.group(3)
    metrics = config.metrics_port != 0 and port == config.metrics_port != config.port
    tls = config.tls_port != 0 and port == config.tls_port
    listener = "metrics" if metrics else "TLS KV/DCP" if tls else "KV/DCP"
    return f"cannot listen on {_address(host, port)} ({listener}): {reason}"


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _prepare_data_dir(path: Path) -> None:
    """Create the data directory and prove it writable, or fail naming it.

    A probe file is written (and removed) rather than asking ``os.access``: that answers yes
    to root on any directory, and knows nothing of read-only mounts.

    Raises:
        click.ClickException: the path is (or lies under) a file, or cannot be written.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        # The nearest path on the way that is there (or a dangling link) but not a directory.
        there = (p for p in (path, *path.parents) if p.exists() or p.is_symlink())
        blocker = next((p for p in there if not p.is_dir()), path)
        if blocker == path:
            raise click.ClickException(f"data dir {path} is a file, not a directory") from None
        raise click.ClickException(
            f"data dir {path} cannot be created: {blocker} is a file, not a directory"
        ) from None
    except OSError as error:
        raise click.ClickException(
            f"data dir {path} is not writable: cannot create it ({error.strerror})"
        ) from None
    try:
        with tempfile.TemporaryFile(dir=path, prefix=".write-probe."):
            pass
    except OSError as error:
        raise click.ClickException(f"data dir {path} is not writable ({error.strerror})") from None


@click.group()
def user() -> None:
    """Manage the users file (salted SCRAM keys; passwords are never stored)."""


@user.command("add")
@click.argument("name")
@click.option("--password", prompt=True, hide_input=True, confirmation_prompt=True)
@click.option(
    "--role",
    "roles",
    multiple=True,
    type=click.Choice(sorted(ROLE_PRIVILEGES)),
    help="Repeat for several. New users default to admin; an existing user keeps its roles.",
)
@click.option(
    "--data-dir", type=click.Path(path_type=Path), default=NodeConfig().data_dir, show_default=True
)
def user_add(name: str, password: str, roles: tuple[str, ...], data_dir: Path) -> None:
    """Add NAME (or change its password and, with --role, its roles)."""
    if not password:
        raise click.BadParameter("must not be empty", param_hint="'--password'")
    path = NodeConfig(data_dir=data_dir).users_path
    try:
        users = Users.load(path) if path.exists() else Users()
        users.add(name, password, roles=roles or None)
        users.save(path)
    except UsersError as error:
        raise click.ClickException(str(error)) from None
    except OSError as error:
        raise click.ClickException(f"cannot write {path}: {error.strerror}") from None
    click.echo(f"user {name} saved in {path}")


@user.command("list")
@click.option(
    "--data-dir", type=click.Path(path_type=Path), default=NodeConfig().data_dir, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of names.")
def user_list(data_dir: Path, as_json: bool) -> None:
    """Print the user names, one a line."""
    try:
        users = Users.load(NodeConfig(data_dir=data_dir).users_path)
    except UsersError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        click.echo(json.dumps(users.names()))
        return
    for name in users.names():
        click.echo(name)
