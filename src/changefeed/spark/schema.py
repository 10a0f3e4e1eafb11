"""The change-row schema shared by the streaming and batch sources (ARCHITECTURE.md, spark/).

Arrow batches returned to Spark must match ``to_arrow_schema`` exactly: ``string``/``binary``
(not the large variants), ``int32`` for ``int`` (spark-python-datasource.md, gotcha 6).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_DDL = (
    "vbucket int, seqno long, key string, value binary, op string, cas long, expiry int, "
    "flags int, rev_seqno long, snap_start long, snap_end long"
)

ARROW_SCHEMA = pa.schema(
    [
        ("vbucket", pa.int32()),
        ("seqno", pa.int64()),
        ("key", pa.string()),
        ("value", pa.binary()),
        ("op", pa.string()),
        ("cas", pa.int64()),
        ("expiry", pa.int32()),
        ("flags", pa.int32()),
        ("rev_seqno", pa.int64()),
        ("snap_start", pa.int64()),
        ("snap_end", pa.int64()),
    ]
)

OP_MUTATION = "mutation"
OP_DELETION = "deletion"
OP_EXPIRATION = "expiration"
OP_ROLLBACK = "rollback"
OP_BY_OPCODE = {0x57: OP_MUTATION, 0x58: OP_DELETION, 0x59: OP_EXPIRATION}

# CAS values are u64; Spark's long is signed. CAS from our nodes fit in 63 bits (hybrid clock in
# nanoseconds), so they pass unchanged; a larger one would wrap, which we refuse to do silently.
INT64_MAX = 2**63 - 1
