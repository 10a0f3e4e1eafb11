"""``consumer.current_state.read_current_state`` against a real node: what the mirror re-reads
after a rollback and what ``changefeed demo`` takes as the store.

It returns each key's newest version with every column the truth stream has (seqno, CAS, flags,
expiry, rev_seqno, datatype, deleted) from disk and memory alike, tombstones included; with
``keys`` only those keys, and keys the vbuckets do not hold are absent. (Here, beside its user
spark/mirror.py, because the tests of the Spark side own a node fixture and a metadata writer.)
"""

from __future__ import annotations

import asyncio

import pytest

from changefeed.cli.node_process import NodeProcess
from changefeed.consumer import ClientConfig
from changefeed.consumer.current_state import Document, read_current_state
from support.consumer import Change, server_state
from support.nodes import NodeFactory

from .helpers import write, write_meta

VBUCKETS = 4


def read(node: NodeProcess, keys: list[bytes] | None = None) -> dict[bytes, Document]:
    config = ClientConfig(port=node.port)
    return asyncio.run(read_current_state(config, range(VBUCKETS), keys))


def truth(node: NodeProcess) -> dict[bytes, Document]:
    """The independent truth reader (``support.consumer``), as Documents."""
    state = asyncio.run(server_state(node))
    return {key: document_of(change) for key, change in state.latest().items()}


def document_of(c: Change) -> Document:
    return Document(
        c.vbucket, c.key, c.seqno, c.deleted, c.value, c.cas, c.flags, c.expiry, c.rev_seqno,
        c.datatype,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_newest_versions_with_metadata_from_disk_and_memory(nodes: NodeFactory) -> None:
    node = nodes(vbuckets=VBUCKETS, args=["--no-durable"])
    write_meta(node.port, [(f"k-{i:04d}", b"v0", i | 2**31, 3600 * (i % 3)) for i in range(500)])
    write(node.port, [(f"k-{i:04d}", None) for i in range(0, 500, 9)])  # tombstones
    node.stop()
    node.start()  # everything so far comes from disk
    write_meta(node.port, [(f"k-{i:04d}", b"v1", 7, 60) for i in range(0, 500, 4)])  # memory
    write_meta(node.port, [(f"k-{i:04d}", b"v2", 8, 0) for i in range(0, 500, 8)])  # again

    everything = read(node)
    want = truth(node)
    assert everything == want
    assert sum(doc.deleted for doc in everything.values()) > 0, "tombstones are returned"
    assert {doc.rev_seqno for doc in everything.values()} >= {1, 2, 3}

    asked = [b"k-0000", b"k-0009", b"k-0013", b"k-0499", b"absent"]
    some = read(node, asked)
    assert some == {k: want[k] for k in asked if k in want}
    assert b"absent" not in some
    assert some[b"k-0009"].deleted
    assert (some[b"k-0000"].value, some[b"k-0000"].flags, some[b"k-0000"].expiry) == (b"v2", 8, 0)
