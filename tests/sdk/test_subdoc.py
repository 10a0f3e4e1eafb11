"""Sub-document lookup_in and mutate_in through the official SDK: every common operation,
the virtual ``$document`` attribute, the document-level semantics (upsert, insert, CAS,
expiry, locks, durability) and each path error as the SDK's exception class."""

from __future__ import annotations

from datetime import timedelta

import couchbase.subdocument as SD
import pytest
from couchbase.collection import Collection
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.exceptions import (
    CasMismatchException,
    DocumentExistsException,
    DocumentLockedException,
    DocumentNotFoundException,
    PathExistsException,
    PathInvalidException,
    PathMismatchException,
    PathNotFoundException,
)
from couchbase.options import GetOptions, MutateInOptions, UpsertOptions
from couchbase.subdocument import StoreSemantics
from couchbase.transcoder import RawJSONTranscoder

from .conftest import SHORT_TIMEOUT

DOC = {"name": "ada", "tags": ["a", "b"], "address": {"city": "london"}, "visits": 3}


def test_lookup_in_gets_counts_and_checks_paths(collection: Collection, key: str) -> None:
    written = collection.upsert(key, DOC)
    result = collection.lookup_in(
        key,
        [
            SD.get("address.city"),
            SD.exists("tags[1]"),
            SD.exists("address.street"),
            SD.count("tags"),
            SD.get("tags[-1]"),
            SD.get_full(),
        ],
    )
    assert result.cas == written.cas
    assert result.content_as[str](0) == "london"
    assert result.exists(1) and not result.exists(2)
    assert result.content_as[int](3) == 2
    assert result.content_as[str](4) == "b"
    assert result.content_as[dict](5) == DOC
    with pytest.raises(PathNotFoundException):
        collection.lookup_in(key, [SD.get("address.street")]).content_as[str](0)
    with pytest.raises(PathMismatchException):
        collection.lookup_in(key, [SD.get("tags.first")]).content_as[str](0)
    with pytest.raises(DocumentNotFoundException):
        collection.lookup_in(f"{key}-missing", [SD.get("name")])


def test_the_document_virtual_attribute(collection: Collection, key: str) -> None:
    written = collection.upsert(key, DOC, UpsertOptions(expiry=timedelta(seconds=600)))
    token = written.mutation_token()
    assert token is not None
    result = collection.lookup_in(
        key, [SD.get("$document", xattr=True), SD.get("$document.exptime", xattr=True)]
    )
    document = result.content_as[dict](0)
    assert document["CAS"] == f"0x{written.cas:016x}"
    assert document["seqno"] == f"0x{token.sequence_number:016x}"
    assert document["vbucket_uuid"] == f"0x{token.partition_uuid:016x}"
    assert document["deleted"] is False and document["datatype"] == ["json"]
    raw = collection.get(key, GetOptions(transcoder=RawJSONTranscoder())).content_as[bytes]
    assert document["value_bytes"] == len(raw) and document["revid"] == "1"
    assert result.content_as[int](1) == document["exptime"] > 0
    expiry = collection.get(key, GetOptions(with_expiry=True)).expiry_time
    assert expiry is not None and int(expiry.timestamp()) == document["exptime"]


def test_mutate_in_applies_every_common_operation(collection: Collection, key: str) -> None:
    collection.upsert(key, DOC)
    result = collection.mutate_in(
        key,
        [
            SD.insert("email", "ada@example.com"),
            SD.upsert("address.city", "paris"),
            SD.upsert("prefs.theme.colour", "dark", create_parents=True),
            SD.replace("name", "ada lovelace"),
            SD.remove("visits"),
            SD.array_append("tags", "z"),
            SD.array_prepend("tags", "0"),
            SD.array_insert("tags[2]", "mid"),
            SD.array_addunique("tags", "unique"),
            SD.increment("logins", 5),
            SD.decrement("logins", 2),
        ],
    )
    assert result.content_as[int](9) == 5
    assert result.content_as[int](10) == 3
    assert collection.get(key).content_as[dict] == {
        "name": "ada lovelace",
        "tags": ["0", "a", "mid", "b", "z", "unique"],
        "address": {"city": "paris"},
        "email": "ada@example.com",
        "prefs": {"theme": {"colour": "dark"}},
        "logins": 3,
    }


def test_a_failing_path_fails_the_whole_mutation_and_changes_nothing(
    collection: Collection, key: str
) -> None:
    written = collection.upsert(key, DOC)
    cases = [
        (SD.insert("name", "x"), PathExistsException),
        (SD.replace("nickname", "x"), PathNotFoundException),
        (SD.remove("address.street"), PathNotFoundException),
        (SD.array_append("address", 1), PathMismatchException),
        (SD.array_addunique("tags", "a"), PathExistsException),
        (SD.increment("name", 1), PathMismatchException),
        (SD.upsert("a..b", 1), PathInvalidException),
        (SD.upsert("deep.er", 1), PathNotFoundException),  # no create_parents
    ]
    for spec, error in cases:
        with pytest.raises(error):
            collection.mutate_in(key, [SD.upsert("touched", True), spec])
    current = collection.get(key)
    assert current.cas == written.cas and current.content_as[dict] == DOC


def test_store_semantics_cas_and_expiry(collection: Collection, key: str) -> None:
    with pytest.raises(DocumentNotFoundException):  # replace semantics: the document must exist
        collection.mutate_in(key, [SD.upsert("a", 1)])
    upsert = MutateInOptions(store_semantics=StoreSemantics.UPSERT)
    collection.mutate_in(key, [SD.upsert("a.b", 1)], upsert)  # parents created
    assert collection.get(key).content_as[dict] == {"a": {"b": 1}}
    insert = MutateInOptions(store_semantics=StoreSemantics.INSERT)
    with pytest.raises(DocumentExistsException):
        collection.mutate_in(key, [SD.upsert("c", 1)], insert)
    created = collection.mutate_in(f"{key}-new", [SD.array_append("", 1)], insert)
    assert collection.get(f"{key}-new").content_as[list] == [1]
    with pytest.raises(CasMismatchException):
        collection.mutate_in(f"{key}-new", [SD.array_append("", 2)], MutateInOptions(cas=1))
    collection.mutate_in(f"{key}-new", [SD.array_append("", 2)], MutateInOptions(cas=created.cas))
    # Expiry: set with the mutation, dropped by one without it unless preserved.
    collection.mutate_in(key, [SD.upsert("e", 1)], MutateInOptions(expiry=timedelta(seconds=300)))
    expiry = collection.get(key, GetOptions(with_expiry=True)).expiry_time
    assert expiry is not None
    collection.mutate_in(key, [SD.upsert("e", 2)], MutateInOptions(preserve_expiry=True))
    assert collection.get(key, GetOptions(with_expiry=True)).expiry_time == expiry
    collection.mutate_in(key, [SD.upsert("e", 3)])
    assert collection.get(key, GetOptions(with_expiry=True)).expiry_time is None


def test_a_locked_document_takes_mutate_in_with_the_lock_cas_only(
    collection: Collection, key: str
) -> None:
    collection.upsert(key, DOC)
    locked = collection.get_and_lock(key, timedelta(seconds=10))
    with pytest.raises(DocumentLockedException):
        collection.mutate_in(key, [SD.upsert("x", 1)], MutateInOptions(timeout=SHORT_TIMEOUT))
    collection.mutate_in(key, [SD.upsert("x", 1)], MutateInOptions(cas=locked.cas))
    assert collection.get(key).content_as[dict]["x"] == 1


def test_a_durable_mutate_in_on_one_node_is_honoured(collection: Collection, key: str) -> None:
    written = collection.upsert(key, DOC)
    durable = MutateInOptions(durability=ServerDurability(DurabilityLevel.MAJORITY))
    result = collection.mutate_in(key, [SD.upsert("x", 1)], durable)
    current = collection.get(key)
    assert current.cas == result.cas != written.cas
    assert current.content_as[dict]["x"] == 1
