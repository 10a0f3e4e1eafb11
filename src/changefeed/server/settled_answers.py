"""A connection's durable writes answered in the order their outcomes settle.

The monitor (sync_writes.py) settles a durable write once: the commit's result, or
SYNC_WRITE_AMBIGUOUS. A flush round or a replica's ack settles many at once; each outcome is
appended here, and at the end of that loop step they go out in the order they settled — a
stretch of SET successes of durable runs (durable_run.py) packed into one buffer
(`pack_set_successes`), any other answer built as `kv_commands.reply_mutation` builds it
(same bytes either way). One list per connection, so the answers of runs and of single
durable writes keep one order: each vbucket's in seqno order (its commits' order). No
future and no callback per write.

Not here: deciding outcomes (sync_writes.py), applying writes (durable_run.py, kv_commands.py).
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

from changefeed.protocol.errors import ProtocolError, StatusError
from changefeed.protocol.frame import Frame, encode_response
from changefeed.protocol.kv import MutationResult, encode_mutation_token
from changefeed.protocol.opcode import Feature, Magic, Opcode
from changefeed.protocol.set_run import SetRun, pack_set_successes

Outcome = MutationResult | StatusError
_ALT_REQUEST: Final = int(Magic.ALT_REQUEST)
_SET: Final = int(Opcode.SET)
_MUTATION_SEQNO: Final = Feature.MUTATION_SEQNO


class AnsweringConnection(Protocol):
    """What answering needs of a connection (`ClientConnection` has it)."""

    features: set[int]

    @property
    def closing(self) -> bool:
        """No reply can be sent any more."""
        ...

    def send(self, data: bytes) -> None: ...

    def reply_error(self, request: Frame, error: ProtocolError | StatusError) -> None: ...

    def answered(self) -> None:
        """One request counted as answered later was answered."""
        ...


class SettledAnswers:
    """Outcomes settled and not yet sent, in the order they settled (module docstring)."""

    __slots__ = ("_connection", "_scheduled", "_settled")

    def __init__(self, connection: AnsweringConnection) -> None:
        self._connection = connection
        # (run, index in it, outcome, b"") of a run's write, or (None, frame, outcome, value)
        self._settled: list[tuple[SetRun | None, int | Frame, Outcome, bytes]] = []
        self._scheduled = False

    def run_write(self, run: SetRun, index: int, outcome: Outcome) -> None:
        """Write `index` of the durable `run` settled."""
        self._add((run, index, outcome, b""))

    def frame_write(self, request: Frame, value: bytes, outcome: Outcome) -> None:
        """The durable write `request` settled; a success answers `value` too (a counter's)."""
        self._add((None, request, outcome, value))

    def _add(self, entry: tuple[SetRun | None, int | Frame, Outcome, bytes]) -> None:
        self._connection.answered()
        self._settled.append(entry)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._send)

    def _send(self) -> None:
        """Send the outcomes settled since the last call, in the order they settled."""
        self._scheduled = False
        settled, self._settled = self._settled, []
        c = self._connection
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

        for run, at, outcome, value in settled:  # bounded by the writes settled
            if run is not None:
                assert isinstance(at, int), at
                if isinstance(outcome, MutationResult):
                    opaques.append(run.opaques[at])
                    cases.append(outcome.cas)
                    vb_uuids.append(outcome.vb_uuid)
                    seqnos.append(outcome.seqno)
                    continue
                request = Frame(_ALT_REQUEST, _SET, vbucket=run.vbuckets[at],
                                opaque=run.opaques[at])  # fmt: skip
            else:
                assert isinstance(at, Frame), at
                request = at
            pack()
            if isinstance(outcome, MutationResult):  # kv_commands.reply_mutation's bytes
                extras = encode_mutation_token(outcome.vb_uuid, outcome.seqno) if token else b""
                c.send(encode_response(request, extras=extras, value=value, cas=outcome.cas))
            else:
                c.reply_error(request, outcome)
        pack()
