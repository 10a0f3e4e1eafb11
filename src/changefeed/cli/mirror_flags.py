"""The writer's flags of ``changefeed mirror``, turned into the options ``MirrorWriter`` reads.

The mirror writer has options that were reachable only from code (``MirrorWriter(...,
storage_options=...)``, the source options ``mirrorWriter``, ``mirrorTasks``,
``mirrorGroups``); these flags give them to the command line, checked before Spark starts so
that a bad value is one line naming it:

- ``--writer distributed|local``: who writes the files (``spark/mirror.py``);
- ``--mirror-tasks N``: the distributed writer's tasks per micro-batch (default: Spark's default
  parallelism, at most the groups);
- ``--mirror-groups N``: vbucket groups (partitions of both tables), fixed when the tables are
  created (1..``GROUPS_MAX``);
- ``--driver-batch-max N``: the distributed writer writes a micro-batch planned at most N
  changes from the driver (``spark/dist_mirror.py``; 0: never);
- ``--storage-option KEY=VALUE``: deltalake storage options for ``s3://`` tables (repeatable).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import click

WRITERS = ("distributed", "local")
GROUPS_MAX = 1024  # as spark/dist_mirror.py's GROUPS_MAX (not imported: that pulls in deltalake)


@dataclass(frozen=True)
class WriterFlags:
    """What the flags ask of the writer (None: the writer's default)."""

    writer: str | None = None
    tasks: int | None = None
    groups: int | None = None
    storage_options: dict[str, str] = field(default_factory=dict)
    driver_batch_max: int | None = None

    def source_options(self) -> dict[str, str]:
        """The options ``MirrorWriter`` reads from the source's options."""
        out = {}
        if self.writer is not None:
            out["mirrorWriter"] = self.writer
        if self.tasks is not None:
            out["mirrorTasks"] = str(self.tasks)
        if self.groups is not None:
            out["mirrorGroups"] = str(self.groups)
        if self.driver_batch_max is not None:
            out["mirrorDriverBatchMax"] = str(self.driver_batch_max)
        return out


def writer_flags(
    writer: str | None,
    tasks: int | None,
    groups: int | None,
    storage_pairs: tuple[str, ...],
    tables: str,
    driver_batch_max: int | None = None,
) -> WriterFlags:
    """Check the writer's flags together.

    Raises:
        click.BadParameter: a flag that does not fit the others or the tables, naming it.
    """
    if writer == "local":
        for flag, value in (("--mirror-tasks", tasks), ("--mirror-groups", groups),
                            ("--driver-batch-max", driver_batch_max)):  # fmt: skip
            if value is not None:
                raise click.BadParameter(
                    f"{value} applies to the distributed writer only, not --writer local",
                    param_hint=flag,
                )
        if is_url(tables):
            raise click.BadParameter(
                f"the local writer writes local paths only, not {tables}", param_hint="--writer"
            )
    storage = storage_options(storage_pairs)
    if storage and not is_url(tables):
        raise click.BadParameter(
            f"{', '.join(sorted(storage))} given, but --tables {tables} is a local directory "
            "(storage options are for s3:// tables)",
            param_hint="--storage-option",
        )
    return WriterFlags(writer, tasks, groups, storage, driver_batch_max)


def key_values(pairs: tuple[str, ...], flag: str) -> dict[str, str]:
    """A repeatable ``flag KEY=VALUE`` option's pairs as a dict (a bad one is a usage error
    naming it and the flag)."""
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint=flag)
        out[key.strip()] = value
    return out


def storage_options(pairs: tuple[str, ...]) -> dict[str, str]:
    """``--storage-option KEY=VALUE`` pairs as a dict (a bad one is a usage error naming it)."""
    return key_values(pairs, "--storage-option")


def mended(tables: str) -> str:
    """``tables`` as the user wrote it: a URL that went through ``pathlib.Path`` (``s3:/b/p``)
    gets its second slash back."""
    scheme, _, rest = tables.partition(":")
    if is_url(tables) and not rest.startswith("//"):
        return f"{scheme}:/{rest}"
    return tables


def is_url(tables: str) -> bool:
    """``tables`` names an object store (``s3://b/p``; also ``s3:/b/p``, a URL that went
    through ``pathlib.Path`` and lost a slash)."""
    scheme, colon, rest = tables.partition(":")
    return bool(colon) and len(scheme) > 1 and scheme.isalnum() and rest.startswith("/")
