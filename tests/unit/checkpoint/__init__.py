"""Tests for ``changefeed.checkpoint``, one module per source module (STYLE.md §1)."""

import pytest

# helpers.py asserts on behalf of the tests; let pytest show the compared values.
pytest.register_assert_rewrite(f"{__name__}.helpers")
