"""The bucket's collections manifest on this node: the current one, kept durably with the bucket.

On a single node the manifest is a file beside the bucket's store, `collections.json`, replaced
atomically (written to a temporary file, fsynced, renamed over, the directory fsynced), so a
crash leaves the old manifest or the new one. A bucket without the file has the default
manifest (uid 0), which is how every bucket started before collections existed.

A change goes through `ManifestStore.apply` (the rules are `Manifest.check_successor`), which
persists first and then tells the listeners (the DCP side, the lazy purge) in the same call.
On a cluster the manifest lives in etcd (cluster/manifest_store.py): a change a client asks
for goes to the `proposer` it sets (SET_COLLECTIONS_MANIFEST awaits it), and each node applies
the etcd copy here with `apply`; this file is then the node's cache of it. `activated(vb)`
tells the activation listeners that a vbucket became active here (a promoted copy writes the
system events it lacks: server/collection_events.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

from changefeed.protocol.collections import SYSTEM_COLLECTION
from changefeed.protocol.collections_manifest import RESERVED_IDS_MAX, Manifest, ManifestError

log = logging.getLogger("changefeed.server")

MANIFEST_FILE: Final = "collections.json"
MANIFEST_BYTES_MAX: Final = 4 * 1024 * 1024  # 1000 collections take ~60 KiB

Listener = Callable[[Manifest, Manifest], None]
Proposer = Callable[[Manifest], Awaitable[None]]


class ManifestStore:
    """The current manifest of one bucket and where it is kept.

    Args:
        directory: the bucket's directory (None: kept in memory only, for tests and tools).
    """

    def __init__(self, directory: Path | None, manifest: Manifest | None = None) -> None:
        self.directory = directory
        self._manifest = manifest if manifest is not None else Manifest.default()
        self._listeners: list[Listener] = []
        self._activation_listeners: list[Callable[[int], object]] = []
        # Set on a cluster: where a client's change goes (etcd), instead of `apply` here.
        self.proposer: Proposer | None = None
        # True on a node that will join a cluster: until `proposer` is set (the agent connected
        # to etcd), a change is refused, not applied here alone (the nodes would diverge).
        self.joining_cluster = False
        self._ever_scopes: dict[int, int] = {}  # every collection this process saw -> scope
        self._refresh_ids()

    @classmethod
    def open(cls, directory: Path) -> ManifestStore:
        """Load the bucket's manifest (the default one if it never had another).

        Raises:
            ManifestError: the stored manifest is damaged (the message names the file).
        """
        path = directory / MANIFEST_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls(directory)
        if len(data) > MANIFEST_BYTES_MAX:
            raise ManifestError(f"{path}: {len(data)} bytes, more than {MANIFEST_BYTES_MAX}")
        try:
            return cls(directory, Manifest.decode(data))
        except ManifestError as error:
            raise ManifestError(f"{path}: {error}") from None

    @property
    def current(self) -> Manifest:
        return self._manifest

    @property
    def uid(self) -> int:
        return self._manifest.uid

    def collection_ids(self) -> frozenset[int]:
        """Ids of the collections that exist now (a set lookup on the KV path)."""
        return self._ids

    def max_ttl(self, collection_id: int) -> int | None:
        return self._ttls.get(collection_id)

    def scope_of(self, collection_id: int) -> int | None:
        """The scope a collection is in, or was in when it was dropped (a stream filtered by
        scope still sends the changes a dropped collection made before its drop event)."""
        return self._ever_scopes.get(collection_id)

    def dropped(self, collection_id: int) -> bool:
        """Whether documents of `collection_id` belong to a collection this manifest dropped
        (compaction purges them). Ids above uid + 7 were never given by this manifest (a
        collection another node created, not known here yet): kept. The system collection
        (1, system events) is never dropped."""
        if collection_id in self._ids or collection_id == SYSTEM_COLLECTION:
            return False
        return collection_id <= self._manifest.uid + RESERVED_IDS_MAX

    def scope_uids(self) -> frozenset[int]:
        return self._scope_uids

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(old, new)` after every change (after it is durable)."""
        self._listeners.append(listener)

    def add_activation_listener(self, listener: Callable[[int], object]) -> None:
        """Call `listener(vb)` whenever vbucket `vb` becomes active on this node."""
        self._activation_listeners.append(listener)

    def activated(self, vb: int) -> None:
        """Vbucket `vb` just became active here (server/context.py calls it on the edge)."""
        for listener in list(self._activation_listeners):
            listener(vb)

    def apply(self, new: Manifest) -> None:
        """Make `new` the manifest: check, persist, then tell the listeners.

        Raises:
            ManifestError: `new` may not follow the current manifest.
        """
        old = self._manifest
        old.check_successor(new)
        if self.directory is not None:
            _write_atomically(self.directory / MANIFEST_FILE, new.encode())
        self._manifest = new
        self._refresh_ids()
        log.info("collections manifest %x -> %x", old.uid, new.uid)
        for listener in list(self._listeners):
            listener(old, new)

    def _refresh_ids(self) -> None:
        by_id = self._manifest.by_id()
        self._ids = frozenset(by_id)
        self._ttls = {cid: c.max_ttl for cid, (_, c) in by_id.items() if c.max_ttl}
        self._ever_scopes.update({cid: s.uid for cid, (s, _) in by_id.items()})
        self._scope_uids = frozenset(self._manifest.scope_ids())


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
