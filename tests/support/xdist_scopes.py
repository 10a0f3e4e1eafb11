"""How ``./run test`` shares the suite between two pytest-xdist workers (``-n 2 --dist
loadgroup``; ``tests/conftest.py`` installs ``ModuleScheduling`` for that mode).

A work unit ("scope") goes whole to one worker, which runs its tests in collection order:

* test hosts and chaos (``hosts``: namespaces, several etcd members and nodes per test) and
  Spark (``spark``: a JVM each) are one scope per directory, so those never run two at a time;
* every other test is a scope with the rest of its module, so a module's tests run in order
  beside its module-scoped fixtures (started once, not once per worker), as in one process: a
  test that builds on an earlier one of its module (it should not, but test_cluster_sdk.py's
  failover test did) never meets a worker where that one never ran.

Why not xdist's own ``loadgroup`` with ``xdist_group`` marks: pytest-xdist 3.8 tags a marked
test by rewriting ``item._nodeid``, which pytest 9.2 no longer reads (``Node.nodeid`` is
``str(self._id)``), so the marks grouped nothing and a module's tests were spread over both
workers. Scopes here come from the node id alone, on the controller.

Order: the two directory scopes first (the longest units: started last, they would make the
tail), then modules by their number of tests, most first, as xdist's loadscope does.
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import WorkerController

# The first path part under tests/ -> the scope of everything below it.
DIRECTORY_SCOPES = {"hosts": "hosts", "chaos": "hosts", "spark": "spark"}
FIRST = ("hosts", "spark")


def scope_of(nodeid: str) -> str:
    """The work unit of a test: its directory's scope, or its module's path.

    >>> scope_of("tests/chaos/test_chaos_cluster.py::test_chaos_short")
    'hosts'
    >>> scope_of("tests/unit/test_layers.py::test_x[a::b]")
    'tests/unit/test_layers.py'
    """
    module = nodeid.split("::", 1)[0]
    parts = module.split("/")
    if len(parts) > 2 and parts[0] == "tests" and parts[1] in DIRECTORY_SCOPES:
        return DIRECTORY_SCOPES[parts[1]]
    return module


class ModuleScheduling(LoadScopeScheduling):
    """xdist's loadscope scheduling with ``scope_of`` as the scope, directory scopes first."""

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        first = [scope for scope in FIRST if scope in self.workqueue]
        if first:  # the queue is in xdist's order otherwise: most tests first
            self.workqueue.move_to_end(first[0], last=False)
        super()._assign_work_unit(node)
