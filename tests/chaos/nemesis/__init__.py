"""The Jepsen-style chaos suite's parts (issue 12, "Chaos suite"), importable as ``nemesis``
because pytest puts ``tests/chaos`` on ``sys.path`` (it is not a package itself).

* ``history``: what a run records — every write and its outcome, what the streaming consumer
  saw per vbucket, the faults injected. Plain data, so the checker can be tested on hand-built
  histories.
* ``schedule``: the seeded fault schedule (kill -9 then restart, clean restart, SIGSTOP/SIGCONT
  pause; one node at a time, or a minority together) and the ``Nemesis`` that plays it on node
  processes.
* ``loader``: writers through ``KvClient`` at a configurable durability level, classifying
  each write as acknowledged, failed definitely, or ambiguous.
* ``consumer``: a ``DcpClient`` following the map over every vbucket for the whole run.
* ``mirror``: the ``changefeed mirror`` job as a subprocess, and its Delta table's state.
* ``checker``: pure functions from the histories and the final states to the counts the test
  asserts are zero, and the report it prints.
* ``harness``: one run end to end (cluster, chaos, healing, convergence, checks).
"""
