"""The bucket's collections manifest on a cluster: one copy in etcd, changed under the
orchestrator's fence, applied by every node.

Key ``/changefeed/<cluster>/manifest``: the manifest JSON (kv_engine's format,
protocol/collections_manifest.py). On a single node the manifest stays in the bucket's
``collections.json`` (server/manifest.py); on a cluster that file is each node's cache of the
etcd copy, so a node restarted while etcd is away still serves the collections it knew.

- A change (`propose`, what SET_COLLECTIONS_MANIFEST does on a cluster node, so both
  ``changefeed collection`` and any KV management call go through it) reads the etcd copy,
  checks that the new manifest follows it (`Manifest.check_successor`) and writes it in one
  etcd transaction (`ClusterMetadata.put_document_fenced`): the key unchanged since it was
  read (concurrent editors: one wins, the other is told ERANGE and redoes its edit), the
  orchestrator's leader key and fencing token unchanged (the change lands within one
  leadership, ordered with its map writes), and this node still a registered member (a node
  whose lease lapsed — about to be failed over — cannot change it). Then the node applies it
  at once; the others apply it from their watch.
- Every node follows the key (`follow`) and applies each newer manifest to its
  `ManifestStore`: it persists it locally and writes the system events into the vbuckets
  active on it (server/collection_events.py); replicas get them by replication. A vbucket that
  becomes active later — a promotion after a failover that happened while the manifest
  changed — writes the events it lacks itself (`SystemEventWriter.catch_up`), so a collection
  created during a failover is on the promoted copy.
- A cluster whose etcd has no manifest yet is seeded with this node's (one made before the
  cluster kept it in etcd), if it has one.
"""

from __future__ import annotations

import asyncio
import logging

from changefeed.cluster.metadata import ClusterMetadata
from changefeed.protocol.collections_manifest import Manifest, ManifestError
from changefeed.protocol.errors import InvalidArgumentsError, RangeError, TemporaryFailureError
from changefeed.server.manifest import MANIFEST_BYTES_MAX, ManifestStore

log = logging.getLogger("changefeed.cluster")

MANIFEST_KEY = "manifest"
FOLLOW_RETRY_S = 0.5  # after the watch broke (etcd away): it also retries inside


class ClusterManifest:
    """The etcd copy of the manifest for one node (module docstring).

    Args:
        metadata: the node's etcd client.
        manifests: the node's manifest (applied here; its `proposer` is set to `propose`).
        node_name: this node's member name (the writer the fence checks).
    """

    def __init__(self, metadata: ClusterMetadata, manifests: ManifestStore, node_name: str) -> None:
        self.metadata = metadata
        self.manifests = manifests
        self.node_name = node_name
        self.applied_from_etcd = 0  # manifests applied from the watch (STAT, tests)
        manifests.proposer = self.propose

    async def read(self) -> tuple[Manifest, int] | None:
        """The etcd copy and its mod revision, or None before the first.

        Raises:
            MetadataUnavailableError: etcd did not answer.
            ManifestError: the stored manifest is malformed (the message names the key).
        """
        found = await self.metadata.read_document(MANIFEST_KEY)
        if found is None:
            return None
        data, revision = found
        return _decode(data, self.metadata.key(MANIFEST_KEY)), revision

    async def propose(self, new: Manifest) -> None:
        """Make `new` the cluster's manifest (module docstring), then this node's.

        Raises:
            RangeError: `new` does not follow the etcd copy (someone changed it: read it again
                and redo the edit); this node applied the newer copy first.
            InvalidArgumentsError: `new` breaks a rule against the etcd copy.
            TemporaryFailureError: etcd did not answer, no orchestrator leads, or this node
                is not a registered member now: retry.
        """
        try:
            stored = await self.read()
        except ConnectionError as error:
            raise TemporaryFailureError(f"the manifest in etcd: {error}") from None
        current, revision = stored if stored is not None else (self.manifests.current, None)
        if new.uid <= current.uid:
            self._apply(current)
            raise RangeError(f"manifest uid {new.uid:x} is not above the current {current.uid:x}")
        try:
            current.check_successor(new)
        except ManifestError as error:
            raise InvalidArgumentsError(str(error)) from None
        if len(new.encode()) > MANIFEST_BYTES_MAX:
            raise InvalidArgumentsError(f"manifest of {len(new.encode())} bytes is too large")
        try:
            written = await self.metadata.put_document_fenced(
                MANIFEST_KEY, new.encode(), revision, writer=self.node_name
            )
        except ConnectionError as error:
            raise TemporaryFailureError(f"writing the manifest to etcd: {error}") from None
        if written is None:
            # The key moved (another editor: ERANGE, redo the edit), or the fence did not hold.
            again = await self.read()
            if again is not None and again[1] != revision:
                self._apply(again[0])
                raise RangeError(f"the manifest changed meanwhile (uid {again[0].uid:x})")
            raise TemporaryFailureError(
                "the manifest was not written: no orchestrator leads, or this node's "
                "membership lapsed; retry"
            )
        log.info("manifest uid %x written to etcd (revision %d)", new.uid, written)
        self._apply(new)

    async def follow(self) -> None:
        """Apply every newer etcd copy to this node (never ends; survives etcd outages).
        Seeds an empty key with this node's manifest first, if it has one."""
        while True:  # the watch; started again after a failure, ended by cancellation
            try:
                await self._seed()
                async for data, _ in self.metadata.watch_document(MANIFEST_KEY):
                    try:
                        manifest = _decode(data, self.metadata.key(MANIFEST_KEY))
                    except ManifestError as error:
                        log.error("%s", error)
                        continue
                    if self._apply(manifest):
                        self.applied_from_etcd += 1
            except ConnectionError as error:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from error
                log.warning("manifest watch: %s; watching again", error)
                await asyncio.sleep(FOLLOW_RETRY_S)

    async def _seed(self) -> None:
        local = self.manifests.current
        if local.uid == 0 or await self.read() is not None:
            return
        written = await self.metadata.put_document_fenced(
            MANIFEST_KEY, local.encode(), None, writer=self.node_name
        )
        if written is not None:
            log.info("etcd had no manifest: seeded with this node's (uid %x)", local.uid)

    def _apply(self, manifest: Manifest) -> bool:
        """Apply `manifest` here if it is newer than this node's; True if it was."""
        if manifest.uid <= self.manifests.uid:
            if manifest.uid < self.manifests.uid:
                log.warning(
                    "etcd's manifest uid %x is behind this node's %x: kept this node's",
                    manifest.uid, self.manifests.uid,
                )  # fmt: skip
            return False
        try:
            self.manifests.apply(manifest)
        except ManifestError as error:
            log.error("manifest uid %x from etcd not applied: %s", manifest.uid, error)
            return False
        return True


def _decode(data: bytes, where: bytes) -> Manifest:
    if len(data) > MANIFEST_BYTES_MAX:
        raise ManifestError(f"{where.decode()}: {len(data)} bytes, over {MANIFEST_BYTES_MAX}")
    try:
        return Manifest.decode(data)
    except ManifestError as error:
        raise ManifestError(f"{where.decode()}: {error}") from None
