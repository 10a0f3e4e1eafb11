"""Every bound the system keeps, named once, with the arithmetic behind it.

Modules take their limits from here (or from a config value whose default is here) so that a
reader can see all the memory the process may hold in one page. The asserts at the bottom check
how the limits relate; they run at import.
"""

from __future__ import annotations

# Memcached binary protocol header: fixed 24 bytes (dcp-wire.md §1.1).
HEADER_SIZE = 24

# Largest document value we accept. Couchbase's item size limit is 20 MiB; we keep it.
VALUE_SIZE_MAX = 20 * 1024 * 1024

# Largest key: the memcached protocol allows 250 bytes (plus a LEB128 collection prefix).
KEY_SIZE_MAX = 250

# Largest frame body a peer may declare. A value plus key, extras and framing extras fits with
# room to spare; anything larger is rejected with E2BIG *before* we buffer it (STYLE.md §1).
FRAME_SIZE_MAX = VALUE_SIZE_MAX + 64 * 1024

# Failover log entries per vbucket (kv_engine max_failover_entries, dcp-wire.md §9.4).
FAILOVER_LOG_ENTRIES_MAX = 25

# vb_uuid is a random 64-bit value shifted right by 16: at most 48 bits, never 0 (dcp-wire.md §9.4).
VB_UUID_BITS = 48

# Number of vbuckets in a bucket: Couchbase's default 1024; tests use 4..64. vbucket ids are u16.
VBUCKETS_DEFAULT = 1024
VBUCKETS_MAX = 1024

# Seqnos are u64 on the wire; the "forever" end seqno is all ones.
SEQNO_MAX = 0xFFFF_FFFF_FFFF_FFFF

# Default LMDB map size: deliberately modest so users hit StorageFullError early and learn the
# knob (py-lmdb's habit); 1M 100-byte items take about 250 MiB with both indexes.
STORAGE_MAP_SIZE_BYTES_DEFAULT = 8 * 1024 * 1024 * 1024

# Bytes a disk backfill may hold queued for one stream before the disk cursor pauses (plus one
# item, so a maximal value still passes alone). kv_engine's dcp_backfill_byte_limit is 20 MiB per
# connection (dcp-wire.md §10); ours is per running backfill, and BACKFILLS_PER_CONNECTION_MAX of
# them make a connection's 16 MiB. 4 MiB is ~10k 100-byte items per refill.
BACKFILL_QUEUE_BYTES_MAX = 4 * 1024 * 1024

# Backfills one DCP connection may run at once; its other streams that need disk wait. With the
# queue bound above: 16 MiB per connection, however many streams it opens.
BACKFILLS_PER_CONNECTION_MAX = 4
BACKFILL_BYTES_PER_CONNECTION_MAX = BACKFILLS_PER_CONNECTION_MAX * BACKFILL_QUEUE_BYTES_MAX

# Backfills the whole node runs at once (over all connections): 64 MiB of queued records, and
# at most 16 LMDB read transactions held by scans (of STORAGE_READERS_MAX).
BACKFILLS_PER_NODE_MAX = 16

# Streams a single DCP connection may hold: one per vbucket is the common case.
STREAMS_PER_CONNECTION_MAX = VBUCKETS_MAX

assert HEADER_SIZE == 24
assert FRAME_SIZE_MAX > VALUE_SIZE_MAX + KEY_SIZE_MAX + 255 + 255, FRAME_SIZE_MAX
assert FRAME_SIZE_MAX < 2**32, FRAME_SIZE_MAX  # bodylen is a u32
assert 0 < FAILOVER_LOG_ENTRIES_MAX <= 25
assert VBUCKETS_MAX <= 2**16  # vbucket id is a u16 on the wire
assert BACKFILL_QUEUE_BYTES_MAX > 0  # a maximal item passes alone (BackfillQueue.push)
assert 0 < BACKFILLS_PER_CONNECTION_MAX <= BACKFILLS_PER_NODE_MAX

# --- storage/: one LMDB write transaction and its readers ------------------------------------

# Longest key the store accepts: a protocol key (KEY_SIZE_MAX) plus the collection id prefix,
# an unsigned LEB128 of a u32, which takes at most ceil(32 / 7) = 5 bytes (dcp-wire.md §7.3). The
# stored key length is a u16, and LMDB's default key limit is 511 bytes: 2 (vb) + 255 fits.
STORED_KEY_SIZE_MAX = KEY_SIZE_MAX + 5

# Stored record bytes one WriteBatch may hold before it must be committed. The batch is buffered
# in Python until commit, so this bounds that memory; it also keeps one LMDB write transaction
# below LMDB's dirty-page list (2**17 pages x 4 KiB = 512 MiB) with room for index pages. At
# 100-byte values a batch of 10k items is ~1.5 MiB, far below; 12 maximal 20 MiB values fit.
STORAGE_BATCH_BYTES_MAX = 256 * 1024 * 1024

# Concurrent LMDB read transactions (one per open scan, plus one per get while it runs). Each
# disk backfill holds one scan open; LMDB sizes its lock file at 64 bytes per slot, so 512 slots
# cost 32 KiB. Going over raises StorageError naming this limit instead of blocking.
STORAGE_READERS_MAX = 512

assert STORED_KEY_SIZE_MAX <= 511 - 2, STORED_KEY_SIZE_MAX  # LMDB key limit minus the vb prefix
assert STORAGE_BATCH_BYTES_MAX >= VALUE_SIZE_MAX + STORED_KEY_SIZE_MAX + 64  # one item always fits
assert STORAGE_BATCH_BYTES_MAX <= 2**17 * 4096 // 2, STORAGE_BATCH_BYTES_MAX
assert STORAGE_READERS_MAX >= 126, STORAGE_READERS_MAX  # never below LMDB's own default
assert BACKFILLS_PER_NODE_MAX < STORAGE_READERS_MAX // 4  # scans leave room for gets and commits

# --- checkpoint/: memory the mutation manager may hold, and how it is given back ------------

# Checkpoint memory one node may hold for a bucket. kv_engine gives checkpoints
# checkpoint_memory_ratio = 0.2 of the bucket quota (dcp-wire.md §10); for a 1 GiB bucket that is
# 1024 MiB / 5 = 204.8 MiB. At ~470 accounted bytes per 100-byte item (value + key + overhead,
# checkpoint/memory.py) that is ~450k queued items before writes see TMPFAIL.
CHECKPOINT_MEMORY_QUOTA_BYTES_DEFAULT = 1024 * 1024 * 1024 // 5

# Memory recovery starts above the upper mark and works down to the lower mark, both in percent
# of the quota (kv_engine checkpoint_memory_recovery_upper_mark 0.9 / lower_mark 0.6, §10). The
# 30-point gap means one recovery frees ~61 MiB of the default quota, so it runs rarely.
CHECKPOINT_MEMORY_UPPER_MARK_PERCENT = 90
CHECKPOINT_MEMORY_LOWER_MARK_PERCENT = 60

# Bytes one LMDB write transaction of the flusher may carry (accounted checkpoint bytes, so
# ~4 MiB / 470 B = ~9k 100-byte items per commit): big enough to amortize a commit's fsync
# (~1 ms) over thousands of items, small enough to stay 64x under STORAGE_BATCH_BYTES_MAX.
FLUSH_BATCH_BYTES_MAX = 4 * 1024 * 1024

# The open checkpoint is closed once it holds this many accounted bytes. kv_engine's auto size is
# quota / vbuckets / max_checkpoints (10), capped at the flush batch size (§10); for one vbucket
# that cap is what applies: 204.8 MiB / 1 / 10 = 20.5 MiB > 4 MiB. Smaller checkpoints let memory
# recovery free in 4 MiB steps instead of all-or-nothing.
CHECKPOINT_MAX_BYTES_DEFAULT = FLUSH_BATCH_BYTES_MAX

assert 0 < CHECKPOINT_MEMORY_LOWER_MARK_PERCENT < CHECKPOINT_MEMORY_UPPER_MARK_PERCENT <= 100
assert CHECKPOINT_MAX_BYTES_DEFAULT * 2 <= CHECKPOINT_MEMORY_QUOTA_BYTES_DEFAULT  # >= 2 checkpoints
# A flush batch always takes at least one item, so a maximal item (20 MiB) is a batch of its own;
# STORAGE_BATCH_BYTES_MAX holds it (asserted above).
assert FLUSH_BATCH_BYTES_MAX * 64 <= STORAGE_BATCH_BYTES_MAX, FLUSH_BATCH_BYTES_MAX

# --- producer/ and the DCP pump ---------------------------------------------------------------

# Events a stream takes from its reader in one call (markers and items): a run amortizes the
# reader's per-call cost; the stream buffers at most one run it could not send yet, so at 100-byte
# values a run holds ~64 x 470 B = ~30 KiB of items it already references (no copies).
STREAM_RUN_EVENTS_MAX = 64

# Bytes one stream may produce per round of the producer's round-robin before the next stream's
# turn: fairness between vbuckets against per-call overhead (~150 frames of 100-byte values).
STREAM_QUANTUM_BYTES = 64 * 1024

# Bytes the DCP pump writes to the transport per wake before it yields to the event loop, so
# acks and KV requests are read in between large writes: 16 quanta, ~2.5k small frames, about
# 1 ms of a 1 GiB/s loopback. With flow control the window bounds it further.
PUMP_BYTES_MAX = 16 * STREAM_QUANTUM_BYTES

# Consumer side: a DCP consumer acknowledges received bytes (DCP_BUFFER_ACKNOWLEDGEMENT) once
# this fraction of its flow-control window has arrived unacknowledged (consumer/dcp_session.py):
# the producer never waits on a window more than 80 % used, and there is one ack per 1/5 window
# (kv_engine's consumer acks at the same fraction).
DCP_BUFFER_ACK_FRACTION = 0.2
assert 0 < DCP_BUFFER_ACK_FRACTION < 1, DCP_BUFFER_ACK_FRACTION

# Consumer side: decoded events (a `Changes` event holds up to one socket read of items) a
# DcpClient queues for the application before it pauses reading the socket. 256 events of one
# 256 KiB read each bound it at 64 MiB of frames in the worst case.
EVENT_QUEUE_MAX = 256

assert STREAM_QUANTUM_BYTES <= PUMP_BYTES_MAX, (STREAM_QUANTUM_BYTES, PUMP_BYTES_MAX)
assert STREAM_RUN_EVENTS_MAX >= 2  # a marker and an item

# --- server/: retrying a store that cannot persist ---------------------------------------------

# After a failed flush commit (disk full, I/O error) the flusher retries after a backoff that
# doubles from MIN to MAX: the first retry comes at once for a transient error, and a full disk
# costs one failed commit every 5 s, not a busy loop. Freed space is noticed within MAX.
FLUSH_RETRY_BACKOFF_MIN_S = 0.05
FLUSH_RETRY_BACKOFF_MAX_S = 5.0

# A failing store logs at most one line per interval (it would otherwise log every retry).
FLUSH_FAILURE_LOG_INTERVAL_S = 30.0

assert 0 < FLUSH_RETRY_BACKOFF_MIN_S < FLUSH_RETRY_BACKOFF_MAX_S <= FLUSH_FAILURE_LOG_INTERVAL_S

# --- server/: what an unauthenticated peer may make the node buffer --------------------------

# Largest frame body a connection may declare before it has authenticated. What it may send then
# (HELLO: agent + features; SASL: a PLAIN payload or a SCRAM message) takes a few hundred bytes.
# Without this bound any peer could make the node buffer FRAME_SIZE_MAX (~20 MiB) per connection
# without a password (16 connections measured +330 MiB RSS). 16 KiB is h11's incomplete-event bound.
UNAUTHENTICATED_FRAME_SIZE_MAX = 16 * 1024

assert KEY_SIZE_MAX + 2 * 255 < UNAUTHENTICATED_FRAME_SIZE_MAX < FRAME_SIZE_MAX

# --- server/: what any client may make the node hold, and for how long ------------------------

# A connection's transport buffers replies up to this many bytes before the node stops reading
# its requests (asyncio's default high-water mark is 64 KiB; 4 MiB keeps pipelined small GETs
# flowing). So a client that pipelines GETs and never reads costs at most this plus one reply
# (<= VALUE_SIZE_MAX): measured before the bound, 60 unread 5 MiB GETs cost +294 MiB.
# Plain SETs taken from a receive buffer as one run (protocol/set_run.py): bounds the work of one
# step and the replies it queues (~40 bytes each).
SET_RUN_ITEMS_MAX = 4096

# SEQNO_PERSISTENCE waits pending on a node at once (server/persistence_waits.py; more get
# TMPFAIL), on one connection (a writer waits once per vbucket it wrote: 2 windows' worth), and
# how long one may wait (kv_engine's seqno_persistence_timeout is 30 s).
PERSISTENCE_WAITS_MAX = 65536
PERSISTENCE_WAITS_PER_CONNECTION_MAX = 2 * VBUCKETS_MAX
PERSISTENCE_WAIT_S = 30.0
WRITE_BUFFER_HIGH_BYTES = 4 * 1024 * 1024

# Bytes of unfinished requests all connections together may hold. Three maximal (20 MiB) values
# arriving at once fit; 200 connections each 1 MiB into a 20 MiB SET (measured +190 MiB before)
# cannot. Reading resumes for paused connections once the total is back under the resume mark.
PARTIAL_REQUEST_BYTES_MAX = 64 * 1024 * 1024
PARTIAL_REQUEST_BYTES_RESUME = 48 * 1024 * 1024

# Replies of one received batch of requests go out in one write; a batch whose replies reach
# this many bytes is written at once (then backpressure applies to the rest). 256 KiB holds
# ~7k small replies (one syscall where there were 7k) and at most one maximal GET beyond it.
REPLY_BATCH_BYTES_MAX = 256 * 1024

# A request that started to arrive must be complete within this time (nginx's
# client_body_timeout is 60 s): a 20 MiB value at 1 MiB/s takes 20 s.
PARTIAL_FRAME_DEADLINE_S = 30.0

# A new connection must authenticate within this time (HELLO + SASL take milliseconds);
# otherwise idle unauthenticated sockets exhaust the connection limit (1,100 did, silently).
AUTH_DEADLINE_S = 10.0

# How often the node checks every connection's deadlines (auth, idle, partial frame).
DEADLINE_CHECK_INTERVAL_S = 1.0

# Connections a node accepts by default: below the usual 1024-descriptor soft limit minus what
# LMDB, logs and listeners take. More are accepted and closed at once, with a logged refusal.
CONNECTIONS_MAX_DEFAULT = 900

assert VALUE_SIZE_MAX < PARTIAL_REQUEST_BYTES_MAX // 3 + 1
assert 0 < PARTIAL_REQUEST_BYTES_RESUME < PARTIAL_REQUEST_BYTES_MAX
assert DEADLINE_CHECK_INTERVAL_S < AUTH_DEADLINE_S < PARTIAL_FRAME_DEADLINE_S

# --- spark/ and change rows ------------------------------------------------------------------

# Change rows a reader collects before it hands them on as one Arrow record batch
# (spark/reading.py collects, consumer/change_rows.py builds the batch). Measured at 16-byte keys
# and 100-byte values: ~440 bytes a row as Python objects while collected, ~190 bytes a row as
# Arrow, so a full batch holds ~28 MiB + ~12 MiB; 64 Ki rows spread Spark's fixed cost per batch
# thinly. The reader checks the count after each `Changes` event, so a batch may go over by one
# event: one socket read (256 KiB) of items of at least 43 bytes, ~6.1k rows.
# It counts rows, not bytes: Spark needs `binary` (int32 offsets, not `large_binary`), so one
# batch's values must stay under 2 GiB, which holds while values average under 2**31 / 2**16 =
# 32 KiB. 64 Ki maximal (20 MiB) values would not fit: a byte bound is still to come.
ROWS_PER_BATCH_MAX = 64 * 1024

assert ROWS_PER_BATCH_MAX * 32 * 1024 <= 2**31, ROWS_PER_BATCH_MAX  # 32 KiB average values fit

# --- server/: background compaction and the expiry pager -------------------------------------

# Records one compaction chunk looks at in one LMDB write transaction (Store.compact_chunk). A
# chunk runs on the event loop between the flusher's commits (LMDB has one writer; the loop
# serializes them), so it holds the loop and the writer for its duration. Measured (64 vbuckets,
# 100k tombstones, durable): a chunk of 1024 takes ~3-4 ms (median; ~11 ms worst), ~3 us per
# purged tombstone and ~0.3 us per mutation passed over; ~250k tombstones/s overall. Smaller
# chunks cost one commit (an fsync when durable) each; 4096 held the loop ~14-20 ms.
COMPACTION_CHUNK_RECORDS_MAX = 1024

# Records the expiry pager looks at per pass, over all active vbuckets (later passes resume where
# it stopped). Measured (64 vbuckets, durable): a pass of 65536 records takes ~45 ms of loop time
# when nothing is due, ~110 ms when 10 % is, ~0.7 s when everything is (~9 us per expiration:
# a checkpoint lookup, a store read and a queued item of ~100 bytes, so at most ~6 MiB of
# checkpoint memory per pass, far under the 256 MiB default quota). At the default 60 s interval
# a bucket of N records is swept every N / 65536 minutes (1M: ~15 min); Couchbase's pager runs
# every 10 min over everything in memory.
EXPIRY_PAGER_RECORDS_PER_PASS_MAX = 65536

# Records per read snapshot of the pager, after which it yields the loop: 256 due documents are
# expired in ~2.3 ms (measured median); 1024 held the loop ~10-25 ms when all were due.
EXPIRY_PAGER_CHUNK_RECORDS_MAX = 256

assert 0 < COMPACTION_CHUNK_RECORDS_MAX <= 65536, COMPACTION_CHUNK_RECORDS_MAX
assert 0 < EXPIRY_PAGER_CHUNK_RECORDS_MAX <= EXPIRY_PAGER_RECORDS_PER_PASS_MAX
# A pass's expirations fit the checkpoint quota many times over (~100 accounted bytes each).
assert EXPIRY_PAGER_RECORDS_PER_PASS_MAX * 100 <= 256 * 1024 * 1024 // 32

# --- cluster/: etcd metadata, leases and the orchestrator --------------------------------------

# Every unary etcd request (get, put, transaction, lease grant/keep-alive) gives up after this;
# a loopback etcd answers in ~1 ms, a busy one under fsync load in tens of ms.
ETCD_REQUEST_TIMEOUT_S = 5.0

# Node membership and the orchestrator's leader key live on leases of this TTL, kept alive every
# TTL/3. A dead node leaves the member list (and a dead leader frees its key) within one TTL;
# etcd's minimum TTL is ~2x its election timeout (1 s by default), so tests may use 2 s.
ETCD_LEASE_TTL_S_DEFAULT = 10
ETCD_LEASE_TTL_S_MIN = 2

# Starting and stopping a local etcd (changefeed cluster start/stop, tests): it is healthy in
# ~0.3 s on loopback; a clean stop takes ~0.1 s.
ETCD_START_TIMEOUT_S = 20.0
ETCD_STOP_TIMEOUT_S = 10.0

# Watches and campaigns that lose etcd retry with a backoff between these bounds (forever: a
# node keeps serving its last map while the metadata service is away).
ETCD_RETRY_BACKOFF_MIN_S = 0.1
ETCD_RETRY_BACKOFF_MAX_S = 2.0

# The orchestrator waits this long for the expected nodes before it logs which are missing (and
# then keeps waiting, logging again at this interval).
CLUSTER_NODES_WAIT_LOG_S = 30.0

# Largest cluster map document accepted from etcd: 1024 chains of 4 copies plus node addresses
# are ~30 KiB of JSON; etcd's own request limit is 1.5 MiB.
CLUSTER_MAP_BYTES_MAX = 1024 * 1024

assert 0 < ETCD_LEASE_TTL_S_MIN <= ETCD_LEASE_TTL_S_DEFAULT
assert ETCD_REQUEST_TIMEOUT_S < ETCD_LEASE_TTL_S_DEFAULT  # a keep-alive times out within a TTL
assert 0 < ETCD_RETRY_BACKOFF_MIN_S <= ETCD_RETRY_BACKOFF_MAX_S < ETCD_LEASE_TTL_S_DEFAULT

# -- the Couchbase SDK's KV surface (server/kv_commands.py, server/subdoc.py) --------------------

# GET_LOCKED: a lock time of 0, or above the maximum, gets the default (kv_engine's
# getl_default_timeout and getl_max_timeout).
ITEM_LOCK_DEFAULT_S = 15
ITEM_LOCK_MAX_S = 30

# Locks one vbucket tracks: held locks, and unlocked documents that still show their lock's CAS
# until they are rewritten (kv_engine keeps that CAS in the document). A full table forgets the
# unlocked ones first (their CAS reverts to the stored one); a table full of held locks refuses
# GET_LOCKED with TMPFAIL. ~150 bytes a lock (key, record, dict slot): 1024 vbuckets x 10k
# locks would be 1.5 GiB only if every vbucket filled, which needs 10M locked documents.
ITEM_LOCKS_PER_VBUCKET_MAX = 10_000

# Sub-document limits, kv_engine's (docs/SubDocument.md, "Limits"): paths per multi-path
# request, bytes of one path, components of one path, and nesting levels of a document a path
# can reach (a deeper document answers SUBDOC_DOC_E2DEEP, a value that would make it deeper
# SUBDOC_VALUE_ETOODEEP).
SUBDOC_MULTI_PATHS_MAX = 16
SUBDOC_PATH_BYTES_MAX = 1024
SUBDOC_PATH_COMPONENTS_MAX = 32
SUBDOC_DOC_DEPTH_MAX = 32

assert 0 < ITEM_LOCK_DEFAULT_S <= ITEM_LOCK_MAX_S
assert SUBDOC_PATH_COMPONENTS_MAX <= SUBDOC_DOC_DEPTH_MAX

# --- ipc/ and server/shm_publisher.py: shared-memory fan-out to local readers ------------------

# Change rows per published batch (one batch per ring slot). Readers pay a fixed cost per batch
# (~15-20 us: a transaction-logged reference and release, an Arrow IPC header read), so 4096
# rows make it ~5 ns a row; 100-byte rows make a batch of ~0.7 MiB, inside the default 2 MiB slot.
SHM_ROWS_PER_BATCH_MAX = 4096

# Rows the publisher may hold back waiting for the flusher (persisted-only publishing) before it
# stops reading its streams: 16 batches, ~11 MiB of 100-byte rows. A flush round takes
# milliseconds, so the bound is only reached when the store cannot persist.
SHM_PENDING_ROWS_MAX = 16 * SHM_ROWS_PER_BATCH_MAX

# How often a publisher holding unpersisted rows looks at the persisted seqnos (the flusher does
# not wake it): the added latency of persisted-only publishing, next to the flusher's own ~5 ms
# group-commit wait.
SHM_PERSIST_POLL_S = 0.002

assert SHM_ROWS_PER_BATCH_MAX <= ROWS_PER_BATCH_MAX
assert SHM_PENDING_ROWS_MAX >= SHM_ROWS_PER_BATCH_MAX

# A node process's interpreter settings (server/node.py `tune_interpreter` says why): the
# cyclic GC's young-generation threshold (CPython: 700) and the GIL switch interval (5 ms).
GC_YOUNG_THRESHOLD = 50_000
GIL_SWITCH_INTERVAL_S = 0.0005

# --- server/admission.py: connection budgets, and TLS on the client port ---------------------

# Connections still authenticating hold at most this many of the node's slots; one more closes
# the oldest of them. A client needs ~5 round trips and one SCRAM hash (~2-5 ms) to
# authenticate; a burst of new sockets evicts it only if more than this many arrive during its
# handshake: 256 sockets in 10 ms is 25k accepts/s, more than one event loop accepts (measured
# ~10-15k/s here). Each costs at most UNAUTHENTICATED_FRAME_SIZE_MAX of buffer plus ~5 KiB of
# objects: 256 x 21 KiB = ~5.4 MiB. Of the default 900 slots that leaves 644.
UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT = 256

# Slots only users with the admin privilege may fill (the operator's tools; replica streams,
# which authenticate as the replication user, an admin): a replica stream per peer node and a
# few tools. 64 covers a 32-node cluster's streams twice over. Of 900: 580 for everyone.
ADMIN_CONNECTIONS_RESERVED_DEFAULT = 64

# Connections one user may hold; more close that user's longest-idle one (or are refused when
# none is idle). An SDK opens one KV connection per node, a DCP client one per node, a Spark
# job one or two per task: 256 is 64 tasks x 2 connections twice over, and keeps one runaway
# user below half of the authenticated share (580), so other users still get in.
CONNECTIONS_PER_USER_MAX_DEFAULT = 256

# An authenticated connection idle at least this long may be closed to make room for a new
# one (memcached frees its least recently used connections near its limit the same way). A
# client between two requests is not idle: one second is ~1,000 round trips of a busy client.
IDLE_EVICTION_MIN_S = 1.0

# A TLS handshake must finish within this (asyncio's default is 60 s): until it has, the
# connection is not yet a client at all (no admission budget sees it), so it gets the same time
# to finish as the authentication that follows it. A loopback handshake takes ~1-3 ms.
TLS_HANDSHAKE_DEADLINE_S = AUTH_DEADLINE_S

# Node certificates `changefeed certs create` issues are valid this long, its CA ten times as
# long (Couchbase's default node certificates: ~1 year; rotate before they expire).
TLS_NODE_CERT_DAYS_DEFAULT = 365
TLS_CA_CERT_DAYS_DEFAULT = 3650

assert UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT + ADMIN_CONNECTIONS_RESERVED_DEFAULT < (
    CONNECTIONS_MAX_DEFAULT // 2
), "authenticated clients keep at least half of the default slots"
assert (
    CONNECTIONS_PER_USER_MAX_DEFAULT
    <= (
        CONNECTIONS_MAX_DEFAULT
        - UNAUTHENTICATED_CONNECTIONS_MAX_DEFAULT
        - ADMIN_CONNECTIONS_RESERVED_DEFAULT
    )
    // 2
), "one user cannot take half of what all users share"
assert 0 < IDLE_EVICTION_MIN_S < AUTH_DEADLINE_S
assert 0 < TLS_NODE_CERT_DAYS_DEFAULT < TLS_CA_CERT_DAYS_DEFAULT

# Connections the kernel may queue for a listener before the node accepts them (asyncio's
# default is 100). A burst beyond it has its SYNs dropped and retried after 1 s, 3 s...: a
# client arriving amid a flood waited seconds for its turn. memcached and Couchbase use 1024;
# the kernel caps it at net.core.somaxconn (4096 by default since Linux 5.4).
LISTEN_BACKLOG = 1024
