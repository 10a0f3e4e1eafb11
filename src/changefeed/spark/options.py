"""Options of the ``changefeed`` Spark source, named like Spark's Kafka source where they mean
the same thing.

- ``cluster``: seed nodes ``host:port[,host:port...]``, like a Couchbase connection string (a
  ``couchbase://`` or ``changefeed://`` prefix is allowed); default ``127.0.0.1:11210``. Any
  reachable seed gives the cluster map; each vbucket is then read from its active node
  (``cluster.py``). One seed is enough; more let a query start while some are down.
- ``nodeTimeoutS``: how long planning keeps asking for a vbucket whose active node does not
  answer or has moved (refreshing the map meanwhile: a failover takes a few seconds) before it
  fails, naming the node; default 30.
- ``bucket``: default ``default``.
- ``user`` / ``password``: else ``CHANGEFEED_USER`` / ``CHANGEFEED_PASSWORD``; default
  ``Administrator`` / ``password``.
- ``vbuckets``: ``all`` (default) or a list like ``0-15,32``.
- ``startingOffsets``: ``earliest`` (default), ``latest`` or JSON ``{"vb": {offset}}``.
- ``maxOffsetsPerTrigger``: most seqnos per micro-batch, all vbuckets together (rows <= seqnos).
- ``failOnDataLoss``: ``true`` (default) fails the query when a stream must restart from seqno 0
  (history since the offset is gone, or tombstones were purged); ``false`` emits a rollback row
  to seqno 0 and lets the sink rebuild the vbucket.
- ``partitions``: Spark partitions per micro-batch (vbuckets are grouped); default 2.
- ``format``: ``json`` (default) parses each document into typed columns; ``binary`` keeps it
  as the ``value`` bytes (``documents.py``).
- ``schema``: the documents' fields, as a DDL string (``"name string, age int"``) or a
  ``StructType`` as JSON (``struct.json()``); else ``inferSchema``.
- ``inferSchema``: ``true`` (default when no ``schema`` is given) samples the newest
  ``inferSchemaSamples`` (default 100) changes of each vbucket and infers the fields.
- ``mode``: ``PERMISSIVE`` (default), ``DROPMALFORMED`` or ``FAILFAST``, as Spark's JSON reader;
  ``columnNameOfCorruptRecord``: default ``_corrupt_record``.
- ``transport``: ``tcp`` (default, a DCP stream per partition) or ``shm``: the node's
  shared-memory services (executors on the node's host, a node started with ``--shm``;
  changefeed.ipc), over DCP what the ring no longer holds. ``shmDir``: where they live.
- ``collections``: ``scope.collection,...`` (only those), or ``*`` (every collection);
  ``scope``: every collection of one scope. Either makes the source collection-aware: rows get
  the columns ``scope`` and ``collection`` (names; ``key`` is the document key without the
  collection id) and the node streams only the chosen collections (``collection_rows.py``).
  Neither: the default collection only, as before collections.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from changefeed.protocol.collections_manifest import ManifestError, check_name
from changefeed.spark.documents import CORRUPT_COLUMN, FORMATS, MODES

# A failover takes a few seconds (lease timeout, election, promotion): planning waits this long
# for a vbucket's active to answer before it fails the query, naming the node.
NODE_TIMEOUT_S = 30.0


class OptionError(ValueError):
    """A bad option; the message names it."""


@dataclass(frozen=True, slots=True)
class SourceOptions:
    host: str = "127.0.0.1"  # the first seed (``seeds[0]``), for callers that dial one node
    port: int = 11210
    bucket: str = "default"
    user: str = "Administrator"
    password: str = "password"
    vbuckets: str = "all"
    starting_offsets: str = "earliest"
    max_offsets_per_trigger: int = 0
    fail_on_data_loss: bool = True
    partitions: int = 2
    format: str = "json"
    schema: str = ""
    infer_schema: bool = True
    infer_samples: int = 100
    mode: str = "PERMISSIVE"
    corrupt_column: str = CORRUPT_COLUMN
    transport: str = "tcp"
    shm_dir: str = ""
    # Every seed node in the order given; empty means (host, port) alone.
    seeds: tuple[tuple[str, int], ...] = ()
    node_timeout_s: float = NODE_TIMEOUT_S
    # Collections (``scope.collection`` names); ``ALL_COLLECTIONS`` alone: every collection.
    collections: tuple[str, ...] = ()
    scope: str | None = None

    @classmethod
    def parse(cls, options: dict[str, str]) -> SourceOptions:
        """Raises OptionError naming the option."""
        lowered = {k.lower(): v for k, v in options.items()}
        seeds = _seeds(lowered.get("cluster", "127.0.0.1:11210"))
        return cls(
            host=seeds[0][0],
            port=seeds[0][1],
            seeds=seeds,
            node_timeout_s=_seconds(lowered, "nodetimeouts", NODE_TIMEOUT_S),
            bucket=lowered.get("bucket", "default"),
            user=lowered.get("user", os.environ.get("CHANGEFEED_USER", "Administrator")),
            password=lowered.get("password", os.environ.get("CHANGEFEED_PASSWORD", "password")),
            vbuckets=lowered.get("vbuckets", "all"),
            starting_offsets=lowered.get("startingoffsets", "earliest"),
            max_offsets_per_trigger=_int(lowered, "maxoffsetspertrigger", 0),
            fail_on_data_loss=bool_option(lowered, "failondataloss", True),
            partitions=max(1, _int(lowered, "partitions", 2)),
            format=_choice(lowered, "format", FORMATS, "json").lower(),
            schema=lowered.get("schema", "").strip(),
            infer_schema=bool_option(lowered, "inferschema", "schema" not in lowered),
            infer_samples=max(1, _int(lowered, "inferschemasamples", 100)),
            mode=_choice(lowered, "mode", MODES, "PERMISSIVE").upper(),
            corrupt_column=lowered.get("columnnameofcorruptrecord", CORRUPT_COLUMN),
            transport=_choice(lowered, "transport", ("tcp", "shm"), "tcp").lower(),
            shm_dir=lowered.get("shmdir", ""),
            collections=_collections(lowered.get("collections", "")),
            scope=_scope(lowered),
        )._checked()

    def _checked(self) -> SourceOptions:
        if self.collections and self.scope is not None:
            raise OptionError("give option collections or option scope, not both")
        if self.collections_aware and self.transport == "shm":
            raise OptionError("option collections/scope: collections are read over tcp only")
        return self

    @property
    def collections_aware(self) -> bool:
        """True when rows carry ``scope`` and ``collection`` (options collections/scope)."""
        return bool(self.collections) or self.scope is not None

    @property
    def collection_filter(self) -> tuple[str, ...]:
        """The collections to stream (``scope.collection``); empty: every one (or the
        scope's, or the default collection when not collection-aware)."""
        return () if self.collections == (ALL_COLLECTIONS,) else self.collections

    def wants(self, scope: str, collection: str) -> bool:
        """Whether the collection ``scope.collection`` is one the options choose."""
        if not self.collections_aware:
            return scope == collection == DEFAULT_NAME
        if self.scope is not None:
            return scope == self.scope
        return not self.collection_filter or f"{scope}.{collection}" in self.collection_filter

    @property
    def seed_nodes(self) -> tuple[tuple[str, int], ...]:
        """The seeds to bootstrap from, in order (a hand-built ``SourceOptions`` without
        ``seeds`` has its one node)."""
        return self.seeds or ((self.host, self.port),)

    @property
    def cluster_text(self) -> str:
        """The seeds as the ``cluster`` option spells them (for messages)."""
        return ",".join(f"{host}:{port}" for host, port in self.seed_nodes)

    @property
    def documents_as_json(self) -> bool:
        """True when documents become typed columns (``format=json``)."""
        return self.format == "json"

    def vbucket_ids(self, total: int) -> list[int]:
        if self.vbuckets == "all":
            return list(range(total))
        out: list[int] = []
        try:
            for part in self.vbuckets.split(","):
                low, dash, high = part.strip().partition("-")
                first = int(low)
                last = int(high) if dash else first  # "3-" is malformed, not "3"
                if last < first:
                    raise ValueError(f"empty range {part!r}")  # "3-1" would select nothing
                out.extend(range(first, last + 1))
        except ValueError:
            raise OptionError(
                f"option vbuckets must look like 0-15,32: {self.vbuckets!r}"
            ) from None
        bad = [vb for vb in out if not 0 <= vb < total]
        if bad:
            raise OptionError(f"option vbuckets names vbuckets outside 0..{total - 1}: {bad}")
        return sorted(set(out))

    def starting_json(self) -> dict[str, Any] | None:
        """The JSON form of ``startingOffsets``, or None for earliest/latest."""
        if self.starting_offsets in ("earliest", "latest"):
            return None
        try:
            value = json.loads(self.starting_offsets)
        except ValueError as error:
            raise OptionError(
                f"option startingOffsets is not earliest/latest/JSON: {error}"
            ) from None
        if not isinstance(value, dict):
            raise OptionError("option startingOffsets JSON must be an object of vbucket -> offset")
        return value


ALL_COLLECTIONS = "*"
DEFAULT_NAME = "_default"


def _collections(text: str) -> tuple[str, ...]:
    """``scope.collection,...`` (or ``*``) -> the names, checked (an empty part of a name is
    ``_default``, as GET_COLLECTION_ID reads it); duplicates dropped, order kept."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if parts == [ALL_COLLECTIONS]:
        return (ALL_COLLECTIONS,)
    out: list[str] = []
    for part in parts:
        names = part.split(".")
        if len(names) != 2:
            raise OptionError(
                f"option collections: {part!r} is not scope.collection (or give * for all)"
            )
        scope, name = (n or DEFAULT_NAME for n in names)
        try:
            check_name(scope, "scope", allow_default=True)
            check_name(name, "collection", allow_default=True)
        except ManifestError as error:
            raise OptionError(f"option collections: {error}") from None
        if f"{scope}.{name}" not in out:
            out.append(f"{scope}.{name}")
    return tuple(out)


def _scope(options: dict[str, str]) -> str | None:
    raw = options.get("scope")
    if raw is None:
        return None
    name = raw.strip()
    try:
        check_name(name, "scope", allow_default=True)
    except ManifestError as error:
        raise OptionError(f"option scope: {error}") from None
    return name


def _seeds(cluster: str) -> tuple[tuple[str, int], ...]:
    """``host:port[,host:port...]`` (one prefix for the whole string, as in a Couchbase
    connection string) -> the seeds in order, duplicates dropped."""
    text = cluster.strip()
    for prefix in ("couchbase://", "changefeed://"):
        text = text.removeprefix(prefix)
    seeds: list[tuple[str, int]] = []
    for part in text.split(","):
        node = part.strip()
        for prefix in ("couchbase://", "changefeed://"):
            node = node.removeprefix(prefix)
        host, _, port = node.rpartition(":")
        if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
            raise OptionError(
                f"option cluster must be host:port or a list host:port,host:port, not {cluster!r}"
            )
        if (host, int(port)) not in seeds:
            seeds.append((host, int(port)))
    return tuple(seeds)


def _seconds(options: dict[str, str], name: str, default: float) -> float:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise OptionError(f"option {name} must be a number of seconds, not {raw!r}") from None
    if not value > 0:
        raise OptionError(f"option {name} must be > 0")
    return value


def _int(options: dict[str, str], name: str, default: int) -> int:
    raw = options.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise OptionError(f"option {name} must be an integer, not {raw!r}") from None
    if value < 0:
        raise OptionError(f"option {name} must be >= 0")
    return value


def bool_option(options: dict[str, str], name: str, default: bool) -> bool:
    """Option ``name`` of ``options`` (keys lower-cased) as true or false, ``default`` if absent.

    Raises:
        OptionError: neither true nor false (any case), naming the option and the value.
    """
    raw = options.get(name)
    if raw is None:
        return default
    if raw.lower() not in ("true", "false"):
        raise OptionError(f"option {name} must be true or false, not {raw!r}")
    return raw.lower() == "true"


def _choice(options: dict[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = options.get(name, default)
    if raw.lower() not in {c.lower() for c in choices}:
        raise OptionError(f"option {name} must be one of {', '.join(choices)}, not {raw!r}")
    return raw
