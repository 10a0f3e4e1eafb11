"""Throw malformed, random and mutated frames at a live node over raw sockets (invariant 5).

The one invariant: bad input from the network gets an error status or a closed connection, never
a crash, a hang, an exception in the node's log, or unbounded memory. Each connection takes one
of several shapes: pure garbage; well-formed frames without authenticating; HELLO + SASL PLAIN +
SELECT_BUCKET and then frames; the same plus DCP_OPEN and DCP-heavy frames; headers declaring
huge bodies; valid frames split into random chunks. Frames are built from templates of every
command the node knows (random but consistent lengths), about half of them then mutated (bytes
flipped in the body, sometimes in the header). Afterwards the node must be alive, its RSS near
where it started, and an ordinary client must work.

Seeded: the seed is printed; ``CHANGEFEED_TEST_SEED=<seed>`` replays the same frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import struct
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from changefeed import limits
from changefeed.cli.node_process import NodeProcess
from changefeed.consumer.handshake import select_bucket
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.reader import FrameReader
from changefeed.protocol.sasl import encode_plain
from changefeed.vbmap import vbucket_for_key
from support.clients import HOST, kv_connect, raw_connection
from support.consumer import server_state
from support.nodes import NodeFactory

from .harness import rss_sampler

pytestmark = pytest.mark.timeout(180)

HEADER = struct.Struct(">BBHBBHIIQ")
ALT_HEADER = struct.Struct(">BBBBBBHIIQ")
READ_BYTES_MAX = 4 * 1024 * 1024  # per connection: streams a fuzzer opened may send data
IDLE_S = 0.15
PROBE_KEY = b"probe::not-a-fuzzed-key"
CONNECTIONS_AT_ONCE = 48
SCENARIO_DEADLINE_S = 150.0  # under pytest-timeout's 180 s, so the stacks get printed
CONTROL_KEYS = [
    "connection_buffer_size", "enable_noop", "set_noop_interval", "set_priority",
    "supports_cursor_dropping", "send_stream_end_on_client_close_stream", "enable_expiry_opcode",
    "enable_stream_id", "max_marker_version", "v7_dcp_status_codes", "consumer_name", "bogus",
]  # fmt: skip
CONTROL_VALUES = [
    "true", "false", "0", "1", "0.1", "1e309", "nan", "-1", "4294967296", "2.2", "high", "",
    "\u00e9", "9" * 40,
]  # fmt: skip
STAT_GROUPS = [
    "", "vbucket-seqno", "vbucket-seqno 3", "vbucket-seqno 99999", "failovers", "failovers 1",
    "failovers 70000", "dcp", "bogus group", "vbucket-seqno -1",
]  # fmt: skip


def frame(
    opcode: int,
    *,
    magic: int = Magic.REQUEST,
    key: bytes = b"",
    extras: bytes = b"",
    value: bytes = b"",
    vbucket: int = 0,
    opaque: int = 0,
    cas: int = 0,
    datatype: int = 0,
) -> bytes:
    body = len(extras) + len(key) + len(value)
    header = HEADER.pack(magic, opcode, len(key), len(extras), datatype, vbucket, body, opaque, cas)
    return header + extras + key + value


class FrameMaker:
    """Random frames from templates of every command, optionally mutated."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def u(self, bits: int) -> int:
        r = self.rng
        return r.choice([0, 1, 2**bits - 1, 2 ** (bits - 1), r.getrandbits(bits), r.randrange(64)])

    def key(self) -> bytes:
        r = self.rng
        return r.choice([b"", b"k", r.randbytes(r.randrange(1, 40)), b"x" * 250, b"y" * 300])

    def vb(self) -> int:
        return self.rng.choice([0, 1, 3, 7, 8, 1023, 1024, 65535, self.rng.randrange(16)])

    def seqno(self) -> int:
        r = self.rng
        return r.choice([0, 1, 5, 100, 2**63, 2**64 - 1, r.randrange(2000)])

    def template(self, dcp: bool, *, framing: bool = False) -> bytes:
        r = self.rng
        opaque = r.getrandbits(32)
        kinds = [
            "get", "set", "add", "replace", "delete", "stat", "noop", "hello", "sasl",
            "select", "vbseqnos", "observe", "failover", "config", "random", "response",
            "list_mechs",
        ]  # fmt: skip
        if dcp:
            kinds += ["open", "control", "stream_req", "stream_req", "close", "ack", "dcp_noop"] * 2
        else:
            kinds += ["open", "control", "stream_req", "ack"]
        kind = r.choice(kinds)
        vb = self.vb()
        if kind == "get":
            return frame(Opcode.GET, key=self.key(), vbucket=vb, opaque=opaque)
        if kind in ("set", "add", "replace"):
            op = {"set": Opcode.SET, "add": Opcode.ADD, "replace": Opcode.REPLACE}[kind]
            extras = r.choice([struct.pack(">II", self.u(32), self.u(32)), b"", r.randbytes(5)])
            value = r.choice([b"", b"v", r.randbytes(r.randrange(300)), b'{"a":1}'])
            return frame(
                op, key=self.key(), extras=extras, value=value, vbucket=vb, opaque=opaque,
                cas=self.u(64), datatype=r.choice([0, 1, 2, 4, 7] + ([8, 255] if framing else [])),
            )  # fmt: skip
        if kind == "delete":
            return frame(Opcode.DELETE, key=self.key(), vbucket=vb, opaque=opaque, cas=self.u(64))
        if kind == "stat":
            group = r.choice(STAT_GROUPS).encode()
            return frame(Opcode.STAT, key=group, opaque=opaque)
        if kind == "noop":
            return frame(Opcode.NOOP, opaque=opaque, value=r.choice([b"", b"junk"]))
        if kind == "hello":
            features = b"".join(struct.pack(">H", self.u(16)) for _ in range(r.randrange(12)))
            return frame(Opcode.HELLO, key=self.key(), value=features + r.choice([b"", b"x"]))
        if kind == "sasl":
            mech = r.choice([b"PLAIN", b"SCRAM-SHA512", b"SCRAM-SHA256", b"SCRAM-SHA1", b""])
            payload = r.choice([
                encode_plain("Administrator", "bad"), b"n,,n=Administrator,r=abc", b"\0\0",
                r.randbytes(r.randrange(80)), b"c=biws,r=x,p=" + r.randbytes(20),
            ])  # fmt: skip
            op = r.choice([Opcode.SASL_AUTH, Opcode.SASL_STEP])
            return frame(op, key=mech, value=payload, opaque=opaque)
        if kind == "list_mechs":
            return frame(Opcode.SASL_LIST_MECHS, opaque=opaque)
        if kind == "select":
            name = r.choice([b"default", b"", b"other", r.randbytes(r.randrange(1, 300))])
            return frame(Opcode.SELECT_BUCKET, key=name, opaque=opaque)
        if kind == "vbseqnos":
            extras = r.choice([b"", struct.pack(">I", self.u(32)), r.randbytes(3)])
            return frame(Opcode.GET_ALL_VB_SEQNOS, extras=extras, opaque=opaque)
        if kind == "observe":
            value = r.choice([struct.pack(">Q", self.u(64)), r.randbytes(r.randrange(20))])
            return frame(Opcode.OBSERVE_SEQNO, value=value, vbucket=vb, opaque=opaque)
        if kind == "failover":
            op = r.choice([Opcode.GET_FAILOVER_LOG, Opcode.DCP_GET_FAILOVER_LOG])
            return frame(op, vbucket=vb, opaque=opaque)
        if kind == "config":
            return frame(Opcode.GET_CLUSTER_CONFIG, opaque=opaque)
        if kind == "open":
            extras = struct.pack(">II", self.u(32), r.choice([1, 0, 0x40000001, self.u(32)]))
            name = r.choice([b"fuzz", b"replication:x", b"", r.randbytes(r.randrange(1, 60))])
            value = r.choice([b"", b'{"consumer_name":"c"}', r.randbytes(10)])
            return frame(Opcode.DCP_OPEN, key=name, extras=extras, value=value, opaque=opaque)
        if kind == "control":
            key = r.choice(CONTROL_KEYS).encode()
            value = r.choice(CONTROL_VALUES).encode()
            return frame(Opcode.DCP_CONTROL, key=key, value=value, opaque=opaque)
        if kind == "stream_req":
            start = self.seqno()
            extras = struct.pack(
                ">IIQQQQQ", self.u(32) & r.choice([0, 0x1FF, 0xFFFFFFFF]), 0, start,
                r.choice([2**64 - 1, start, self.seqno()]), r.choice([0, self.u(64)]),
                r.choice([start, 0, self.seqno()]), r.choice([start, 2**64 - 1, self.seqno()]),
            )  # fmt: skip
            value = r.choice([
                b"", b'{"purge_seqno":"5"}', b'{"purge_seqno":5}', b"{", b"[]",
                json.dumps({"purge_seqno": "9" * 30}).encode(), r.randbytes(r.randrange(30)),
            ])  # fmt: skip
            if r.random() < 0.2:
                extras = extras[: r.randrange(len(extras))]
            return frame(Opcode.DCP_STREAM_REQ, extras=extras, value=value, vbucket=vb,
                         opaque=opaque)  # fmt: skip
        if kind == "close":
            return frame(Opcode.DCP_CLOSE_STREAM, vbucket=vb, opaque=opaque)
        if kind == "ack":
            extras = r.choice([struct.pack(">I", self.u(32)), b"", r.randbytes(7)])
            return frame(Opcode.DCP_BUFFER_ACKNOWLEDGEMENT, extras=extras, opaque=opaque)
        if kind == "dcp_noop":
            magic = r.choice([Magic.REQUEST, Magic.RESPONSE])
            return frame(Opcode.DCP_NOOP, magic=magic, opaque=r.choice([opaque, 10_000_001]))
        if kind == "response":
            return frame(
                r.getrandbits(8), magic=Magic.RESPONSE, key=self.key(), value=r.randbytes(8),
                vbucket=self.u(16), opaque=opaque,
            )  # fmt: skip
        # "random": any opcode, any magic byte, random sections.
        magic: int = Magic.REQUEST
        if framing:
            magic = r.choice([Magic.REQUEST, Magic.RESPONSE, 0x08, 0x18, r.getrandbits(8)])
        return frame(
            r.getrandbits(8), magic=magic, key=self.key(), extras=r.randbytes(r.randrange(40)),
            value=r.randbytes(r.randrange(100)), vbucket=vb, opaque=opaque,
            datatype=r.getrandbits(8) if framing else r.choice([0, 1, 7]),
        )  # fmt: skip

    def mutate(self, data: bytes, *, framing: bool) -> bytes:
        """Flip bytes. Without ``framing`` the frame stays decodable (lengths, magic and datatype
        untouched), so the connection survives and the handlers see it; with it, anything goes."""
        r = self.rng
        buf = bytearray(data)
        where = r.random()
        if where < 0.8 and len(buf) > 24:  # body only
            for _ in range(r.randrange(1, 6)):
                buf[r.randrange(24, len(buf))] = r.getrandbits(8)
        elif where < 0.9 or not framing:  # opcode, vbucket, opaque, cas
            for _ in range(r.randrange(1, 3)):
                index = r.choice([1, 6, 7, 12, 13, 14, 15, 16, 23])
                buf[index] = r.getrandbits(8)
        else:  # anything, including magic, datatype and the lengths
            for _ in range(r.randrange(1, 4)):
                buf[r.randrange(len(buf))] = r.getrandbits(8)
        return bytes(buf)

    def make(self, dcp: bool, *, framing: bool = False) -> bytes:
        data = self.template(dcp, framing=framing)
        if self.rng.random() < 0.5:
            data = self.mutate(data, framing=framing)
        return data

    def huge(self) -> bytes:
        r = self.rng
        body = r.choice([limits.FRAME_SIZE_MAX + 1, 2**32 - 1, 2**31, limits.FRAME_SIZE_MAX])
        magic = r.choice([Magic.REQUEST, Magic.RESPONSE, 0x08])
        header = HEADER.pack(magic, r.getrandbits(8), self.u(16), self.u(8), 0, 0, body, 0, 0)
        return header + r.randbytes(r.randrange(0, 2000))


def handshake() -> bytes:
    """HELLO, SASL PLAIN and SELECT_BUCKET, pipelined (the node handles them in order)."""
    plain = encode_plain("Administrator", "password")
    return (
        frame(Opcode.HELLO, key=b"fuzz", value=struct.pack(">HH", 0x03, 0x0B), opaque=1)
        + frame(Opcode.SASL_AUTH, key=b"PLAIN", value=plain, opaque=2)
        + frame(Opcode.SELECT_BUCKET, key=b"default", opaque=3)
    )


async def one_connection(
    node: NodeProcess, rng: random.Random, maker: FrameMaker, frames: int
) -> tuple[int, int, str]:
    """Open a socket, send one shape of bad traffic, read until close or idle. Returns
    (frames sent, frames received, how the connection ended)."""
    shape = rng.choice(["garbage", "unauth", "auth", "auth", "dcp", "dcp", "dcp", "huge",
                        "split", "mutant", "mutant"])  # fmt: skip
    reader, writer = await asyncio.open_connection(HOST, node.port)
    sent = replies = 0
    answers = FrameReader()
    chunks: list[bytes] = []
    if shape in ("auth", "dcp", "split", "mutant"):
        chunks.append(handshake())
    if shape == "dcp":
        name = b"fuzz-%d" % rng.getrandbits(32)
        chunks.append(frame(Opcode.DCP_OPEN, key=name, extras=struct.pack(">II", 0, 1), opaque=4))
    for _ in range(frames):
        if shape == "garbage":
            chunks.append(rng.randbytes(rng.randrange(1, 120)))
        elif shape == "huge":
            chunks.append(maker.huge() if rng.random() < 0.3 else maker.make(False))
        elif shape == "mutant":  # authenticated, and the framing itself may break
            chunks.append(maker.make(rng.random() < 0.5, framing=True))
        else:
            chunks.append(maker.make(shape == "dcp"))
        sent += 1
    data = b"".join(chunks)
    ending = "idle"
    try:
        if shape == "split":
            at = 0
            while at < len(data):
                step = rng.randrange(1, 64)
                writer.write(data[at : at + step])
                at += step
                if rng.random() < 0.05:
                    await writer.drain()
        else:
            writer.write(data)
        await writer.drain()
        received = 0
        while received < READ_BYTES_MAX:  # bounded by the byte cap
            try:
                chunk = await asyncio.wait_for(reader.read(65536), IDLE_S)
            except TimeoutError:
                break
            if not chunk:
                ending = "closed"
                break
            received += len(chunk)
            answers.feed(chunk)  # what the node sends must itself be well-formed
            replies += len(answers.frames())
    except (ConnectionError, OSError):
        ending = "reset"
    except BaseException:
        # Cancelled by the caller's deadline: the node may have stopped reading from us (we
        # never read its replies or stream), so a graceful close would wait on it forever.
        writer.transport.abort()
        raise
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()
    return sent, replies, shape + ":" + ending


async def with_stacks_on_deadline(scenario: Coroutine[Any, Any, None], deadline_s: float) -> None:
    """Run ``scenario``; past ``deadline_s`` print where every task waits, then fail (a hang
    reported only as pytest-timeout's main-thread stack says nothing about which await)."""
    task = asyncio.ensure_future(scenario)
    done, _ = await asyncio.wait([task], timeout=deadline_s)
    if not done:
        for other in asyncio.all_tasks():
            if other is not asyncio.current_task():
                other.print_stack(limit=8)
        task.cancel()
        raise AssertionError(f"the fuzz scenario did not finish in {deadline_s:.0f} s")
    task.result()


def run_fuzz(
    nodes: NodeFactory,
    rng: random.Random,
    frames_total: int,
    deadline_s: float = SCENARIO_DEADLINE_S,
) -> None:
    node = nodes(vbuckets=8)

    async def scenario() -> None:
        async with await kv_connect(node) as kv:  # some data for streams and GETs to find
            await kv.upsert_many([(b"k%d" % i, b"v" * 50) for i in range(2000)])
            await kv.upsert(b"k", b"v")
            # The probe's own key: the fuzzer writes, expires and deletes b"k" and random keys
            # with the credentials it has, so a GET of those may rightly find nothing.
            await kv.upsert(PROBE_KEY, b"v")
        baseline = node.rss_bytes()
        maker = FrameMaker(rng)
        outcomes: dict[str, int] = {}
        sent_total = replies_total = 0

        async def worker(plan: list[int]) -> None:
            # A fixed set of workers bounds the connections open at once.
            nonlocal sent_total, replies_total
            while plan:
                frames = plan.pop()
                sent, replies, outcome = await asyncio.wait_for(
                    one_connection(node, rng, maker, frames), 60
                )
                sent_total += sent
                replies_total += replies
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

        probe_kv = await kv_connect(node)
        latencies: list[float] = []

        fuzzing = True

        async def probe() -> None:  # the node must keep answering others while it is fuzzed
            # Stopped by a flag, not cancel(): on CPython 3.11 a cancel that lands as a reply
            # completes asyncio.wait_for is lost, and this loop then never ended.
            while fuzzing:
                began = time.monotonic()
                await probe_kv.get(PROBE_KEY)
                latencies.append(time.monotonic() - began)
                await asyncio.sleep(0.01)

        prober = asyncio.get_running_loop().create_task(probe())
        started = time.monotonic()
        plan: list[int] = []
        while sum(plan) < frames_total:
            plan.append(rng.choice([1, 5, 20, 50, 100, 200]))
        connections = len(plan)
        await asyncio.gather(*(worker(plan) for _ in range(CONNECTIONS_AT_ONCE)))
        elapsed = time.monotonic() - started
        fuzzing = False
        await prober
        await probe_kv.close()
        after = node.rss_bytes()
        print(
            f"{sent_total} frames on {connections} connections in {elapsed:.1f} s, "
            f"{replies_total} frames back; "
            f"RSS {baseline >> 20} -> {after >> 20} MiB; slowest GET meanwhile "
            f"{max(latencies, default=0) * 1000:.0f} ms; endings {sorted(outcomes.items())}"
        )
        assert sent_total >= frames_total
        assert node.alive, node.log_tail()
        assert after - baseline < 100 * 1024 * 1024, (baseline, after)

        # Ordinary clients still work: KV and a full DCP stream.
        async with await kv_connect(node) as kv:
            await kv.upsert(b"after-fuzz", b"ok")
            assert (await kv.get(b"after-fuzz")).value == b"ok"
        truth = await server_state(node)
        assert truth.values()[b"after-fuzz"] == b"ok"

    asyncio.run(with_stacks_on_deadline(scenario(), deadline_s))
    assert node.alive
    errors = node.errors_in_log()
    assert errors == [], "\n".join(errors[:20]) + "\n" + node.log_tail(80)


def test_fuzz_frames(nodes: NodeFactory, rng: random.Random) -> None:
    run_fuzz(nodes, rng, 20_000)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fuzz_frames_long(nodes: NodeFactory, rng: random.Random) -> None:
    run_fuzz(nodes, rng, 200_000, deadline_s=1700.0)


def test_unauthenticated_peers_cannot_pin_memory(nodes: NodeFactory) -> None:
    """Before authenticating, a peer may not make the node buffer a large frame: 16 sockets each
    sending a 20 MiB GET must not move the RSS much, while authenticated clients (SCRAM and
    PLAIN) still store large values."""
    node = nodes(vbuckets=4)
    body = b"k" + bytes(limits.FRAME_SIZE_MAX - 1024)

    async def big_unauthenticated() -> str:
        reader, writer = await asyncio.open_connection(HOST, node.port)
        try:
            writer.write(frame(Opcode.GET, key=b"k", value=body[1:]))
            await writer.drain()
            return "closed" if not await asyncio.wait_for(reader.read(100), 20) else "answered"
        except (ConnectionError, OSError):
            return "reset"
        finally:
            writer.close()

    async def scenario() -> None:
        baseline = node.rss_bytes()
        async with rss_sampler(node, 0.01) as samples:
            endings = await asyncio.gather(*(big_unauthenticated() for _ in range(16)))
        peak = max(samples, default=baseline)
        print(f"endings {endings}; RSS {baseline >> 20} -> peak {peak >> 20} MiB")
        assert "answered" not in endings
        assert peak - baseline < 64 * 1024 * 1024, (baseline, peak)
        big = bytes(range(256)) * (5 * 4096)  # 5 MiB
        async with await kv_connect(node) as kv:  # SCRAM
            await kv.upsert(b"big", big)
            assert (await kv.get(b"big")).value == big
        conn = await raw_connection(node, auth=False)  # PLAIN, then a 5 MiB SET
        try:
            opaque = conn.next_opaque()
            plain = frame(Opcode.SASL_AUTH, key=b"PLAIN", value=encode_plain("Administrator",
                          "password"), opaque=opaque)  # fmt: skip
            assert (await conn.request(plain, opaque)).status == 0
            await select_bucket(conn, "default")
            opaque = conn.next_opaque()
            vb = vbucket_for_key(b"big2", 4)
            store = frame(Opcode.SET, key=b"big2", extras=bytes(8), value=big, vbucket=vb,
                          opaque=opaque)  # fmt: skip
            assert (await conn.request(store, opaque)).status == 0
        finally:
            await conn.close()

    asyncio.run(scenario())
    assert node.alive
    assert node.errors_in_log() == []
