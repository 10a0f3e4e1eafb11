"""The collections manifest: a bucket's scopes and collections, their ids and the manifest uid,
as a value, its JSON (kv_engine's format, the body of GET/SET_COLLECTIONS_MANIFEST) and the
edits `changefeed collection create|drop` makes. No I/O.

    {"uid": "2", "scopes": [{"name": "_default", "uid": "0",
        "collections": [{"name": "_default", "uid": "0"},
                        {"name": "orders", "uid": "9", "maxTTL": 3600}]}]}

Ids and the uid are hex strings with no 0x. Rules (kv_engine docs/Collections.md, 0xb9):
names are 1..251 bytes of ``A-Z a-z 0-9 _ - %``, and a user's name does not start with ``_`` or
``%`` (``_default`` is the one such name); ids 1..7 are reserved; the ``_default`` scope (id 0)
exists. Beyond kv_engine's rules, and what keeps a dropped collection's documents from coming
back: an id is never given twice. Every id a manifest introduces lies in (old uid + 7, new uid +
7], so ids only grow with the uid and a new manifest cannot reuse one a dropped collection had.
The edits here allocate exactly so (the new uid + 7).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Final

DEFAULT_NAME: Final = "_default"
DEFAULT_ID: Final = 0
RESERVED_IDS_MAX: Final = 7  # ids 1..7 are kv_engine's
NAME_BYTES_MAX: Final = 251
_NAME: Final = re.compile(r"[A-Za-z0-9_\-%]+")
# Ids we hand out stay below 2**28 so a stored key (a marker, a 4-byte LEB128 and a 250-byte
# key) fits limits.STORED_KEY_SIZE_MAX (storage/keys.py).
ID_MAX: Final = 2**28 - 1


class ManifestError(ValueError):
    """A manifest or an edit that breaks the rules; the message names the value."""


@dataclasses.dataclass(frozen=True, slots=True)
class CollectionSpec:
    """One collection: its name, id and maxTTL (seconds; None: the bucket's, none here)."""

    name: str
    uid: int
    max_ttl: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class ScopeSpec:
    """One scope and its collections."""

    name: str
    uid: int
    collections: tuple[CollectionSpec, ...] = ()

    def collection(self, name: str) -> CollectionSpec | None:
        return next((c for c in self.collections if c.name == name), None)


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """A bucket's scopes and collections at manifest `uid`."""

    uid: int
    scopes: tuple[ScopeSpec, ...]

    @classmethod
    def default(cls) -> Manifest:
        """The manifest of a bucket nobody changed: uid 0, the default scope and collection."""
        return cls(0, (ScopeSpec(DEFAULT_NAME, DEFAULT_ID, (CollectionSpec(DEFAULT_NAME, 0),)),))

    def scope(self, name: str) -> ScopeSpec | None:
        return next((s for s in self.scopes if s.name == name), None)

    def by_id(self) -> dict[int, tuple[ScopeSpec, CollectionSpec]]:
        """Every collection by id, with its scope."""
        return {c.uid: (s, c) for s in self.scopes for c in s.collections}

    def scope_ids(self) -> dict[int, ScopeSpec]:
        return {s.uid: s for s in self.scopes}

    def resolve(self, path: str) -> tuple[ScopeSpec | None, CollectionSpec | None]:
        """Look up ``scope.collection`` as GET_COLLECTION_ID does (an empty part is
        ``_default``): (scope or None, collection or None).

        Raises:
            ManifestError: the path has not exactly one dot or a part is not a valid name.
        """
        parts = path.split(".")
        if len(parts) != 2:
            raise ManifestError(f"collection path {path!r} is not scope.collection")
        scope_name, name = (part or DEFAULT_NAME for part in parts)
        check_name(scope_name, "scope", allow_default=True)
        check_name(name, "collection", allow_default=True)
        scope = self.scope(scope_name)
        return scope, (scope.collection(name) if scope is not None else None)

    # -- JSON ---------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "uid": f"{self.uid:x}",
            "scopes": [
                {
                    "name": s.name,
                    "uid": f"{s.uid:x}",
                    "collections": [_collection_json(c) for c in s.collections],
                }
                for s in self.scopes
            ],
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> Manifest:
        """Parse and check a manifest (the body of SET_COLLECTIONS_MANIFEST, a stored one).

        Raises:
            ManifestError: not JSON, a missing or mistyped field, or a broken rule.
        """
        try:
            raw = json.loads(data)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json goes
            raise ManifestError(f"manifest {str(data)[:100]!r} is not JSON") from None
        if not isinstance(raw, dict):
            raise ManifestError("a manifest is a JSON object")
        scopes_raw = raw.get("scopes")
        if not isinstance(scopes_raw, list):
            raise ManifestError("a manifest needs a 'scopes' array")
        scopes = []
        for scope_raw in scopes_raw:
            if not isinstance(scope_raw, dict):
                raise ManifestError(f"scope entry {scope_raw!r} is not an object")
            collections_raw = scope_raw.get("collections", [])
            if not isinstance(collections_raw, list):
                raise ManifestError(f"scope {scope_raw.get('name')!r}: 'collections' is not a list")
            collections = []
            for c in collections_raw:
                if not isinstance(c, dict):
                    raise ManifestError(f"collection entry {c!r} is not an object")
                ttl = c.get("maxTTL")
                if ttl is not None and (
                    not isinstance(ttl, int) or isinstance(ttl, bool) or not 0 <= ttl < 2**31
                ):
                    raise ManifestError(f"collection {c.get('name')!r}: maxTTL {ttl!r} is invalid")
                collections.append(
                    CollectionSpec(_str(c, "name"), _hex(c.get("uid"), "collection uid"), ttl)
                )
            scopes.append(
                ScopeSpec(
                    _str(scope_raw, "name"),
                    _hex(scope_raw.get("uid"), "scope uid"),
                    tuple(collections),
                )
            )
        manifest = cls(_hex(raw.get("uid"), "manifest uid"), tuple(scopes))
        manifest.check()
        return manifest

    def check(self) -> None:
        """Raise `ManifestError` unless the manifest keeps kv_engine's rules (module docstring)."""
        default = self.scope(DEFAULT_NAME)
        if default is None or default.uid != DEFAULT_ID:
            raise ManifestError("the _default scope (uid 0) is missing")
        scope_names: set[str] = set()
        scope_ids: set[int] = set()
        collection_ids: set[int] = set()
        for s in self.scopes:
            check_name(s.name, "scope", allow_default=True)
            _check_id(s.uid, f"scope {s.name!r}", is_default=s.name == DEFAULT_NAME)
            if s.name in scope_names or s.uid in scope_ids:
                raise ManifestError(f"scope {s.name!r} (uid {s.uid:x}) is not unique")
            scope_names.add(s.name)
            scope_ids.add(s.uid)
            names: set[str] = set()
            for c in s.collections:
                check_name(c.name, "collection", allow_default=True)
                is_default = c.name == DEFAULT_NAME and s.name == DEFAULT_NAME
                _check_id(c.uid, f"collection {s.name}.{c.name}", is_default=is_default)
                if c.name in names or c.uid in collection_ids:
                    raise ManifestError(f"collection {s.name}.{c.name} is not unique")
                names.add(c.name)
                collection_ids.add(c.uid)

    def check_successor(self, new: Manifest) -> None:
        """Raise `ManifestError` unless `new` may follow this manifest: a greater uid, the
        default collection kept, and every id it introduces in (uid + 7, new.uid + 7]."""
        new.check()
        if new.uid <= self.uid:
            raise ManifestError(f"manifest uid {new.uid:x} is not above the current {self.uid:x}")
        if DEFAULT_ID in self.by_id() and DEFAULT_ID not in new.by_id():
            raise ManifestError("the _default collection cannot be dropped here")
        old_ids = set(self.by_id()) | set(self.scope_ids())
        low, high = self.uid + RESERVED_IDS_MAX, new.uid + RESERVED_IDS_MAX
        for ident in set(new.by_id()) | set(new.scope_ids()):
            if ident not in old_ids and not low < ident <= high:
                raise ManifestError(
                    f"new id {ident:x} is not in ({low:x}, {high:x}]: ids are never reused"
                )
        for ident, (scope, coll) in new.by_id().items():
            old = self.by_id().get(ident)
            if old is not None and (old[0].uid, old[1].name) != (scope.uid, coll.name):
                raise ManifestError(f"collection id {ident:x} changed scope or name")

    # -- edits (each returns the next manifest: uid + 1) --------------------------------------

    def with_scope(self, name: str) -> Manifest:
        check_name(name, "scope")
        if self.scope(name) is not None:
            raise ManifestError(f"scope {name!r} exists")
        uid = self.uid + 1
        return Manifest(uid, (*self.scopes, ScopeSpec(name, _new_id(uid))))

    def with_collection(self, scope: str, name: str, max_ttl: int | None = None) -> Manifest:
        check_name(name, "collection")
        found = self.scope(scope)
        if found is None:
            raise ManifestError(f"scope {scope!r} does not exist")
        if found.collection(name) is not None:
            raise ManifestError(f"collection {scope}.{name} exists")
        if max_ttl is not None and not 0 <= max_ttl < 2**31:
            raise ManifestError(f"maxTTL {max_ttl} is not 0..2**31-1 seconds")
        uid = self.uid + 1
        added = dataclasses.replace(
            found, collections=(*found.collections, CollectionSpec(name, _new_id(uid), max_ttl))
        )
        return Manifest(uid, tuple(added if s is found else s for s in self.scopes))

    def without_collection(self, scope: str, name: str) -> Manifest:
        found = self.scope(scope)
        if found is None:
            raise ManifestError(f"scope {scope!r} does not exist")
        if found.collection(name) is None:
            raise ManifestError(f"collection {scope}.{name} does not exist")
        if scope == DEFAULT_NAME and name == DEFAULT_NAME:
            raise ManifestError("the _default collection cannot be dropped here")
        kept = dataclasses.replace(
            found, collections=tuple(c for c in found.collections if c.name != name)
        )
        return Manifest(self.uid + 1, tuple(kept if s is found else s for s in self.scopes))

    def without_scope(self, name: str) -> Manifest:
        if name == DEFAULT_NAME:
            raise ManifestError("the _default scope cannot be dropped")
        if self.scope(name) is None:
            raise ManifestError(f"scope {name!r} does not exist")
        return Manifest(self.uid + 1, tuple(s for s in self.scopes if s.name != name))


def check_name(name: str, what: str, *, allow_default: bool = False) -> None:
    """Raise `ManifestError` unless `name` is a valid scope or collection name."""
    if allow_default and name == DEFAULT_NAME:
        return
    if not 0 < len(name.encode()) <= NAME_BYTES_MAX or not _NAME.fullmatch(name):
        raise ManifestError(
            f"{what} name {name!r} must be 1..{NAME_BYTES_MAX} of A-Z a-z 0-9 _ - %"
        )
    if name[0] in "_%":
        raise ManifestError(f"{what} name {name!r} must not start with _ or %")


def _new_id(uid: int) -> int:
    ident = uid + RESERVED_IDS_MAX
    if ident > ID_MAX:
        raise ManifestError(f"the manifest uid {uid:x} leaves no ids below {ID_MAX:x}")
    return ident


def _check_id(ident: int, what: str, *, is_default: bool) -> None:
    if is_default:
        if ident != DEFAULT_ID:
            raise ManifestError(f"{what} must have uid 0")
        return
    if not RESERVED_IDS_MAX < ident <= ID_MAX:
        raise ManifestError(f"{what}: uid {ident:x} is reserved or above {ID_MAX:x}")


def _collection_json(c: CollectionSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": c.name, "uid": f"{c.uid:x}"}
    if c.max_ttl is not None:
        out["maxTTL"] = c.max_ttl
    return out


def _str(raw: dict[str, Any], field: str) -> str:
    value = raw.get(field)
    if not isinstance(value, str):
        raise ManifestError(f"{field} {value!r} is not a string")
    return value


def _hex(value: object, what: str) -> int:
    if not isinstance(value, str) or not 0 < len(value) <= 16:
        raise ManifestError(f"{what} {value!r} is not a hex string")
    try:
        return int(value, 16)
    except ValueError:
        raise ManifestError(f"{what} {value!r} is not a hex string") from None
