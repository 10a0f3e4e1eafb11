"""Test support shared by ``tests/integration`` and ``tests/spark``: one home for what both need.

* ``nodes``: the ``nodes`` fixture's factory. Nodes are ``changefeed.cli.node_process.NodeProcess``
  (the launcher ``changefeed demo`` and the benchmarks use too), listen on 127.0.0.1 only, and
  are stopped by pid when the test ends.
* ``clients``: connections to a node (``kv_connect``, ``dcp_config``, ``raw_connection``), STAT,
  and ``upsert_retrying`` (writes that wait out TMPFAIL while the flusher catches up).
* ``consumer``: ``StreamedState``, what a careful consumer keeps of a DCP stream, and the truth
  readers: ``server_state`` (a fresh stream of every vbucket to its high seqno) and
  ``high_seqnos`` (what the node's STAT says).

The fixtures themselves (``nodes``, ``rng``) are in ``tests/conftest.py``. What only one suite
uses stays with it: the resume and state assertions in ``tests/integration/harness.py``, the
workload, Delta and mirror checks in ``tests/spark/helpers.py``. Importable as ``support``
because pytest puts ``tests/`` on ``sys.path`` (``tests`` itself is not a package).
"""
