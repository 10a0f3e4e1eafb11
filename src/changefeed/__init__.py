"""changefeed: a partitioned key-value store whose every change is numbered and streamed.

The store side follows Couchbase's Database Change Protocol (DCP); see ``docs/architecture.md``.
"""

__version__ = "0.1.0"
