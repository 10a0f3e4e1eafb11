"""Reading and changing a node's collections manifest over the KV port, as a client.

`edit_manifest` reads the manifest (GET_COLLECTIONS_MANIFEST), applies a pure edit
(protocol/collections_manifest.py) and sends the whole result (SET_COLLECTIONS_MANIFEST); when
someone else changed the manifest meanwhile the node answers ERANGE and the edit is redone on
the new manifest, so concurrent `changefeed collection create` calls both land.

`edit_cluster_manifest` does the same on every node of the cluster map: it edits the newest
manifest any node holds and sets the result on each node (a node that missed an earlier change
takes the newer manifest whole). Each node writes the system events into the vbuckets active on
it, and replication carries them to the replicas. On a cluster (nodes started with --etcd) the
bootstrap node's SET writes the etcd copy under the orchestrator's fence and every node applies
it from there (cluster/manifest_store.py): the other nodes are then only checked, and a node
down meanwhile applies it when it is back. A node that cannot be reached is reported.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import call
from changefeed.protocol.collections import decode_id_extras
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.errors import StatusError
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status
from changefeed.vbmap import ClusterMap

EDIT_ATTEMPTS_MAX = 16  # concurrent editors each win within a few rounds


async def get_manifest(conn: Connection) -> Manifest:
    """The node's current manifest.

    Raises:
        ManifestError: the node sent a manifest that breaks the rules.
        StatusError: the node refused.
    """
    response = await call(conn, Opcode.GET_COLLECTIONS_MANIFEST)
    return Manifest.decode(response.value)


async def collection_id(conn: Connection, path: str) -> tuple[int, int]:
    """(manifest uid, collection id) of ``scope.collection`` (GET_COLLECTION_ID).

    Raises:
        StatusError: UNKNOWN_SCOPE / UNKNOWN_COLLECTION, or EINVAL for a bad path.
    """
    response = await call(conn, Opcode.GET_COLLECTION_ID, value=path.encode())
    return decode_id_extras(response.extras)


async def edit_manifest(conn: Connection, edit: Callable[[Manifest], Manifest]) -> Manifest:
    """Apply `edit` to the node's manifest and return the manifest that was set.

    Raises:
        ManifestError: the edit is not possible (the message names the scope or collection).
        StatusError: the node refused the new manifest, or others kept changing it.
    """
    for _ in range(EDIT_ATTEMPTS_MAX):  # bounded: ERANGE means another editor won a round
        current = await get_manifest(conn)
        new = edit(current)
        try:
            await call(conn, Opcode.SET_COLLECTIONS_MANIFEST, value=new.encode())
        except StatusError as error:
            if error.code == Status.ERANGE:
                continue
            raise
        return new
    raise StatusError(
        f"the manifest changed under {EDIT_ATTEMPTS_MAX} attempts to edit it", status=Status.ERANGE
    )


Dial = Callable[[str, int], Awaitable[Connection]]


async def edit_cluster_manifest(
    conn: Connection, dial: Dial, edit: Callable[[Manifest], Manifest]
) -> tuple[Manifest, dict[str, str]]:
    """Apply `edit` on every node of the map `conn`'s node serves (module docstring).

    Returns:
        The manifest set, and per node (host:port) "set" or why not.

    Raises:
        ManifestError: the edit is not possible.
        StatusError: the bootstrap node refused, or others kept changing the manifest.
    """
    config = json.loads((await call(conn, Opcode.GET_CLUSTER_CONFIG)).value)
    cluster_map = ClusterMap.from_couchbase_config(config)
    this = next(
        (
            f"{entry['hostname']}:{entry['services']['kv']}"
            for entry in config.get("nodesExt", [])
            if entry.get("thisNode")
        ),
        "bootstrap",
    )
    others: dict[str, Connection] = {}
    outcome: dict[str, str] = {}
    try:
        for node in cluster_map.nodes:  # bounded by the map
            server = f"{node.host}:{node.port}"
            if server == this:
                continue
            try:
                others[server] = await dial(node.host, node.port)
            except (OSError, TimeoutError, StatusError) as error:
                outcome[server] = f"unreachable: {error}"
        nodes = {this: conn, **others}
        for _ in range(EDIT_ATTEMPTS_MAX):  # bounded: ERANGE means another editor won a round
            held = {name: await get_manifest(c) for name, c in nodes.items()}
            new = edit(max(held.values(), key=lambda m: m.uid))
            try:  # the bootstrap node first: on a cluster it writes the etcd copy
                await call(conn, Opcode.SET_COLLECTIONS_MANIFEST, value=new.encode())
            except StatusError as error:
                if error.code == Status.ERANGE:
                    continue
                raise
            outcome[this] = "set"
            for name, c in others.items():
                outcome[name] = await _bring_up(c, new)
            return new, outcome
        raise StatusError(
            f"the manifest changed under {EDIT_ATTEMPTS_MAX} attempts to edit it",
            status=Status.ERANGE,
        )
    finally:
        for c in others.values():
            await c.close()


async def _bring_up(conn: Connection, new: Manifest) -> str:
    """Make `conn`'s node hold `new` (or a newer manifest): "set", or why not. On a cluster it
    applies the etcd copy by itself; a SET it gets meanwhile is ERANGE once etcd holds `new`,
    and the node applied that copy before answering, so the next read shows it."""
    for _ in range(EDIT_ATTEMPTS_MAX):  # bounded: each ERANGE is followed by a read
        if (await get_manifest(conn)).uid >= new.uid:
            return "set"
        try:
            await call(conn, Opcode.SET_COLLECTIONS_MANIFEST, value=new.encode())
        except StatusError as error:
            if error.code == Status.ERANGE:
                continue
            return f"refused: {error}"
        return "set"
    return f"still below manifest uid {new.uid:x} after {EDIT_ATTEMPTS_MAX} attempts"
