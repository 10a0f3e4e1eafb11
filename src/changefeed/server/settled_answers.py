"""A connection's durable writes answered in the order their outcomes settle.

The monitor (sync_writes.py) settles a durable write once: the commit's result, or
SYNC_WRITE_AMBIGUOUS. A flush round or a replica's ack settles many at once; each outcome is
appended here, and at the end of that loop step they go out in the order they settled — a
stretch of SET successes of durable runs (durable_run.py) packed into one buffer
(`pack_set_successes`), any other answer built as `kv_commands.reply_mutation` builds it
(same bytes either way). One list per connection, so the answers of runs and of single
durable writes keep one order: each vbucket's in seqno order (its commits' order). No
future and no callback per write. An answer holds only what its reply is built from (opaque,
vbucket, opcode; a counter's value), never the request's key or value: a write answered early
must not keep its request's bytes alive until the slowest write's timeout.

Not here: deciding outcomes (sync_writes.py), applying writes (durable_run.py, kv_commands.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from functools import partial
from itertools import repeat
from typing import Final, Protocol

from changefeed.protocol.errors import ProtocolError, StatusError
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.kv import MutationResult, encode_mutation_token
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.set_run import pack_set_successes

Outcome = MutationResult | StatusError
Answer = Callable[[Outcome], None]
_ALT_REQUEST: Final = int(Magic.ALT_REQUEST)
_SET: Final = int(Opcode.SET)
_MUTATION_SEQNO: Final = Feature.MUTATION_SEQNO


def durable_set_request(vbucket: int, opaque: int) -> Frame:
    """A durable SET's request as far as a reply needs it (header only: no key, no value)."""
    return Frame(_ALT_REQUEST, _SET, vbucket=vbucket, opaque=opaque)


class AnsweringConnection(Protocol):
    """What answering needs of a connection (`ClientConnection` has it)."""

    features: set[int]

    @property
    def closing(self) -> bool:
        """No reply can be sent any more."""
        ...

    def send(self, data: bytes) -> None: ...

    def reply_error(self, request: Frame, error: ProtocolError | StatusError) -> None: ...

    def answered(self, count: int) -> None:
        """`count` requests counted as answered later were answered (their replies sent)."""
        ...


class SettledAnswers:
    """Outcomes settled and not yet sent, in the order they settled (module docstring)."""

    __slots__ = ("_connection", "_scheduled", "_settled")

    def __init__(self, connection: AnsweringConnection) -> None:
        self._connection = connection
        # (None, opaque, vbucket, outcome, b"") of a run's write, or (its request's header,
        # 0, 0, outcome, value) of a single durable write
        self._settled: list[tuple[Frame | None, int, int, Outcome, bytes]] = []
        self._scheduled = False

    def run_answers(self, opaques: Sequence[int], vbuckets: Sequence[int]) -> list[Answer]:
        """The answers of a durable run's writes (write i: `opaques[i]` on `vbuckets[i]`)."""
        run_write = self._run_write
        return list(map(partial, repeat(run_write), opaques, vbuckets))

    def frame_answer(self, request: Frame, value: bytes = b"") -> Answer:
        """The answer of the single durable write `request`; a success answers `value` too
        (a counter's). Only `request`'s header is kept."""
        header = Frame(request.magic, request.opcode, vbucket=request.vbucket,
                       opaque=request.opaque)  # fmt: skip
        return partial(self._frame_write, header, value)

    def _run_write(self, opaque: int, vbucket: int, outcome: Outcome) -> None:
        self._add((None, opaque, vbucket, outcome, b""))

    def _frame_write(self, header: Frame, value: bytes, outcome: Outcome) -> None:
        self._add((header, 0, 0, outcome, value))

    def _add(self, entry: tuple[Frame | None, int, int, Outcome, bytes]) -> None:
        self._settled.append(entry)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        """Send the outcomes settled since the last call, in the order they settled. Each is
        counted answered here, when its reply is written, not when it settled: until then the
        connection owes it (`ClientConnection.idle_evictable`)."""
        self._scheduled = False
        settled, self._settled = self._settled, []
        c = self._connection
        c.answered(len(settled))
        if c.closing:
            return
        token = _MUTATION_SEQNO in c.features
        opaques: list[int] = []
        cases: list[int] = []
        vb_uuids: list[int] = []
        seqnos: list[int] = []

        def pack() -> None:
            if not opaques:
                return
            if token:
                c.send(pack_set_successes(opaques, cases, vb_uuids, seqnos))
            else:
                c.send(pack_set_successes(opaques, cases))
            opaques.clear()
            cases.clear()
            vb_uuids.clear()
            seqnos.clear()

        for request, opaque, vbucket, outcome, value in settled:  # bounded by the writes settled
            if request is None:  # a run's write
                if isinstance(outcome, MutationResult):
                    opaques.append(opaque)
                    cases.append(outcome.cas)
                    vb_uuids.append(outcome.vb_uuid)
                    seqnos.append(outcome.seqno)
                    continue
                request = durable_set_request(vbucket, opaque)
            pack()
            if isinstance(outcome, MutationResult):  # kv_commands.reply_mutation's bytes
                extras = encode_mutation_token(outcome.vb_uuid, outcome.seqno) if token else b""
                c.send(encode_response(request, extras=extras, value=value, cas=outcome.cas))
            else:
                c.reply_error(request, outcome)
        pack()
