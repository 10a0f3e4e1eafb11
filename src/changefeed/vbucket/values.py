"""What a vbucket hands out and takes in, and the field limits every role checks.

Values only (no vbucket state): the core and each role import them, none imports a role.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Final, NamedTuple

from changefeed import limits
from changefeed.checkpoint import Item
from changefeed.protocol.errors import InvalidArgumentsError, StatusError
from changefeed.protocol.kv import MutationResult
from changefeed.storage import Op, Record
from changefeed.storage.record import DELETION_EXTRAS_SIZE, MUTATION_EXTRAS_SIZE

# A run of SETs as `set_many` takes it: keys, values, flags, expiries, datatypes.
SetColumns = tuple[Sequence[bytes], Sequence[bytes], Sequence[int], Sequence[int], Sequence[int]]
NS_PER_S: Final = 1_000_000_000
U32_MAX: Final = 0xFFFF_FFFF
DATATYPE_MASK: Final = 0x07  # dcp-wire.md §1.4: JSON | Snappy | XATTR
U64_MAX: Final = limits.SEQNO_MAX  # CAS is a u64 like a seqno
KEY_SIZE_MAX: Final = limits.STORED_KEY_SIZE_MAX
VALUE_SIZE_MAX: Final = limits.VALUE_SIZE_MAX
EXTRAS_SIZE: Final = {
    Op.MUTATION: MUTATION_EXTRAS_SIZE,
    Op.DELETION: DELETION_EXTRAS_SIZE,
    Op.EXPIRATION: DELETION_EXTRAS_SIZE,
}  # an item body's extras, by op (checkpoint/item.py)


class RunLookup(NamedTuple):
    """What a run of writes to one vbucket finds before it applies: the newest version of
    each write's key in memory (`VBucket.lookup_memory`), and the stored version, or None, of
    every key memory had none of."""

    in_memory: list[Item | None]
    stored: Mapping[bytes, Record | None]


class ReplicatedColumns(NamedTuple):
    """A run of mutations replicated to one vbucket, as columns: slices of the columns a
    received batch decoded to (`protocol.batch.ChangeColumns`), seqnos rising. `bodies` are
    the frames' bodies, extras | key | value: the layout the checkpoint and the store keep, so
    each is taken as is (`Item.of_body`), never encoded again."""

    seqnos: Sequence[int]
    keys: Sequence[bytes]
    bodies: Sequence[bytes]
    cases: Sequence[int]
    flags: Sequence[int]
    expiries: Sequence[int]
    datatypes: Sequence[int]
    rev_seqnos: Sequence[int]


class SetManyResult(NamedTuple):
    """`VBucket.set_many`'s answers as columns (no object per write): write i got
    `seqnos[i]` and `cases[i]` on `vb_uuid`, unless `errors` holds i: that write took no
    seqno or CAS, and `seqnos[i]`/`cases[i]` mean nothing (0, except on a run's clean path
    and one by one, where they are what the write would have taken)."""

    vb: int
    vb_uuid: int
    seqnos: Sequence[int]
    cases: Sequence[int]
    errors: dict[int, StatusError]

    def results(self) -> list[MutationResult | StatusError]:
        """One answer per write, as `set` gives them (tests and slow paths)."""
        return [
            self.errors[index]
            if index in self.errors
            else MutationResult(vbucket=self.vb, seqno=seqno, cas=cas, vb_uuid=self.vb_uuid)
            for index, (seqno, cas) in enumerate(zip(self.seqnos, self.cases, strict=True))
        ]


@dataclasses.dataclass(frozen=True, slots=True)
class Document:
    """The current version of a key as `get` returns it (never a tombstone)."""

    key: bytes
    value: bytes
    cas: int
    flags: int
    expiry: int
    datatype: int
    seqno: int
    rev_seqno: int


def fields_in_range(writes: SetColumns) -> bool:
    """Every write's key, value, flags, expiry and datatype are within `set`'s limits (one
    C-level pass per column)."""
    keys, values, flags, expiries, datatypes = writes
    key_sizes = list(map(len, keys))
    return (
        min(key_sizes) > 0
        and max(key_sizes) <= KEY_SIZE_MAX
        and max(map(len, values)) <= VALUE_SIZE_MAX
        and min(flags) >= 0
        and max(flags) <= U32_MAX
        and min(expiries) >= 0
        and max(expiries) <= U32_MAX
        and min(datatypes) >= 0
        and max(datatypes) <= DATATYPE_MASK
    )


def write_in_range(key: bytes, value: bytes, flags: int, expiry: int, datatype: int) -> bool:
    """One write's `fields_in_range`, without building its columns (`0 <= datatype <= mask`
    is `check_fields`' "no bit above the mask": the mask is all low bits)."""
    return (
        0 < len(key) <= KEY_SIZE_MAX
        and len(value) <= VALUE_SIZE_MAX
        and 0 <= flags <= U32_MAX
        and 0 <= expiry <= U32_MAX
        and 0 <= datatype <= DATATYPE_MASK
    )


def check_fields(key: bytes, value: bytes, flags: int, expiry: int, datatype: int) -> None:
    """Raise InvalidArgumentsError for what the store would refuse at flush time (batch.py)."""
    if not 0 < len(key) <= limits.STORED_KEY_SIZE_MAX:
        raise InvalidArgumentsError(
            f"key length {len(key)} outside 1..{limits.STORED_KEY_SIZE_MAX}"
        )
    if len(value) > limits.VALUE_SIZE_MAX:
        raise InvalidArgumentsError(f"value of {len(value)} bytes over {limits.VALUE_SIZE_MAX}")
    if not (0 <= flags <= U32_MAX and 0 <= expiry <= U32_MAX):
        raise InvalidArgumentsError(f"flags {flags} or expiry {expiry} is not a u32")
    if datatype & ~DATATYPE_MASK or datatype < 0:
        raise InvalidArgumentsError(f"datatype {datatype:#x} has bits above {DATATYPE_MASK:#x}")
