"""The dead role: a copy this node no longer holds in the map. It refuses every operation,
reads included (NOT_MY_VBUCKET: the client fetches the map), and keeps the pending prepares the
store keeps, for the role that follows if the map gives the copy back."""

from __future__ import annotations

from changefeed.vbucket.role import Role


class DeadRole(Role):
    """Everything refused: the base role as it is (named so a reader finds the dead state)."""
