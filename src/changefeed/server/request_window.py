"""A window of pipelined plain SETs, GETs and DELETEs, planned so its SETs go through the
batched path in a few runs instead of one run per gap between other requests. No I/O.

A client that mixes GETs and DELETEs into its SETs (an application's working set, the
Couchbase SDKs' mixed batches) used to cut the received buffer into runs of a few SETs each,
and a run costs the node a fixed amount per call and per vbucket it touches (one store read
transaction, one checkpoint step per vbucket): a mix of 2 SETs : 1 GET : 1 DELETE cost ~4x a
pure SET pipeline per request. Requests on different vbuckets do not see each other (each
vbucket has its own seqnos and keys), so only each vbucket's own order must hold:

* a DELETE is a write: on its vbucket it comes after the SETs before it and before the SETs
  after it. SET number i of a vbucket goes in *layer* d, the number of DELETEs on that vbucket
  before it; the window applies layer 0's SETs of every vbucket as one run, then the DELETEs
  that end layer 0 on their vbuckets, then layer 1's SETs, and so on. The number of runs is
  one more than the most DELETEs any one vbucket has in the window, not the number of gaps;
* a GET is answered after every write of the window, in its place among the replies: it sees
  what it would have seen in order as long as no later write of the window touches its key,
  so a write to a key an earlier GET of the window read ends the window before that write
  (`add_run` returns the rest, `joins` refuses the DELETE; both start the next window). A GET
  that may find its document expired (it then queues the expiration, a write) is applied as
  a write instead, in its layer (`layers(barriers)`), so the expiration's seqno and CAS fall
  where one request at a time puts them.

Replies still go out in request order (the connection holds the window's SET and DELETE
replies until each one's turn). Anything but a classic-magic GET or DELETE (a CAS SET, a
framing extra, a durability level, any other opcode) is not part of a window: the connection
applies the window and then dispatches it alone, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Final

from changefeed.protocol.frame import Frame
from changefeed.protocol.opcode import Magic, Opcode
from changefeed.protocol.set_run import SetRun

# GETs one window may answer: their replies (up to VALUE_SIZE_MAX each) are written at the end
# of the window, and the connection stops at the first that backs its replies up (the rest wait
# for resume_writing), so this bounds only the work of one step.
GETS_PER_WINDOW_MAX: Final = 256
_GET: Final = int(Opcode.GET)
_DELETE: Final = int(Opcode.DELETE)
_CLASSIC: Final = int(Magic.REQUEST)


@dataclass(slots=True)
class Layer:
    """Writes of a window applied together: `sets` (indexes into the window's run) as one run,
    then `deletes` (indexes into the window's frames) one by one, in request order."""

    sets: list[int] = field(default_factory=list)
    deletes: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestWindow:
    """Requests in arrival order: SETs as columns (`run`), GETs and DELETEs as frames.
    `order` lists them as they arrived: `i >= 0` is SET `i` of `run`, `~j` frame `j`."""

    run: SetRun = field(default_factory=SetRun)
    frames: list[Frame] = field(default_factory=list)
    order: list[int] = field(default_factory=list)
    _reads: set[tuple[int, bytes]] = field(default_factory=set)  # (vbucket, key) of the GETs
    _keys: dict[int, list[bytes]] = field(default_factory=dict)  # GETs' and DELETEs' by vbucket
    _frame_keys: list[bytes] = field(default_factory=list)  # each frame's key as stored
    _gets: int = 0
    # The collections manifest its SETs' keys were qualified under, once it waits behind held
    # replies (a collections connection's; None otherwise): when it runs, a collection may
    # have been dropped meanwhile.
    manifest_uid: int | None = None

    def __len__(self) -> int:
        return len(self.order)

    @property
    def gets(self) -> int:
        return self._gets

    @property
    def only_sets(self) -> bool:
        return not self.frames

    def add_run(self, run: SetRun) -> SetRun | None:
        """Take `run`'s SETs up to the first that writes a key an earlier GET of this window
        read; return the SETs from that one on (the next window's), or None."""
        cut = len(run)
        reads = self._reads
        if reads:
            for index, read in enumerate(zip(run.vbuckets, run.keys, strict=True)):
                if read in reads:
                    cut = index
                    break
        rest = None
        if cut < len(run):
            rest = run.select(range(cut, len(run)))
            run = run.select(range(cut))
        first = len(self.run)
        if first == 0 and not self.frames:
            self.run = run
        else:
            self.run.extend(run)
        self.order.extend(range(first, first + len(run)))
        return rest

    def joins(self, frame: Frame, key: bytes) -> bool:
        """Whether `frame` may join: a classic-magic GET (while the window has room for GETs) or
        DELETE of a key no earlier GET of the window read. `key` is the frame's key as stored
        (a collections connection's qualified key, `window_key`)."""
        if frame.magic != _CLASSIC:
            return False
        if frame.opcode == _GET:
            return self._gets < GETS_PER_WINDOW_MAX
        return frame.opcode == _DELETE and (frame.vbucket, key) not in self._reads

    def add_frame(self, frame: Frame, key: bytes) -> None:
        """Add a GET or DELETE that `joins`; the frame is kept as sent (its handler decodes its
        key again when it runs), `key` (as stored) marks what a GET read."""
        assert self.joins(frame, key), frame
        if frame.opcode == _GET:
            self._reads.add((frame.vbucket, key))
            self._gets += 1
        keys = self._keys.get(frame.vbucket)
        if keys is None:
            self._keys[frame.vbucket] = [key]
        else:
            keys.append(key)
        self.order.append(~len(self.frames))
        self.frames.append(frame)
        self._frame_keys.append(key)

    @property
    def frame_keys(self) -> dict[int, list[bytes]]:
        """The keys as stored of the window's GETs and DELETEs, by vbucket (what the window
        reads beyond its SETs: `Bucket.stored_read_ahead` looks them up in one transaction)."""
        return self._keys

    def frame_key(self, index: int) -> bytes:
        """Frame `index`'s key as stored."""
        return self._frame_keys[index]

    def layers(self, barriers: Collection[int] = (), *, in_order: bool = False) -> list[Layer]:
        """The window's writes in the order to apply them (see the module docstring).
        `barriers`: GETs (frame indexes) to apply as writes, in a layer's `deletes` in their
        place: a GET of an expired document queues its expiration, a write whose seqno and
        CAS must come between the writes before and after it on its vbucket. `in_order`: one
        write per layer, in request order across vbuckets too (memory may run short: which
        write is refused TMPFAIL, and when recovery runs, depends on that order)."""
        deletes_seen: dict[int, int] = {}  # vbucket -> DELETEs of the window on it so far
        layers = [Layer()]
        vbuckets = self.run.vbuckets
        frames = self.frames
        for op in self.order:
            if in_order:
                if op >= 0:
                    layers.append(Layer(sets=[op]))
                elif frames[~op].opcode == _DELETE or ~op in barriers:
                    layers.append(Layer(deletes=[~op]))
                continue
            if op >= 0:
                layer = deletes_seen.get(vbuckets[op], 0)
                layers[layer].sets.append(op)
                continue
            frame = frames[~op]
            if frame.opcode != _DELETE and ~op not in barriers:
                continue  # a GET: answered after every write
            layer = deletes_seen.get(frame.vbucket, 0)
            layers[layer].deletes.append(~op)
            deletes_seen[frame.vbucket] = layer + 1
            if layer + 1 == len(layers):
                layers.append(Layer())
        return layers


@dataclass(slots=True)
class WindowCounters:
    """What the node's connections put through windows, for STAT ``kv_window`` (`__call__`
    is the stat provider): windows applied and the SETs, GETs and DELETEs they held."""

    windows: int = 0
    sets: int = 0
    gets: int = 0
    deletes: int = 0

    def count(self, window: RequestWindow) -> None:
        self.windows += 1
        self.sets += len(window.run)
        self.gets += window.gets
        self.deletes += len(window.frames) - window.gets

    def __call__(self) -> Iterable[tuple[str, str]]:
        yield "kv_window_windows", str(self.windows)
        yield "kv_window_sets", str(self.sets)
        yield "kv_window_gets", str(self.gets)
        yield "kv_window_deletes", str(self.deletes)


StatProviders = MutableMapping[str, Callable[[], Iterable[tuple[str, str]]]]


def window_counters(providers: StatProviders) -> WindowCounters:
    """The node's `WindowCounters`, registered as STAT group ``kv_window`` in `providers`
    (the node's ``context.stat_providers``) by the first connection that asks."""
    counters = providers.get("kv_window")
    if isinstance(counters, WindowCounters):
        return counters
    counters = WindowCounters()
    providers["kv_window"] = counters
    return counters
