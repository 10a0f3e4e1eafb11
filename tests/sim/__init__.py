"""A deterministic cluster simulator: N nodes in one process on a seeded scheduler.

The real `VBucket`, `Store`, `DcpProducer`, `ReplicaFeed`, `ReplicationTracker` and the
cluster's rule functions, joined by simulated links to each other, to clients and to an
etcd-like metadata store, on a simulated clock; faults from the seed; a checker at the end.
See docs/simulator.md. Replay a seed: ``.venv/bin/python -m tests.sim.run --seed N``.
"""
