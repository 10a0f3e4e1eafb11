"""The workload and the independent checker of the test-host tests.

``SdkWriter`` runs ``sdk_writer.py`` (the official SDK, durability MAJORITY, fresh upserts and
CAS read-modify-writes on hot keys) as a process on the client host and collects its records.
``check`` compares them with the final state read over DCP from every copy after healing:

* ``lost_fresh``: a fresh key acknowledged durable that is missing, or holds another value;
* ``lost_cas``: an acknowledged CAS update (or first insert) of a hot key that is not on the
  chain of updates leading to the key's final value (walked back through ``prev``): some
  later write replaced a value that did not contain it, so it was lost;
* ``phantom``: a final value, or a link of its chain, that no write could have left (a token
  never written, or written by a write that definitely failed);
* ``cas_mismatch``: a final value made by an acknowledged write, whose CAS is not the one the
  SDK returned for it (the CAS metadata of the copy is checked, not only the value);
* ``divergent``: a replica copy that differs from its active's (``same_copy``: every key's
  newest change with seqno, CAS, rev seqno, flags, expiry, datatype, deletedness).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from support.cluster import same_copy
from support.consumer import Change
from support.hosts import HostCluster, purge_seqnos

WRITER = Path(__file__).with_name("sdk_writer.py")
WRITER_READY_S = 60.0
WRITER_STOP_S = 60.0
EXAMPLES = 5


class SdkWriter:
    """``sdk_writer.py`` on the client host, from ``__enter__`` (once it has connected) to
    ``__exit__`` (asked to stop, then waited for; killed by pid if it hangs)."""

    def __init__(self, cluster: HostCluster, workdir: Path, *, seed: int, **options: Any) -> None:
        self.cluster = cluster
        self.out = workdir / f"writes-{seed}.jsonl"
        self.stop_file = workdir / f"writes-{seed}.stop"
        self.log_path = workdir / f"writer-{seed}.log"
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in options.items()]
        self.command = cluster.client_command(
            sys.executable, str(WRITER), "--connect", cluster.connection_string(),
            "--out", str(self.out), "--stop", str(self.stop_file), "--seed", str(seed), *flags,
        )  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None
        self.records: list[dict[str, Any]] = []

    def __enter__(self) -> SdkWriter:
        for path in (self.out, self.stop_file, Path(f"{self.out}.ready")):
            path.unlink(missing_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(WRITER.parent.parent)},
            )  # fmt: skip
        self.cluster.pids.append(self.process.pid)
        deadline = time.monotonic() + WRITER_READY_S
        while not Path(f"{self.out}.ready").exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SDK writer did not start:\n{self.log_tail()}")
            time.sleep(0.1)
        return self

    def stop(self) -> list[dict[str, Any]]:
        """Ask the writer to stop, wait for it (its in-flight writes end within the SDK's
        timeouts), and read its records."""
        self.stop_file.write_text("stop")
        process = self.process
        if process is not None and process.poll() is None:
            try:
                process.wait(WRITER_STOP_S)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)
                process.wait(10)
        if self.out.exists():
            lines = self.out.read_text().splitlines()
            self.records = [json.loads(line) for line in lines if line.strip()]
        return self.records

    def log_tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
        if exc is not None:
            exc.add_note(f"SDK writer log tail:\n{self.log_tail()}")


@dataclass
class Report:
    writes: int = 0
    acked: int = 0
    acked_cas: int = 0
    failed: int = 0
    ambiguous: int = 0
    keys_checked: int = 0
    copies_compared: int = 0
    lost_fresh: list[str] = field(default_factory=list)
    lost_cas: list[str] = field(default_factory=list)
    phantom: list[str] = field(default_factory=list)
    cas_mismatch: list[str] = field(default_factory=list)
    divergent: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (
            self.lost_fresh or self.lost_cas or self.phantom or self.cas_mismatch or self.divergent
        )

    def __str__(self) -> str:
        lines = [
            f"writes {self.writes}: acked {self.acked} (CAS updates {self.acked_cas}), "
            f"failed {self.failed}, ambiguous {self.ambiguous}; keys checked "
            f"{self.keys_checked}, copies compared {self.copies_compared}",
            f"lost acked durable writes: {len(self.lost_fresh)} fresh + {len(self.lost_cas)} "
            f"CAS updates; phantom {len(self.phantom)}; CAS mismatch {len(self.cas_mismatch)}; "
            f"divergent copies {len(self.divergent)}",
        ]
        for name in ("lost_fresh", "lost_cas", "phantom", "cas_mismatch", "divergent"):
            for example in getattr(self, name)[:EXAMPLES]:
                lines.append(f"  {name}: {example}")
        return "\n".join(lines)


def check(records: list[dict[str, Any]], final: dict[str, Change]) -> Report:
    """Check the writer's ``records`` against ``final`` (key -> newest change of the active
    copy; absent or deleted: the key does not exist)."""
    report = Report(writes=len(records))
    by_token = {r["token"]: r for r in records}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_key.setdefault(record["key"], []).append(record)
        report.acked += record["outcome"] == "ok"
        report.acked_cas += record["outcome"] == "ok" and record["op"] == "cas"
        report.failed += record["outcome"] == "failed"
        report.ambiguous += record["outcome"] == "ambiguous"
    for key, writes in sorted(by_key.items()):
        report.keys_checked += 1
        change = final.get(key)
        token = None
        if change is not None and not change.deleted:
            token = json.loads(change.value)["token"]
        chain = _chain(key, token, by_token, report)
        for write in writes:
            if write["outcome"] != "ok" or write["token"] in chain:
                continue
            where = "missing" if token is None else f"final {token}"
            lost = report.lost_fresh if write["op"] == "fresh" else report.lost_cas
            lost.append(f"{key}: {write['op']} {write['token']} v{write['version']} acked at "
                        f"{write['t1']}s is gone ({where})")  # fmt: skip
        winner = by_token.get(token) if token is not None else None
        acked = winner is not None and winner["outcome"] == "ok"
        if change is not None and acked and winner is not None and winner["cas"] != change.cas:
            report.cas_mismatch.append(
                f"{key}: {token} acked with CAS {winner['cas']}, the copy has {change.cas}"
            )
    return report


def _chain(
    key: str, token: str | None, by_token: dict[str, dict[str, Any]], report: Report
) -> set[str]:
    """Tokens of the writes the final value of ``key`` is built on (itself included)."""
    chain: set[str] = set()
    while token is not None and token not in chain:  # bounded: tokens are finite
        chain.add(token)
        write = by_token.get(token)
        if write is None or write["key"] != key:
            report.phantom.append(f"{key}: {token} was never written to it")
            break
        if write["outcome"] == "failed":
            report.phantom.append(f"{key}: {token} failed ({write['error']}) yet is in the store")
        token = write["prev"]
    return chain


async def final_state(cluster: HostCluster, report: Report | None = None) -> dict[str, Change]:
    """Wait for convergence, then read every copy of every vbucket: the actives' changes
    (key -> newest change), and, in ``report``, every replica copy that differs."""
    cmap = await cluster.wait_converged()
    copies = await cluster.copies(cmap)
    purged = {n.host: await purge_seqnos(n) for n in cluster.nodes if n.alive}
    final: dict[str, Change] = {}
    for vb, holders in copies.items():
        (active, truth), *replicas = holders
        final.update({k.decode(): c for k, c in truth.items()})
        for host, copy in replicas:
            if report is not None:
                report.copies_compared += 1
                differ = same_copy(truth, purged[active].get(vb, 0), copy, purged[host].get(vb, 0))
                if differ:
                    report.divergent.append(f"vb {vb}: {host} vs active {active}: {differ[:2]}")
    return final


def run_scenario(
    cluster: HostCluster,
    workdir: Path,
    fault: Callable[[HostCluster], None],
    *,
    seed: int,
    warmup_s: float = 2.0,
    settle_s: float = 2.0,
    **writer_options: Any,
) -> Report:
    """The SDK writes for ``warmup_s``, ``fault`` runs (injects, waits, heals; the writer
    keeps writing throughout), the writer writes ``settle_s`` more and stops; everything is
    healed, the cluster converges, and ``check`` judges every write against every copy."""
    with SdkWriter(cluster, workdir, seed=seed, **writer_options) as writer:
        time.sleep(warmup_s)
        fault(cluster)
        time.sleep(settle_s)
    cluster.network.heal()
    report = Report()
    final = cluster.run(final_state(cluster, report))
    checked = check(writer.records, final)
    checked.copies_compared, checked.divergent = report.copies_compared, report.divergent
    print(f"\n{checked}")
    return checked
