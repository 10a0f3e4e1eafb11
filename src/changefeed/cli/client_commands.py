"""``changefeed load``, ``changefeed stream`` and ``changefeed stats``: client-side commands.

``load`` is a workload generator (count, value size, update/delete ratios, optional rate) with a
progress bar; ``stream`` prints changes or writes JSON lines, saving and resuming session state;
``stats`` prints a node's STAT groups (``--json`` for scripts).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import click
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

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
from changefeed.consumer.handshake import connect
from changefeed.protocol.kv import encode_request
from changefeed.protocol.opcode import Opcode
from changefeed.protocol.status import Status


def _connection_options(f: Any) -> Any:
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
@_connection_options
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

    async def main() -> dict[str, Any]:
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
            )
        finally:
            await kv.close()

    summary = _run(main())
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(
            f"{summary['ops']:,} ops ({summary['sets']:,} sets, {summary['deletes']:,} deletes) "
            f"in {summary['seconds']:.2f} s: {summary['ops_per_s']:,.0f} ops/s"
        )


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
) -> dict[str, Any]:
    rng = random.Random(seed)
    written: list[bytes] = []
    sets = deletes = 0
    window = 256 if rate == 0 else max(1, int(rate / 20))
    started = time.perf_counter()
    progress = Progress(
        TextColumn("load"),
        BarColumn(),
        TaskProgressColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=quiet,
    )
    with progress:
        task = progress.add_task("load", total=count)
        done = 0
        while done < count:
            batch: list[tuple[bytes, bytes]] = []
            for _ in range(min(window, count - done)):
                roll = rng.random()
                if written and roll < delete_ratio:
                    key = written.pop(rng.randrange(len(written)))
                    await _remove_quietly(kv, key)
                    deletes += 1
                    continue
                if written and roll < delete_ratio + update_ratio:
                    key = rng.choice(written)
                else:
                    key = b"key::%010d" % rng.randrange(keyspace)
                    written.append(key)
                batch.append((key, _value(rng, value_size)))
            await kv.upsert_many(batch, durability=durability)  # type: ignore[arg-type]
            sets += len(batch)
            done += window if len(batch) + deletes else 1
            done = min(done, count)
            progress.update(task, completed=done)
            if rate:
                await asyncio.sleep(max(0.0, done / rate - (time.perf_counter() - started)))
    seconds = time.perf_counter() - started
    ops = sets + deletes
    return {
        "ops": ops,
        "sets": sets,
        "deletes": deletes,
        "seconds": seconds,
        "ops_per_s": ops / seconds if seconds else 0.0,
    }


async def _remove_quietly(kv: KvClient, key: bytes) -> None:
    from changefeed.protocol.errors import KeyNotFoundError

    with contextlib.suppress(KeyNotFoundError):  # the key was already removed
        await kv.remove(key)


def _value(rng: random.Random, size: int) -> bytes:
    body = b'{"n":%d,"s":"' % rng.getrandbits(31)
    pad = max(0, size - len(body) - 2)
    return body + b"x" * pad + b'"}'


@click.command()
@_connection_options
@click.option("--vbuckets", default="all", show_default=True, help="e.g. 0-15,32 or all.")
@click.option("--from", "start", type=click.Choice(["beginning", "now"]), default="beginning")
@click.option(
    "--state",
    "state_file",
    type=click.Path(path_type=Path),
    help="Resume from this state file if it exists; save to it on exit.",
)
@click.option(
    "--follow/--to-latest",
    default=False,
    show_default=True,
    help="Keep streaming, or stop at the high seqnos of the start.",
)
@click.option("--output", type=click.File("w"), default="-", help="JSON lines here.")
def stream(
    host: str,
    port: int,
    bucket: str,
    user: str,
    password: str,
    vbuckets: str,
    start: str,
    state_file: Path | None,
    follow: bool,
    output: TextIO,
) -> None:
    """Stream changes as JSON lines (one object per change, rollback or stream end)."""
    resume = None
    if state_file is not None and state_file.exists():
        try:
            resume = SessionState.from_json(state_file.read_text())
        except ValueError as error:
            raise click.ClickException(f"{state_file}: {error}") from None
    config = ClientConfig(
        host=host, port=port, bucket=bucket, user=user, password=password, to_latest=not follow
    )

    async def main() -> int:
        async with DcpClient(config) as client:
            vbs = await _resolve_vbuckets(client, vbuckets, host, port, bucket, user, password)
            await client.stream(vbs, start=resume if resume is not None else start)  # type: ignore[arg-type]
            try:
                return await _print_events(client, len(vbs), output, follow)
            finally:
                if state_file is not None:
                    state_file.write_text(client.session.to_json())

    count = _run(main())
    print(f"{count} changes", file=sys.stderr)


async def _resolve_vbuckets(
    client: DcpClient, spec: str, host: str, port: int, bucket: str, user: str, password: str
) -> list[int]:
    if spec != "all":
        out: list[int] = []
        for part in spec.split(","):
            low, _, high = part.partition("-")
            out.extend(range(int(low), int(high or low) + 1))
        return out
    kv = await KvClient.connect(host, port, bucket=bucket, user=user, password=password)
    await kv.close()
    return list(range(kv.vbuckets))


async def _print_events(client: DcpClient, streams: int, output: TextIO, follow: bool) -> int:
    count = ended = 0
    async for event in client.events():
        if isinstance(event, Changes):
            cols = event.columns
            for i in range(len(cols)):
                op = {0x57: "mutation", 0x58: "deletion", 0x59: "expiration"}[cols.opcode[i]]
                record = {
                    "vb": cols.vbucket[i],
                    "seqno": cols.seqno[i],
                    "op": op,
                    "key": cols.key[i].decode(errors="replace"),
                    "cas": cols.cas[i],
                    "value": _text(cols.value[i]),
                }
                output.write(json.dumps(record) + "\n")
            count += len(cols)
        elif isinstance(event, Rollback):
            output.write(
                json.dumps({"vb": event.vbucket, "op": "rollback", "seqno": event.seqno}) + "\n"
            )
        elif isinstance(event, StreamEnded | StreamRefused):
            ended += 1
            if not follow and ended >= streams:
                break
    output.flush()
    return count


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(value).decode()


@click.command()
@_connection_options
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

    result = _run(main())
    if as_json:
        click.echo(json.dumps(result, indent=1))
    else:
        for key, value in result.items():
            click.echo(f"{key:40} {value}")


def _run(coroutine: Any) -> Any:
    holder: list[Any] = []

    async def wrapper() -> None:
        holder.append(await coroutine)

    try:
        run_loop(wrapper())
    except (OSError, ConnectionError) as error:
        raise click.ClickException(f"cannot reach the node: {error}") from None
    return holder[0]
