"""Tests for ``changefeed.consumer``, one module per source module (STYLE.md §1)."""
