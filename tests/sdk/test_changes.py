"""Every change the SDK makes is a normal change of the node: it gets the next seqno of its
vbucket, streams over DCP with the CAS, value, flags and expiry the SDK was told, and reads
(get, exists, lookup_in, locks) change nothing."""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta

import couchbase.subdocument as SD
from couchbase.collection import Collection
from couchbase.options import IncrementOptions, SignedInt64, UpsertOptions
from couchbase.result import MutationResult
from couchbase.transcoder import RawBinaryTranscoder

from changefeed.cli.node_process import NodeProcess
from support.clients import high_seqnos
from support.consumer import Change, server_state


def streamed(node: NodeProcess) -> dict[bytes, Change]:
    return asyncio.run(server_state(node)).latest()


def check(change: Change, result: MutationResult) -> None:
    """The streamed change is the one the SDK's result names (vbucket, seqno, CAS)."""
    token = result.mutation_token()
    assert token is not None
    assert (change.vbucket, change.seqno) == (token.partition_id, token.sequence_number)
    assert change.cas == result.cas


def test_the_sdks_changes_stream_with_the_seqnos_it_was_given(
    node: NodeProcess, collection: Collection
) -> None:
    results: dict[str, MutationResult] = {}
    results["doc"] = collection.upsert("doc", {"v": 1})
    results["doc"] = collection.replace("doc", {"v": 2})
    results["doc"] = collection.mutate_in("doc", [SD.upsert("sub", [1]), SD.increment("n", 2)])
    results["gone"] = collection.insert("gone", "soon")
    results["gone"] = collection.remove("gone")
    results["counter"] = collection.binary().increment(
        "counter", IncrementOptions(initial=SignedInt64(41))
    )
    results["counter"] = collection.binary().increment("counter")
    binary = UpsertOptions(transcoder=RawBinaryTranscoder())
    results["log"] = collection.upsert("log", b"a", binary)
    results["log"] = collection.binary().append("log", b"b")
    touched = collection.upsert("touched", {"t": 1})
    touch = collection.touch("touched", timedelta(seconds=900))

    # Reads and locks are not changes.
    before = asyncio.run(high_seqnos(node))
    collection.get("doc")
    collection.exists("doc")
    collection.lookup_in("doc", [SD.get("sub"), SD.get("$document.CAS", xattr=True)])
    locked = collection.get_and_lock("doc", timedelta(seconds=5))
    collection.unlock("doc", locked.cas)
    assert asyncio.run(high_seqnos(node)) == before

    latest = streamed(node)
    for key, result in results.items():
        check(latest[key.encode()], result)
    assert json.loads(latest[b"doc"].value) == {"v": 2, "sub": [1], "n": 2}
    assert latest[b"gone"].deleted
    assert latest[b"counter"].value == b"42"
    assert latest[b"log"].value == b"ab"
    change = latest[b"touched"]
    assert change.cas == touch.cas != touched.cas
    token = touched.mutation_token()
    assert token is not None and change.seqno == token.sequence_number + 1
    assert change.expiry > 0 and json.loads(change.value) == {"t": 1}
