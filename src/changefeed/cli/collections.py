"""``changefeed collection create|drop|list``: a bucket's scopes and collections.

Each subcommand connects to a node over the KV port and reads its manifest; ``create`` and
``drop`` edit it through that node (on a cluster, the etcd copy: cluster/manifest_store.py),
check every node of the cluster map (consumer/collections_admin.py), and exit 1 naming a node
they could not confirm (it applies the manifest from etcd when it is back). ``create`` makes
the scope too when it does not exist yet; ``drop`` of a collection leaves its scope;
``drop SCOPE`` drops a scope with its collections.
Changing the manifest needs the admin role.
"""

from __future__ import annotations

import json
from typing import Any

import click

from changefeed.cli.client_commands import Target, connection_options, run_against
from changefeed.consumer.collections_admin import edit_cluster_manifest, get_manifest
from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import connect
from changefeed.protocol.collections_manifest import Manifest, ManifestError


def _split(path: str) -> tuple[str, str | None]:
    """``scope.collection`` -> (scope, collection); ``scope`` -> (scope, None)."""
    scope, dot, name = path.partition(".")
    if not scope or (dot and not name) or "." in name:
        raise click.BadParameter(f"{path!r} is not SCOPE or SCOPE.COLLECTION")
    return scope, name or None


def _rows(manifest: Manifest) -> list[dict[str, Any]]:
    return [
        {
            "scope": scope.name,
            "scope_id": f"{scope.uid:x}",
            "collection": c.name,
            "collection_id": f"{c.uid:x}",
            "max_ttl": c.max_ttl,
        }
        for scope in manifest.scopes
        for c in scope.collections
    ]


def _run(kwargs: dict[str, Any], edit: Any | None) -> tuple[Manifest, dict[str, str]]:
    target = Target(kwargs["host"], kwargs["port"], kwargs["user"])

    async def dial(host: str, port: int) -> Connection:
        return await connect(
            host,
            port,
            agent="changefeed-collection",
            user=kwargs["user"],
            password=kwargs["password"],
            bucket=kwargs["bucket"],
        )

    async def main() -> tuple[Manifest, dict[str, str]]:
        conn = await dial(kwargs["host"], kwargs["port"])
        try:
            if edit is None:
                return await get_manifest(conn), {}
            return await edit_cluster_manifest(conn, dial, edit)
        finally:
            await conn.close()

    try:
        return run_against(main(), target)
    except ManifestError as error:
        raise click.ClickException(str(error)) from None


@click.group()
def collection() -> None:
    """Scopes and collections of a bucket (SCOPE.COLLECTION names a collection)."""


@collection.command("list")
@connection_options
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def list_(as_json: bool, **kwargs: Any) -> None:
    """List the scopes and collections, with ids and maxTTL."""
    manifest, _ = _run(kwargs, None)
    if as_json:
        click.echo(json.dumps({"uid": f"{manifest.uid:x}", "collections": _rows(manifest)}))
        return
    click.echo(f"manifest uid {manifest.uid:x}")
    for row in _rows(manifest):
        ttl = f"  maxTTL {row['max_ttl']} s" if row["max_ttl"] else ""
        name = f"{row['scope']}.{row['collection']}"
        click.echo(f"{name:40} id {row['collection_id']:>6}{ttl}")


@collection.command()
@connection_options
@click.argument("path")
@click.option("--max-ttl", type=click.IntRange(0, 2**31 - 1), help="Seconds a document lives.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def create(path: str, max_ttl: int | None, as_json: bool, **kwargs: Any) -> None:
    """Create SCOPE, or the collection SCOPE.COLLECTION (and its scope if missing)."""
    scope, name = _split(path)

    def edit(m: Manifest) -> Manifest:
        if m.scope(scope) is None:
            m = m.with_scope(scope)
            if name is None:
                return m
        elif name is None:
            raise ManifestError(f"scope {scope!r} exists")
        assert name is not None
        return m.with_collection(scope, name, max_ttl or None)

    _report(*_run(kwargs, edit), path, "created", as_json)


@collection.command()
@connection_options
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def drop(path: str, as_json: bool, **kwargs: Any) -> None:
    """Drop the collection SCOPE.COLLECTION, or SCOPE with all its collections. Their
    documents are deleted in the background (compaction purges them)."""
    scope, name = _split(path)

    def edit(m: Manifest) -> Manifest:
        return m.without_scope(scope) if name is None else m.without_collection(scope, name)

    _report(*_run(kwargs, edit), path, "dropped", as_json)


def _report(
    manifest: Manifest, nodes: dict[str, str], path: str, what: str, as_json: bool
) -> Manifest:
    scope, name = _split(path)
    ident = None
    found = manifest.scope(scope)
    if found is not None:
        coll = found.collection(name) if name else None
        ident = coll.uid if coll is not None else (found.uid if name is None else None)
    if as_json:
        click.echo(
            json.dumps(
                {
                    what: path,
                    "id": None if ident is None else f"{ident:x}",
                    "uid": f"{manifest.uid:x}",
                    "nodes": nodes,
                }
            )
        )
    else:
        shown = "" if ident is None else f" (id {ident:x})"
        click.echo(f"{what} {path}{shown}; manifest uid {manifest.uid:x} on {len(nodes)} node(s)")
    missed = sorted(node for node, outcome in nodes.items() if outcome != "set")
    if missed:
        raise click.ClickException(
            f"not confirmed on {', '.join(missed)} ({nodes[missed[0]]}): the manifest is in "
            "etcd and a node applies it when it is back (`changefeed collection list --port` "
            "on it shows its manifest uid)"
        )
    return manifest
