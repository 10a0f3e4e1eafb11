"""Reading and changing a node's collections manifest over the KV port, as a client.

`edit_manifest` reads the manifest (GET_COLLECTIONS_MANIFEST), applies a pure edit
(protocol/collections_manifest.py) and sends the whole result (SET_COLLECTIONS_MANIFEST); when
someone else changed the manifest meanwhile the node answers ERANGE and the edit is redone on
the new manifest, so concurrent `changefeed collection create` calls both land.
"""

from __future__ import annotations

from collections.abc import Callable

from changefeed.consumer.connection import Connection
from changefeed.consumer.handshake import call
from changefeed.protocol.collections import decode_id_extras
from changefeed.protocol.collections_manifest import Manifest
from changefeed.protocol.errors import StatusError
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status

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
