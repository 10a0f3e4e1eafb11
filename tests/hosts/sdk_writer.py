"""The official Couchbase SDK writing to a cluster on the test hosts, recording every write.

Run on the client host (``HostCluster.client_command``)::

    ip netns exec PREFIX-client python tests/hosts/sdk_writer.py \\
        --connect couchbase://10.77.5.2,... --out writes.jsonl --stop stop-file

Until the file ``--stop`` exists (or SIGTERM), ``--workers`` threads each loop:

* with probability ``--fresh``: upsert a key never written before (``fresh-W-N``), written once,
  so its loss is always visible;
* else a CAS read-modify-write of one of ``--hot`` hot keys shared by every worker: get, then
  replace with the CAS read (or insert when the key is missing). Each value names the write
  that made it (``token``) and the one it replaced (``prev``), so the acknowledged updates of a
  key form a chain the checker walks back from the final value.

Every write is at durability MAJORITY (``--durability``). Each one becomes a JSON line, once
the SDK answered: ``{"op", "key", "token", "prev", "version", "outcome", "cas", "error",
"t0", "t1"}`` with ``outcome`` ``ok`` (acknowledged; ``cas`` is the CAS the SDK returned),
``failed`` (a status that says it was not applied) or ``ambiguous`` (anything else: a timeout,
SYNC_WRITE_AMBIGUOUS, a lost connection). A read that fails is not a write and is not recorded.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.collection import Collection
from couchbase.durability import Durability, ServerDurability
from couchbase.exceptions import (
    CasMismatchException,
    CouchbaseException,
    DocumentExistsException,
    DocumentNotFoundException,
    DurabilityImpossibleException,
    DurabilitySyncWriteInProgressException,
)
from couchbase.options import (
    ClusterOptions,
    ClusterTimeoutOptions,
    InsertOptions,
    ReplaceOptions,
    UpsertOptions,
)

# Answers that say the write was not applied (the SDK retries only answers that say so too).
DEFINITE = (
    CasMismatchException,
    DocumentExistsException,
    DocumentNotFoundException,
    DurabilityImpossibleException,
    DurabilitySyncWriteInProgressException,
)
LEVELS = {
    "majority": Durability.MAJORITY,
    "majorityAndPersistActive": Durability.MAJORITY_AND_PERSIST_TO_ACTIVE,
    "persistToMajority": Durability.PERSIST_TO_MAJORITY,
}
PADDING = "x" * 32


class Writer:
    def __init__(self, args: argparse.Namespace, collection: Collection) -> None:
        self.args = args
        self.collection = collection
        self.durability = ServerDurability(LEVELS[args.durability])
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.out = open(args.out, "a", buffering=1)  # noqa: SIM115  # closed in main
        self.started = time.monotonic()
        self.counts: dict[str, int] = {}

    def record(self, **fields: Any) -> None:
        line = json.dumps(fields)
        with self.lock:
            self.out.write(line + "\n")
            self.counts[fields["outcome"]] = self.counts.get(fields["outcome"], 0) + 1

    def now(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def should_stop(self) -> bool:
        return self.stopping.is_set() or Path(self.args.stop).exists()

    def worker(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        sequence = 0
        while not self.should_stop():
            sequence += 1
            token = f"w{index}-{sequence}"
            if rng.random() < self.args.fresh:
                self.fresh(f"fresh-{index}-{sequence}", token)
            else:
                self.read_modify_write(f"hot-{rng.randrange(self.args.hot)}", token)
            if self.args.pause_s:
                time.sleep(self.args.pause_s)

    def fresh(self, key: str, token: str) -> None:
        value = {"key": key, "version": 1, "token": token, "prev": None, "pad": PADDING}
        self.write("fresh", key, value, lambda: self.collection.upsert(
            key, value, UpsertOptions(durability=self.durability)))  # fmt: skip

    def read_modify_write(self, key: str, token: str) -> None:
        try:
            current = self.collection.get(key)
        except DocumentNotFoundException:
            value = {"key": key, "version": 1, "token": token, "prev": None, "pad": PADDING}
            self.write("insert", key, value, lambda: self.collection.insert(
                key, value, InsertOptions(durability=self.durability)))  # fmt: skip
            return
        except CouchbaseException:  # the read failed: nothing was written
            time.sleep(0.05)
            return
        old = current.content_as[dict]
        value = {
            "key": key, "version": old["version"] + 1, "token": token, "prev": old["token"],
            "pad": PADDING,
        }  # fmt: skip
        self.write("cas", key, value, lambda: self.collection.replace(
            key, value, ReplaceOptions(cas=current.cas, durability=self.durability)))  # fmt: skip

    def write(self, op: str, key: str, value: dict[str, Any], send: Any) -> None:
        t0 = self.now()
        outcome, cas, error = "ok", None, ""
        try:
            cas = send().cas
        except DEFINITE as failure:
            outcome, error = "failed", type(failure).__name__
        except CouchbaseException as failure:
            outcome, error = "ambiguous", type(failure).__name__
        self.record(
            op=op, key=key, token=value["token"], prev=value["prev"], version=value["version"],
            outcome=outcome, cas=cas, error=error, t0=t0, t1=self.now(),
        )  # fmt: skip
        if outcome != "ok":
            time.sleep(0.02)  # no tight loop against an unavailable vbucket


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connect", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stop", required=True, help="stop once this file exists")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--hot", type=int, default=8)
    parser.add_argument("--fresh", type=float, default=0.5)
    parser.add_argument("--durability", default="majority", choices=sorted(LEVELS))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--kv-timeout-s", type=float, default=2.5)
    parser.add_argument("--durable-timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    options = ClusterOptions(
        PasswordAuthenticator("Administrator", "password"),
        timeout_options=ClusterTimeoutOptions(
            connect_timeout=timedelta(seconds=10),
            kv_timeout=timedelta(seconds=args.kv_timeout_s),
            kv_durable_timeout=timedelta(seconds=args.durable_timeout_s),
        ),
    )
    cluster = Cluster.connect(args.connect, options)
    cluster.wait_until_ready(timedelta(seconds=20))
    writer = Writer(args, cluster.bucket("default").default_collection())
    signal.signal(signal.SIGTERM, lambda *_: writer.stopping.set())
    Path(args.out + ".ready").write_text("1")
    threads = [threading.Thread(target=writer.worker, args=(i,)) for i in range(args.workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    writer.out.close()
    print(json.dumps(writer.counts))
    cluster.close()


if __name__ == "__main__":
    main()
