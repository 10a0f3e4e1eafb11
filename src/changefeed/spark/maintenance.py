"""Table upkeep inside a running mirror job: tombstone purge and compaction between batches.

``changefeed mirror purge`` and ``changefeed mirror compact`` are refused while a job holds the
tables, so a job that never stops would keep every tombstone and every small file. The
distributed writer calls ``TableMaintenance.after_batch`` once a batch's mirror commit is done;
when due, it runs

- the purge (``purge.py``) every ``mirrorPurgeIntervalS`` seconds (default
  ``PURGE_INTERVAL_S``; 0: after every batch; negative: never): the store's purge points (every
  copy of every vbucket), capped by the positions the mirror has committed, so a tombstone goes
  only once the store itself no longer has it. No rollback re-read needs it: a rollback to a
  seqno below a copy's purge seqno is a rollback to 0 (dcp-wire.md §9.1.2, rule 2), which
  rebuilds the vbucket from the node's full stream; a rollback above the limit voids only rows
  above it, which stay;
- the compaction (``compaction.py``) every ``mirrorCompactIntervalS`` seconds (default
  ``COMPACT_INTERVAL_S``; same conventions), with ``mirrorCompactFilesMin`` and
  ``mirrorCompactSmallBytes``.

Exactly once is untouched: both run in the driver between batches (nothing of the next batch is
planned yet: it reads the tables' versions after these commits), under the lease the job holds,
and their commits carry no batch id. A step that fails (a node not answering, an unreadable
file, a commit conflict) commits nothing, is logged in one line, recorded in ``Upkeep.errors``
and tried again at its next interval; the job goes on. ``last`` tells what ran last
(the tests and the progress line look).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from changefeed.spark.compaction import CompactionError, CompactReport, compact_held, settings_of

log = logging.getLogger("changefeed.mirror")

PURGE_INTERVAL_S: Final = 600.0
# Compaction costs ~1 ms per small file merged (3,200 files of 50 rows: 3.25 s), so a minute of
# a job writing a batch a second into 16 groups (960 files) delays one batch by ~1 s.
COMPACT_INTERVAL_S: Final = 60.0
OPTION_PURGE: Final = "mirrorPurgeIntervalS"
OPTION_COMPACT: Final = "mirrorCompactIntervalS"


class MaintenanceError(ValueError):
    """A maintenance option with a bad value; the message names it."""


@dataclass
class Upkeep:
    """What the last ``after_batch`` ran (empty when nothing was due)."""

    purged: int | None = None  # tombstones removed (None: the purge did not run)
    compacted: CompactReport | None = None
    errors: list[str] = field(default_factory=list)  # "step: ErrorType: message", one a failure


def interval(options: Mapping[str, str], name: str, default: float) -> float | None:
    """Seconds between runs from option ``name`` (None: never).

    Raises:
        MaintenanceError: not a number, naming the option and the value.
    """
    lowered = {k.lower(): v for k, v in options.items()}
    text = lowered.get(name.lower())
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise MaintenanceError(f"option {name}: {text!r} is not a number of seconds") from None
    if value != value:  # NaN
        raise MaintenanceError(f"option {name}: {text!r} is not a number of seconds")
    return None if value < 0 else value


class TableMaintenance:
    """Purge and compaction of one job's tables, each at its interval (module docstring).

    Args:
        tables: the tables' root (a directory or ``s3://`` URL).
        options: the source's options (the nodes to ask for purge points) and the writer's.
        storage_options: deltalake storage options.
        clock: seconds, monotonic (the tests may pass their own).
    """

    def __init__(
        self,
        tables: str,
        options: Mapping[str, str],
        storage_options: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tables = tables
        self.options = dict(options)
        self.storage_options = storage_options
        self.clock = clock
        self.purge_every = interval(options, OPTION_PURGE, PURGE_INTERVAL_S)
        self.compact_every = interval(options, OPTION_COMPACT, COMPACT_INTERVAL_S)
        try:
            self.compact_settings = settings_of(options)
        except CompactionError as error:
            raise MaintenanceError(str(error)) from None
        started = clock()
        self._purged_at = started
        self._compacted_at = started
        self.last = Upkeep()

    def after_batch(self) -> Upkeep:
        """Run what is due; called by the job between batches, holding the tables' lease.

        Never raises: a step that fails (a node not answering, an unreadable file, a Delta
        commit conflict) commits nothing, is logged in one line and recorded in
        ``Upkeep.errors``, and is tried again at its next interval; the batch has committed
        already and the job goes on.
        """
        now = self.clock()
        self.last = Upkeep()
        if self.purge_every is not None and now - self._purged_at >= self.purge_every:
            self._purged_at = now
            self._guarded("purge", self.purge_every, self._purge)
        if self.compact_every is not None and now - self._compacted_at >= self.compact_every:
            self._compacted_at = now
            self._guarded("compaction", self.compact_every, self._compact)
        return self.last

    def _guarded(self, step: str, every: float, run: Callable[[], None]) -> None:
        """``run``, with any failure logged and recorded instead of raised: upkeep is
        optional work, and an exception here would end the query after its batch committed."""
        try:
            run()
        except Exception as error:  # any failure: the next interval retries
            self.last.errors.append(f"{step}: {type(error).__name__}: {error}")
            log.warning("%s skipped, tried again in %s s: %s: %s", step, every,
                        type(error).__name__, error)  # fmt: skip

    def _compact(self) -> None:
        self.last.compacted = compact_held(self.tables, self.storage_options,
                                           **self.compact_settings)  # fmt: skip

    def _purge(self) -> None:
        from changefeed.spark.options import SourceOptions
        from changefeed.spark.purge import purge

        # A purge that fails (the store's purge points unknown now) keeps every tombstone.
        report = purge(
            self.tables, SourceOptions.parse(self.options), self.storage_options,
            lease_held=True,
        )  # fmt: skip
        self.last.purged = report.removed
        if report.removed:
            log.info("purged %d tombstones the store no longer keeps", report.removed)
