"""``changefeed load``, ``changefeed stream`` and ``changefeed stats``: client-side commands.

``load`` is a workload generator (count, value size, update/delete ratios, optional rate) with a
progress bar; ``stream`` appends changes to a file as JSON lines, saving and resuming session
state; ``stats`` prints a node's STAT groups. Each has ``--json`` for scripts.

Failures print one line naming the node (``host:port``) and what went wrong, never a traceback:
exit 1 for a runtime failure (unreachable, authentication, an error status, a lost connection),
2 for a usage error (a malformed ``--vbuckets``, vbuckets the node does not have, an output
file that would get a second copy of changes).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO, TypeVar

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from changefeed import limits
from changefeed.cli.ordered_writes import OrderedWrites
from changefeed.cli.serve import run_loop
from changefeed.consumer import (
    Changes,
    ClientConfig,
    DcpClient,
    KvClient,
    Rollback,
    SessionState,
    StreamEnded,
    StreamRefused,
)
from changefeed.consumer.connection import ConnectionClosedError
from changefeed.consumer.events import CollectionEvent
from changefeed.consumer.handshake import connect
from changefeed.consumer.kv_client import Durability
from changefeed.protocol.batch import ChangeColumns
from changefeed.protocol.collections import SystemEvent, split_key
from changefeed.protocol.errors import AuthError, StatusError
from changefeed.protocol.kv import MutationResult, encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status

T = TypeVar("T")
OPS: dict[int, str] = {
    Opcode.DCP_MUTATION: "mutation",
    Opcode.DCP_DELETION: "deletion",
    Opcode.DCP_EXPIRATION: "expiration",
}
TAIL_SCAN_BYTES = 64 * 1024  # read back from the end of an output to find its last newline
# ``stream`` commits (fsync the output, save the state) after this many lines or this long,
# whichever comes first, and when the stream pauses: a crash repeats at most that many lines
# plus one read's worth. A commit costs ~5 ms of fsyncs; one per read (~700 changes) cost
# half the streaming rate, while at ~100k changes/s these make ~10 commits a second.
COMMIT_LINES_MAX = 10_000
COMMIT_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class Target:
    """The node a command talks to, as error messages name it."""

    host: str
    port: int
    user: str

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def connection_options(f: Any) -> Any:
    for option in reversed(
        [
            click.option("--host", default="127.0.0.1", show_default=True),
            click.option("--port", default=11210, show_default=True),
            click.option("--bucket", default="default", show_default=True),
            click.option(
                "--user", default="Administrator", show_default=True, envvar="CHANGEFEED_USER"
            ),
            click.option(
                "--password",
                default="password",
                envvar="CHANGEFEED_PASSWORD",
                show_default=False,
                help="Or CHANGEFEED_PASSWORD.",
            ),
        ]
    ):
        f = option(f)
    return f


@click.command()
@connection_options
@click.option("--count", default=100_000, show_default=True, help="Operations to send.")
@click.option("--value-size", default=100, show_default=True, help="Bytes per value.")
@click.option("--keys", default=0, help="Key space size (default: count).")
@click.option("--update-ratio", default=0.2, show_default=True, help="Share that rewrite a key.")
@click.option("--delete-ratio", default=0.05, show_default=True, help="Share that delete a key.")
@click.option("--rate", default=0.0, help="Operations per second (0 = as fast as possible).")
@click.option("--durability", type=click.Choice(["none", "persist"]), default="none")
@click.option("--seed", default=1, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def load(
    host: str,
    port: int,
    bucket: str,
    user: str,
    password: str,
    count: int,
    value_size: int,
    keys: int,
    update_ratio: float,
    delete_ratio: float,
    rate: float,
    durability: str,
    seed: int,
    as_json: bool,
) -> None:
    """Generate a workload of inserts, updates and deletes against a node."""
    if not 0 <= update_ratio + delete_ratio <= 1:
        raise click.BadParameter("update-ratio + delete-ratio must be within 0..1")

    tally = _LoadTally()

    async def main() -> dict[str, Any]:
        with _ctrl_c_stops() as stop:
            kv = await KvClient.connect(host, port, bucket=bucket, user=user, password=password)
            try:
                return await _load(
                    kv,
                    count,
                    value_size,
                    keys or count,
                    update_ratio,
                    delete_ratio,
                    rate,
                    durability,
                    seed,
                    as_json,
                    tally,
                    stop,
                )
            finally:
                await kv.close()

    try:
        summary = run_against(main(), Target(host, port, user))
    except (KeyboardInterrupt, _Interrupted):
        _report_interrupted(tally, count, as_json)
        raise SystemExit(130) from None  # 128 + SIGINT, as shells report it
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(
            f"{summary['ops']:,} ops ({summary['sets']:,} sets, {summary['deletes']:,} deletes) "
            f"in {summary['seconds']:.2f} s: {summary['ops_per_s']:,.0f} ops/s"
        )


class _Acknowledged:
    """The `KvClient` calls `OrderedWrites` makes, passed through, remembering the write
    answered last: what an interrupted `load` can say it wrote."""

    def __init__(self, kv: KvClient) -> None:
        self.kv = kv
        self.last: tuple[bytes, MutationResult] | None = None

    async def upsert_many(
        self, items: list[tuple[bytes, bytes]], *, durability: Durability = "none"
    ) -> list[MutationResult]:
        results = await self.kv.upsert_many(items, durability=durability)
        if results:
            self.last = (items[-1][0], results[-1])
        return results

    async def upsert(self, key: bytes, value: bytes, **options: Any) -> MutationResult:
        result = await self.kv.upsert(key, value, **options)
        self.last = (key, result)
        return result

    async def remove(self, key: bytes, **options: Any) -> MutationResult:
        result = await self.kv.remove(key, **options)
        self.last = (key, result)
        return result

    async def wait_all_persisted(self, done: list[MutationResult]) -> None:
        await self.kv.wait_all_persisted(done)


@dataclass(slots=True)
class _LoadTally:
    """How far `load` got, kept outside its coroutine so that an interrupt can report it."""

    generated: int = 0  # operations made and handed to the writer
    writes: OrderedWrites | None = None
    client: _Acknowledged | None = None


def _report_interrupted(tally: _LoadTally, count: int, as_json: bool) -> None:
    """Say what an interrupted `load` wrote: the writes the node acknowledged (whole segments:
    a segment cut short counts as unacknowledged, though some of it may have been applied),
    and the last acknowledged key with its vbucket and seqno."""
    writes, last = tally.writes, tally.client.last if tally.client else None
    sets = writes.sets if writes else 0
    deletes = (writes.deletes + writes.missing) if writes else 0
    report: dict[str, Any] = {
        "interrupted": True,
        "ops": sets + deletes,
        "sets": sets,
        "deletes": deletes,
        "generated": tally.generated,
        "requested": count,
        "last": None,
    }
    if last is not None:
        key, result = last
        report["last"] = {"key": _text(key), "vbucket": result.vbucket, "seqno": result.seqno}
    if as_json:
        click.echo(json.dumps(report))
        return
    line = (
        f"interrupted: {report['ops']:,} of {count:,} ops acknowledged ({sets:,} sets, "
        f"{deletes:,} deletes)"
    )
    unanswered = tally.generated - report["ops"]
    if unanswered > 0:
        line += f"; {unanswered:,} more were sent or queued without an answer (some may be written)"
    if last is not None:
        key, result = last
        line += f"; last acknowledged: {_text(key)} (vb {result.vbucket}, seqno {result.seqno})"
    click.echo(line, err=True)


async def _load(
    kv: KvClient,
    count: int,
    value_size: int,
    keyspace: int,
    update_ratio: float,
    delete_ratio: float,
    rate: float,
    durability: str,
    seed: int,
    quiet: bool,
    tally: _LoadTally | None = None,
    stop: asyncio.Event | None = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    written: list[bytes] = []  # keys set and not deleted, for updates and deletes to pick
    tally = _LoadTally() if tally is None else tally
    tally.client = recorder = _Acknowledged(kv)
    # `recorder` stands in for the KvClient (the calls OrderedWrites makes); durability is
    # one of load's --durability choices
    writes = OrderedWrites(recorder, durability=durability, missing_ok=True)  # type: ignore[arg-type]
    tally.writes = writes
    # Unpaced, whole segments go at once; paced, a window per 50 ms is flushed on time.
    window = writes.segment_max if rate == 0 else max(1, int(rate / 20))
    started = time.perf_counter()
    progress = Progress(
        TextColumn("load"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet,
    )
    try:
        with progress:
            task = progress.add_task("load", total=count)
            done = 0
            while done < count:
                if stop is not None and stop.is_set():
                    raise _Interrupted  # what was answered stays counted; the rest is cut
                for _ in range(min(window, count - done)):  # bounded by the window
                    tally.generated += 1
                    roll = rng.random()
                    if written and roll < delete_ratio:
                        at = rng.randrange(len(written))  # swap-remove: O(1), order is not kept
                        written[at], written[-1] = written[-1], written[at]
                        await writes.delete(written.pop())
                        continue
                    if written and roll < delete_ratio + update_ratio:
                        key = rng.choice(written)
                    else:
                        key = b"key::%010d" % rng.randrange(keyspace)
                        written.append(key)
                    await writes.set(key, _value(rng, value_size))
                done += min(window, count - done)
                await writes.flush()  # the window goes while the next one is made
                progress.update(task, completed=done)
                if rate:
                    await _pause(max(0.0, done / rate - (time.perf_counter() - started)), stop)
            await writes.drain()
    finally:
        await writes.aclose()  # a segment still sent when something failed
    seconds = time.perf_counter() - started
    deletes = writes.deletes + writes.missing  # a delete of a key deleted already still went
    ops = writes.sets + deletes
    return {
        "ops": ops,
        "sets": writes.sets,
        "deletes": deletes,
        "seconds": seconds,
        "ops_per_s": ops / seconds if seconds else 0.0,
    }


class _Interrupted(Exception):
    """Ctrl-C stopped `load` between two windows."""


@contextlib.contextmanager
def _ctrl_c_stops() -> Iterator[asyncio.Event]:
    """While inside: Ctrl-C sets the returned event (the load stops at its next window) and
    cancels the running task (a wait for the node ends at once), instead of relying on the
    runner's cancel alone: a cancel swallowed on the way down (a load once kept writing for
    60 s after Ctrl-C in a loaded test run) still ends the load at the next window."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    stop = asyncio.Event()

    def interrupt() -> None:
        if not stop.is_set():
            stop.set()
            if task is not None:
                task.cancel()

    try:
        loop.add_signal_handler(signal.SIGINT, interrupt)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread: as before
        yield stop
        return
    try:
        yield stop
    except asyncio.CancelledError:
        if stop.is_set():
            raise _Interrupted from None
        raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)


async def _pause(seconds: float, stop: asyncio.Event | None) -> None:
    """Sleep ``seconds`` (the rate's pacing), ending early when ``stop`` is set."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await stop.wait()


def _value(rng: random.Random, size: int) -> bytes:
    body = b'{"n":%d,"s":"' % rng.getrandbits(31)
    pad = max(0, size - len(body) - 2)
    return body + b"x" * pad + b'"}'


def _parse_vbuckets(ctx: click.Context, param: click.Parameter, spec: str) -> list[int] | None:
    """``all`` (None: every vbucket the node has) or a list such as ``0-15,32``, sorted."""
    if spec == "all":
        return None
    wanted: set[int] = set()
    for part in spec.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise click.BadParameter(
                f"{spec!r} is not 'all' or a list of vbuckets and ranges such as 0-15,32"
            )
        first, last = int(low), int(high) if dash else int(low)
        if first > last:
            raise click.BadParameter(f"{spec!r}: the range {part} runs backwards")
        if last >= limits.VBUCKETS_MAX:
            raise click.BadParameter(
                f"{spec!r}: vbucket {last} is past the most a node has ({limits.VBUCKETS_MAX})"
            )
        wanted.update(range(first, last + 1))
    return sorted(wanted)


@click.command()
@connection_options
@click.option(
    "--vbuckets",
    "vbucket_list",
    default="all",
    show_default=True,
    callback=_parse_vbuckets,
    help="e.g. 0-15,32 or all.",
)
@click.option("--from", "start", type=click.Choice(["beginning", "now"]), default="beginning")
@click.option(
    "--state",
    "state_file",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Resume from this state file if it exists; saved after every batch written.",
)
@click.option(
    "--follow/--to-latest",
    default=False,
    show_default=True,
    help="Keep streaming, or stop at the high seqnos of the start.",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
    default="-",
    help="Append JSON lines to this file; '-' is stdout. With --state, a rerun first cuts "
    "what the last run wrote after its last saved state (it streams those lines again).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (on stderr).")
@click.option(
    "--local",
    is_flag=True,
    help="Read the node's shared-memory services (a node on this host started with --shm) "
    "instead of one TCP stream; falls back to DCP when the reader falls behind.",
)
@click.option("--shm-dir", type=click.Path(path_type=Path), help="Where shm services live.")
@click.option("--app-id", type=int, help="--local: the reader's application id (default uid).")
@click.option(
    "--collections",
    "collection_list",
    default="",
    help="Stream only these collections: scope.collection,... (each line then names its "
    "collection id; creations and drops are lines too). Without it or --scope: the default "
    "collection, as before collections.",
)
@click.option("--scope", default=None, help="Stream only this scope's collections.")
def stream(
    host: str,
    port: int,
    bucket: str,
    user: str,
    password: str,
    vbucket_list: list[int] | None,
    start: str,
    state_file: Path | None,
    follow: bool,
    output: Path,
    as_json: bool,
    local: bool,
    shm_dir: Path | None,
    app_id: int | None,
    collection_list: str,
    scope: str | None,
) -> None:
    """Stream changes as JSON lines (one object per change or rollback).

    The output is appended to. With --state, the state is saved atomically after each batch is
    written and synced, together with the output's length then, so after a crash (even kill -9)
    the output is ahead of the state by at most one batch. A rerun with the same --state and
    --output first cuts the output back to that length and streams the batch again: each
    change is written once, however many runs are killed.
    """
    saved = _load_state(state_file)
    resume, mark = saved if saved is not None else (None, None)
    to_stdout = str(output) == "-"
    if not to_stdout:
        _check_output(output, resume, mark)
    target = Target(host, port, user)
    collections = tuple(part.strip() for part in collection_list.split(",") if part.strip())
    if collections and scope is not None:
        raise click.BadParameter("give --collections or --scope, not both", param_hint="--scope")
    if (collections or scope is not None) and local:
        raise click.BadParameter("collections are streamed over DCP, not --local")
    config = ClientConfig(
        host=host, port=port, bucket=bucket, user=user, password=password, to_latest=not follow,
        collections=collections, scope=scope,
    )  # fmt: skip
    show_progress = not (to_stdout or as_json) and Console(stderr=True).is_terminal

    covered: dict[int, tuple[int, int]] = {}  # vb -> (seqno at the start, seqno at the end)

    async def main(sink: _Sink) -> int:
        vbs = _check_vbuckets(vbucket_list, await _node_vbuckets(config), target)
        async with DcpClient(config) as client:
            sink.collections = config.negotiates_collections
            try:
                await client.stream(vbs, start=resume if resume is not None else start)  # type: ignore[arg-type]
            except ValueError as error:  # a state recorded with another collection filter
                raise click.ClickException(f"state file {state_file}: {error}") from None
            if start == "beginning" or resume is not None:  # from now: no start seqno known
                begun = {vb: client.session.get(vb).seqno for vb in vbs}
            try:
                with _stream_progress(show_progress) as progress:
                    return await _copy_events(client, len(vbs), sink, follow, progress)
            except asyncio.CancelledError:
                if sink.error is None:
                    raise
                raise sink.error from None  # a commit in a pause failed: it names the file
            finally:
                sink.commit(client.session)
                if start == "beginning" or resume is not None:
                    covered.update((vb, (begun[vb], client.session.get(vb).seqno)) for vb in vbs)

    with _open_output(output) as handle:
        sink = _Sink(
            handle,
            "stdout" if to_stdout else str(output),
            state_file,
            path=None if to_stdout else output,
            carried=resume,
        )
        if state_file is not None and resume is None and start == "beginning":
            # A state before the first line, so a run killed before its first commit leaves
            # one (see _check_output). Not for --from now: an empty state means the beginning.
            sink.commit(SessionState())
        if local:
            origin = resume if resume is not None else start
            streams = run_against(
                _stream_local(config, vbucket_list, origin, follow, sink, shm_dir, app_id, target),
                target,
            )
        else:
            streams = run_against(main(sink), target)
    seqnos, deduplicated = _deduplicated(covered, sink)
    summary = {
        "changes": sink.changes,
        "seqnos": seqnos,
        "deduplicated": deduplicated,
        "rollbacks": sink.rollbacks,
        "vbuckets": streams,
        "resumed": resume is not None,
        "state": None if state_file is None else str(state_file),
        "output": str(output),
    }
    if as_json:
        click.echo(json.dumps(summary), err=True)
    elif deduplicated:
        click.echo(
            f"{sink.changes} changes for {seqnos} seqnos (writes): the other {deduplicated} "
            "were older versions of keys written again, which DCP sends once, at their latest "
            "(deduplicated in memory and on disk)",
            err=True,
        )
    else:
        click.echo(f"{sink.changes} changes", err=True)


def _deduplicated(
    covered: dict[int, tuple[int, int]], sink: _Sink
) -> tuple[int | None, int | None]:
    """(seqnos the stream advanced over, how many of them it was not sent), or (None, None)
    when it cannot tell (from now, a rollback, --local). Every write gets a seqno, and DCP
    sends one version of a key per snapshot and storage keeps one per key, so the seqnos not
    sent are writes replaced by a later write of the same key (or purged tombstones and
    durable-write prepares, which are numbered too)."""
    if not covered or sink.rollbacks:
        return None, None
    seqnos = sum(end - begun for begun, end in covered.values())
    assert seqnos >= 0, covered
    return seqnos, max(0, seqnos - sink.changes)


@dataclass(frozen=True, slots=True)
class OutputMark:
    """The output file as the commit that saved a state left it: which file, and how long.

    Saved with the state because the sessions alone cannot say where the lines they cover end.
    A run killed after a commit leaves lines past it; a rerun resumes from the state and writes
    those changes again. Left in place they would sit in the middle of the output, covered by
    no state until some run streamed past them again: a run killed before that (soon after
    its first commit, on a loaded machine) left lines far from the end that its state did not
    cover, and the next run wrote them a third time. So a rerun cuts the output back here.
    """

    path: str  # the output's real path (absolute, links resolved)
    device: int
    inode: int
    size: int  # bytes the commit had written and synced

    @classmethod
    def of(cls, path: Path, fd: int) -> OutputMark:
        """The mark of the open output ``fd`` (flushed) named ``path``."""
        status = os.fstat(fd)
        return cls(os.path.realpath(path), status.st_dev, status.st_ino, status.st_size)

    def names(self, output: Path) -> bool:
        """Whether ``output`` is the very file this mark was taken of (not a new file at the
        same path after a rotation, nor another path)."""
        try:
            status = output.stat()
        except FileNotFoundError:
            return False
        return (os.path.realpath(output), status.st_dev, status.st_ino) == (
            self.path,
            self.device,
            self.inode,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "device": self.device, "inode": self.inode, "size": self.size}

    @classmethod
    def from_dict(cls, raw: object) -> OutputMark:
        """Raises ValueError for a malformed entry."""
        if not isinstance(raw, dict):
            raise ValueError("its output entry is not an object")
        try:
            mark = cls(str(raw["path"]), int(raw["device"]), int(raw["inode"]), int(raw["size"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"its output entry is invalid: {error!r}") from None
        if mark.size < 0:
            raise ValueError(f"its output entry has a negative size {mark.size}")
        return mark


# The state file: {"format": 2, "output": OutputMark or null, "vbuckets": SessionState}. Files
# of the first format hold the bare SessionState (no output mark) and are still read.
STATE_FORMAT = 2


def _state_text(session: SessionState, mark: OutputMark | None) -> str:
    output = None if mark is None else mark.to_dict()
    return json.dumps({"format": STATE_FORMAT, "output": output, "vbuckets": session.to_dict()})


def _parse_state(text: str) -> tuple[SessionState, OutputMark | None]:
    """A state file's sessions and output mark. Raises ValueError for a malformed file."""
    try:
        raw = json.loads(text)
    except ValueError as error:
        raise ValueError(f"session state is not JSON: {error}") from None
    if not isinstance(raw, dict) or "format" not in raw:
        return SessionState.from_dict(raw), None  # the first format: sessions only
    if raw["format"] != STATE_FORMAT:
        raise ValueError(f"format {raw['format']!r} is not {STATE_FORMAT} (a newer changefeed?)")
    output = raw.get("output")
    mark = None if output is None else OutputMark.from_dict(output)
    return SessionState.from_dict(raw.get("vbuckets")), mark


def _load_state(state_file: Path | None) -> tuple[SessionState, OutputMark | None] | None:
    if state_file is None or not state_file.exists():
        return None
    try:
        return _parse_state(state_file.read_text())
    except ValueError as error:
        raise click.ClickException(f"state file {state_file}: {error}") from None
    except OSError as error:
        raise click.ClickException(
            f"cannot read state file {state_file}: {error.strerror}"
        ) from None


def _check_output(output: Path, resume: SessionState | None, mark: OutputMark | None) -> None:
    """Refuse to add a second copy of changes; cut what a killed run wrote past its state.

    An output that holds lines is appended to only when a state file says where they end.
    A run from the beginning saves its state before the first line, so even one killed before
    its first commit leaves a state; one from ``now`` saves it with the first batch.

    When the state's mark names this very file, the file is cut back to the length the mark
    says was synced (the lines past it are streamed again), and a file shorter than that lost
    lines the state covers: refused. Another file (a rotated output, a first-format state)
    only loses a last line left unfinished.
    """
    size = output.stat().st_size if output.exists() else 0
    if size and resume is None:
        raise click.BadParameter(
            f"{output} already holds {size:,} bytes and no --state file says where they end: "
            "remove it, or pass the --state it was written with",
            param_hint="'--output'",
        )
    if mark is not None and mark.names(output):
        if size < mark.size:
            raise click.BadParameter(
                f"{output} holds {size:,} bytes but its --state says {mark.size:,} were "
                "written and synced: lines the state covers are gone (restore the file, or "
                "start a new output)",
                param_hint="'--output'",
            )
        if size > mark.size:
            _truncate(output, mark.size)
            click.echo(
                f"note: removed {size - mark.size:,} bytes of {output} written after its last "
                "saved state; they are streamed again",
                err=True,
            )
        return
    if size:
        trimmed = _trim_unfinished_line(output)
        if trimmed:
            click.echo(
                f"note: removed {trimmed} bytes of an unfinished last line of {output}", err=True
            )


def _truncate(path: Path, size: int) -> None:
    """Cut ``path`` to ``size`` bytes, durably (before anything is appended after them)."""
    try:
        with open(path, "r+b") as handle:
            handle.truncate(size)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        raise click.ClickException(f"cannot cut {path} back: {error.strerror}") from None


def _trim_unfinished_line(path: Path) -> int:
    """Cut ``path`` back to just after its last newline; returns the bytes removed.

    Only bytes past the state can be unfinished: the state is saved after the batch is synced.
    """
    with open(path, "r+b") as handle:
        end = handle.seek(0, os.SEEK_END)
        keep = end
        while keep > 0:  # bounded: steps back TAIL_SCAN_BYTES at a time to the file's start
            step = min(TAIL_SCAN_BYTES, keep)
            handle.seek(keep - step)
            newline = handle.read(step).rfind(b"\n")
            if newline >= 0:
                keep = keep - step + newline + 1
                break
            keep -= step
        if keep != end:
            handle.truncate(keep)
            handle.flush()
            os.fsync(handle.fileno())
        assert 0 <= keep <= end, (keep, end)
        return end - keep


@contextlib.contextmanager
def _open_output(output: Path) -> Any:
    if str(output) == "-":
        yield sys.stdout
        return
    try:
        handle = open(output, "a", encoding="utf-8")  # noqa: SIM115 (closed below)
    except OSError as error:
        raise click.ClickException(f"cannot open {output}: {error.strerror}") from None
    with handle:
        yield handle


class _Sink:
    """Where ``stream`` puts what it reads: JSON lines, and the state saved behind them.

    ``commit`` flushes and fsyncs the output, then replaces the state file atomically (temp
    file, fsync, rename) with the sessions and the output's length (``OutputMark``). So the
    state never claims a line the output does not hold, and the output holds at most the
    lines since the last commit beyond it, which a rerun cuts (``_check_output``).
    ``written`` commits once ``COMMIT_LINES_MAX`` lines or ``COMMIT_INTERVAL_S`` have gone by
    (a commit per read would spend more on fsync than on streaming), and when the stream
    pauses a timer commits what is left.

    The timer runs between steps of the event loop, when the session matches the lines
    written: ``DcpClient.events()`` applies an event to the session and yields it with no
    await in between, and the lines of an event are written with no await either.
    """

    def __init__(
        self,
        output: TextIO,
        name: str,
        state_file: Path | None,
        *,
        path: Path | None = None,
        carried: SessionState | None = None,
    ) -> None:
        """``path``: the output file's (None: stdout), saved in the state with its length.
        ``carried``: the state resumed from; its vbuckets this run does not stream (see
        ``--vbuckets``) are saved as they were, not dropped from the state file."""
        self._output = output
        self._name = name
        self._path = path
        self.collections = False  # keys carry collection ids (stream --collections/--scope)
        self._state_file = state_file
        self._carried = {} if carried is None else dict(carried.vbuckets)
        self._sync = _is_regular_file(output)
        self._whole = True  # False while (or after) a write fails part-way
        self._uncommitted = 0  # lines written since the last commit
        self._committed_at = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self.error: click.ClickException | None = None  # a commit by the timer failed
        self.changes = 0
        self.rollbacks = 0

    def write_changes(self, cols: ChangeColumns) -> None:
        record = _collection_record if self.collections else _record
        self._write("".join(json.dumps(record(cols, i)) + "\n" for i in range(len(cols))))
        self.changes += len(cols)
        self._uncommitted += len(cols)

    def write_rows(self, batch: Any, vbs: set[int]) -> None:
        """Change rows (``stream --local``): the lines ``write_changes`` writes, without
        delete_time and datatype (change rows do not carry them)."""
        lines = []
        for row in batch.to_pylist():
            if row["vbucket"] not in vbs:
                continue
            if row["op"] == "rollback":
                record = {"vb": row["vbucket"], "op": "rollback", "seqno": row["seqno"]}
                self.rollbacks += 1
            else:
                record = {
                    "vb": row["vbucket"],
                    "seqno": row["seqno"],
                    "op": row["op"],
                    "key": row["key"],
                    "cas": row["cas"],
                    "rev_seqno": row["rev_seqno"],
                    "flags": row["flags"] & 0xFFFF_FFFF,
                    "expiry": row["expiry"] & 0xFFFF_FFFF,
                    "value": _text(row["value"]),
                }
                self.changes += 1
            lines.append(json.dumps(record) + "\n")
        self._write("".join(lines))
        self._uncommitted += len(lines)

    def write_collection_event(self, event: CollectionEvent) -> None:
        """A collection or scope created or dropped (``stream --collections``), as a line."""
        m = event.message
        line = {"vb": event.vbucket, "seqno": m.seqno, "op": _EVENT_OPS[m.event],
                "scope": m.scope_id, "collection": m.collection_id, "name": _text(m.name),
                "manifest_uid": f"{m.manifest_uid:x}"}  # fmt: skip
        self._write(json.dumps(line) + "\n")
        self._uncommitted += 1

    def write_rollback(self, event: Rollback) -> None:
        line = json.dumps({"vb": event.vbucket, "op": "rollback", "seqno": event.seqno})
        self._write(line + "\n")
        self.rollbacks += 1
        self._uncommitted += 1

    def _write(self, text: str) -> None:
        self._whole = False
        try:
            self._output.write(text)
        except OSError as error:
            raise click.ClickException(f"cannot write {self._name}: {error.strerror}") from None
        self._whole = True

    def written(self, session: SessionState) -> None:
        """After an event's lines: commit if due, else make sure the pause timer is set.

        Args:
            session: the client's session, which has taken every event written so far.
        """
        due = time.monotonic() - self._committed_at >= COMMIT_INTERVAL_S
        if due or self._uncommitted >= COMMIT_LINES_MAX:
            self.commit(session)
        elif self._timer is None and self._uncommitted:
            reader = asyncio.current_task()
            assert reader is not None  # called from the stream's task
            self._timer = asyncio.get_running_loop().call_later(
                COMMIT_INTERVAL_S, self._commit_in_pause, session, reader
            )

    def _commit_in_pause(self, session: SessionState, reader: asyncio.Task[Any]) -> None:
        self._timer = None
        try:
            self.commit(session)
        except click.ClickException as error:
            self.error = error  # the reader raises it once cancelled
            reader.cancel()

    def commit(self, session: SessionState) -> None:
        """Make the lines written so far durable, then save ``session`` as the state."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._whole:
            return  # a batch is partly written: the state stays where the output is whole
        try:
            self._output.flush()
            if self._sync:
                os.fsync(self._output.fileno())
            mark = None
            if self._sync and self._path is not None:
                mark = OutputMark.of(self._path, self._output.fileno())
        except OSError as error:
            raise click.ClickException(f"cannot write {self._name}: {error.strerror}") from None
        self._uncommitted = 0
        self._committed_at = time.monotonic()
        if self._state_file is None:
            return
        if self._carried:
            session = SessionState({**self._carried, **session.vbuckets})
        try:
            _save_atomically(self._state_file, _state_text(session, mark))
        except OSError as error:
            raise click.ClickException(
                f"cannot save state file {self._state_file}: {error.strerror}"
            ) from None


def _is_regular_file(handle: TextIO) -> bool:
    try:
        return stat.S_ISREG(os.fstat(handle.fileno()).st_mode)
    except (OSError, ValueError):  # no file descriptor (a test's captured stdout)
        return False


def _save_atomically(path: Path, text: str) -> None:
    """Replace ``path`` with ``text``: a crash leaves the old file or the new one, whole."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power loss
    finally:
        os.close(directory)


def _record(cols: ChangeColumns, i: int) -> dict[str, Any]:
    return {
        "vb": cols.vbucket[i],
        "seqno": cols.seqno[i],
        "op": OPS[cols.opcode[i]],
        "key": _text(cols.key[i]),
        "cas": cols.cas[i],
        "rev_seqno": cols.rev_seqno[i],
        "flags": cols.flags[i],
        "expiry": cols.expiry[i],
        "delete_time": cols.delete_time[i],
        "datatype": cols.datatype[i],
        "value": _text(cols.value[i]),
    }


_EVENT_OPS = {
    SystemEvent.BEGIN_COLLECTION: "collection_created",
    SystemEvent.END_COLLECTION: "collection_dropped",
    SystemEvent.CREATE_SCOPE: "scope_created",
    SystemEvent.DROP_SCOPE: "scope_dropped",
}


def _collection_record(cols: ChangeColumns, i: int) -> dict[str, Any]:
    """``_record`` of a collections stream: the key without its collection id, which is a
    field of its own."""
    record = _record(cols, i)
    cid, key = split_key(cols.key[i])
    record["collection"] = cid
    record["key"] = _text(key)
    return record


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(value).decode()


async def _node_vbuckets(config: ClientConfig) -> int:
    """How many vbuckets the node has (its cluster map)."""
    kv = await KvClient.connect(
        config.host, config.port, bucket=config.bucket, user=config.user, password=config.password
    )
    await kv.close()
    return kv.vbuckets


def _check_vbuckets(wanted: list[int] | None, vbuckets: int, target: Target) -> list[int]:
    if wanted is None:
        return list(range(vbuckets))
    outside = [vb for vb in wanted if vb >= vbuckets]
    if outside:
        raise click.BadParameter(
            f"vbuckets {_ranges(outside)} are not on {target.address}, which has vbuckets "
            f"0-{vbuckets - 1}",
            param_hint="'--vbuckets'",
        )
    return wanted


def _ranges(vbs: list[int]) -> str:
    """``[3, 4, 5, 9]`` as ``3-5,9``."""
    parts: list[str] = []
    first = previous = vbs[0]
    for vb in [*vbs[1:], -1]:
        if vb != previous + 1:
            parts.append(str(first) if first == previous else f"{first}-{previous}")
            first = vb
        previous = vb
    return ",".join(parts)


def _stream_progress(enabled: bool) -> Progress:
    return Progress(
        TextColumn("stream"),
        SpinnerColumn(),
        TextColumn("{task.completed:,.0f} changes"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        disable=not enabled,
    )


async def _copy_events(
    client: DcpClient, streams: int, sink: _Sink, follow: bool, progress: Progress
) -> int:
    """Write events to ``sink``, committing after each batch; returns the streams read.

    Raises:
        click.ClickException: the node refused a stream.
    """
    ended = 0
    task = progress.add_task("stream", total=None)
    async for event in client.events():
        if isinstance(event, Changes):
            sink.write_changes(event.columns)
            sink.written(client.session)  # the session has taken this batch already
            progress.update(task, completed=sink.changes)
        elif isinstance(event, Rollback):
            sink.write_rollback(event)
            sink.written(client.session)
        elif isinstance(event, CollectionEvent):
            sink.write_collection_event(event)
            sink.written(client.session)
        elif isinstance(event, StreamRefused):
            status = Status.name_of(event.status)
            raise click.ClickException(
                f"the node refused the stream of vbucket {event.vbucket}: {status} "
                f"{event.message}".rstrip()
            )
        elif isinstance(event, StreamEnded):
            ended += 1
            if not follow and ended >= streams:
                break
    return streams


async def _stream_local(
    config: ClientConfig,
    wanted: list[int] | None,
    start: str | SessionState,
    follow: bool,
    sink: _Sink,
    directory: Path | None,
    app_id: int | None,
    target: Target,
) -> int:
    """``stream --local``: every service of the node covering the vbuckets (changefeed.ipc),
    each a `LocalStream` (shared memory, DCP when it falls behind); returns the vbuckets read."""
    from changefeed.ipc import IpcError
    from changefeed.ipc.errors import UnpublishedError
    from changefeed.ipc.local_stream import LocalStream, high_seqnos, open_local_streams

    vbs = set(_check_vbuckets(wanted, await _node_vbuckets(config), target))
    origin: Any = "now" if start == "now" else start
    streams: list[LocalStream] = []
    session = SessionState()
    try:
        try:
            streams = open_local_streams(config, vbs, origin, directory=directory, app_id=app_id)
        except UnpublishedError as error:
            raise click.ClickException(
                f"vbuckets {_ranges(error.missing)} of {target.address} are not published over "
                "shared memory here (start the node with --shm, or pass its --shm-dir)"
            ) from None
        ends = None if follow else await high_seqnos(config)
        pending = list(streams)
        while pending:  # until every stream reached its end (--to-latest), or forever
            for local in list(pending):
                batch = await local.next_batch(0.05 / len(pending))
                if batch is not None:
                    sink.write_rows(batch, vbs)
                if local.session is not None:
                    for vb in local.vbuckets:
                        session.vbuckets[vb] = local.session.get(vb)
                    if batch is not None:
                        sink.written(session)
                    if ends is not None and all(
                        local.session.get(vb).seqno >= ends.get(vb, 0) for vb in local.vbuckets
                    ):
                        pending.remove(local)
                await asyncio.sleep(0)
    except IpcError as error:
        raise click.ClickException(f"shared memory: {error}") from None
    finally:
        for local in streams:
            local.close()
        if session.vbuckets:  # never replace a state file with nothing
            sink.commit(session)
    return len(vbs)


@click.command()
@connection_options
@click.argument("group", default="")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def stats(
    host: str, port: int, bucket: str, user: str, password: str, group: str, as_json: bool
) -> None:
    """Print STAT GROUP of a node ("", "vbucket-seqno [vb]", "failovers [vb]", "dcp")."""

    async def main() -> dict[str, str]:
        conn = await connect(
            host, port, agent="changefeed-stats", user=user, password=password, bucket=bucket
        )
        try:
            opaque = conn.next_opaque()
            request = encode_request(Opcode.STAT, opaque=opaque, key=group.encode())
            frames = await conn.request_many(
                request, opaque, lambda f: not f.key or f.status != Status.SUCCESS
            )
            if frames[-1].status != Status.SUCCESS:
                status = Status.name_of(frames[-1].status)
                raise click.ClickException(f"STAT {group!r} failed: {status}")
            return {f.key.decode(): f.value.decode() for f in frames if f.key}
        finally:
            await conn.close()

    result = run_against(main(), Target(host, port, user))
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            click.echo(f"{key:40} {value}")


def run_against(coroutine: Coroutine[Any, Any, T], target: Target) -> T:
    """Run a command's coroutine; turn what the node (or the network) did into one line.

    Raises:
        click.ClickException: exit 1, naming ``target`` (click's own exceptions pass through).
    """
    holder: list[T] = []

    async def wrapper() -> None:
        holder.append(await coroutine)

    try:
        run_loop(wrapper())
    except AuthError:
        raise click.ClickException(
            f"authentication failed for user {target.user!r} at {target.address}"
        ) from None
    except StatusError as error:
        raise click.ClickException(f"{target.address} answered {error}") from None
    except ConnectionClosedError as error:
        raise click.ClickException(f"lost the connection to {target.address}: {error}") from None
    except TimeoutError:
        raise click.ClickException(f"{target.address} did not answer in time") from None
    except OSError as error:
        reason = error.strerror or str(error)
        raise click.ClickException(f"cannot reach the node at {target.address}: {reason}") from None
    assert len(holder) == 1, holder
    return holder[0]
