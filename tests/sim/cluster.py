"""A whole simulated cluster and one run of it: build from a seed, work, fault, heal, check.

    result = run(seed=1234)                       # faults drawn from the seed
    result = run(seed=1234, faults=[...])         # a written schedule (scenarios.py, shrinking)
    assert result.ok, result.report()

Timeline of a run (simulated seconds): the nodes start at 0 and elect an orchestrator, which
writes the first map once they are all registered; the clients start with that map and work
for `work_s`, the faults falling inside that window; then the clients stop, every fault is
healed (crashed nodes restarted), the cluster gets `settle_s` to fail over, rejoin and catch
up, every node flushes, and the checker (checker.py) compares what clients were told with
what the copies hold.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
import traceback
from pathlib import Path

from changefeed.cluster import placement
from changefeed.vbmap import ClusterMap

from . import keys
from .checker import History, check
from .consumer import Consumer
from .faults import Fault, FaultInjector, random_faults, template_faults
from .metastore import MetaStore
from .network import Network
from .node import SimNode
from .rules import TodayRules, rules_for_tree
from .scheduler import Scheduler
from .workload import Client

MAP_WAIT_S = 5.0  # the first map must exist by then
TEMPLATE_SHARE = 0.2  # random seeds that instantiate a dangerous pattern (faults.template_faults)
# Random seeds that instantiate issue 25's crash race instead (scenarios.crash_race_faults),
# drawn from a stream of their own so that every other seed keeps its schedule.
CRASH_RACE_SHARE = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class SimConfig:
    nodes: int = 3
    replicas: int = 2
    vbuckets: int = 4
    clients: int = 2
    lease_ttl_s: int = 2  # limits.ETCD_LEASE_TTL_S_MIN: short, so failovers fit in a run
    replica_lag_max_s: float = 2.0
    work_s: float = 5.0
    settle_s: float = 6.0
    faults_max: int = 4
    think_s: tuple[float, float] = (0.03, 0.12)
    plain_share: float = 0.2
    durable_share: float = 0.4  # the rest: CAS read-modify-write
    consumer: bool = True  # a DCP consumer reading every vbucket from its active

    @classmethod
    def for_seed(cls, seed: int) -> SimConfig:
        """The random runs' shapes: 3 nodes (2 replicas or 1) or 5 nodes (2 replicas)."""
        shape = seed % 4
        if shape == 3:
            return cls(nodes=5, replicas=2, vbuckets=5, clients=3)
        if shape == 2:
            return cls(nodes=3, replicas=1, vbuckets=4)
        return cls()


@dataclasses.dataclass(slots=True)
class RunResult:
    seed: int
    config: SimConfig
    faults: list[Fault]
    failures: list[str]
    trace_hash: str
    sim_s: float
    events: int
    stats: dict[str, int]
    notes: frozenset[str] = frozenset()  # known causes seen in the run (`SimCluster.note`)

    @property
    def ok(self) -> bool:
        return not self.failures

    def replay_command(self) -> str:
        schedule = " ".join(f"'{f}'" for f in self.faults)
        faults = f" --faults {schedule}" if self.faults else " --no-faults"
        return f".venv/bin/python -m tests.sim.run --seed {self.seed}{faults}{_shape(self.config)}"

    def report(self) -> str:
        lines = [f"seed {self.seed}: {'ok' if self.ok else 'FAILED'} ({self.stats})"]
        lines += [f"  fault {f}" for f in self.faults]
        lines += [f"  {failure}" for failure in self.failures]
        lines += [f"  noted: {note}" for note in sorted(self.notes) if not self.ok]
        lines.append(f"  replay: {self.replay_command()}")
        return "\n".join(lines)


def _shape(config: SimConfig) -> str:
    default = SimConfig()
    parts = []
    for field in ("nodes", "replicas", "vbuckets", "clients"):
        value = getattr(config, field)
        if value != getattr(default, field):
            parts.append(f" --{field} {value}")
    return "".join(parts)


class SimCluster:
    def __init__(self, seed: int, config: SimConfig, root: Path, rules: TodayRules) -> None:
        self.seed = seed
        self.config = config
        self.rules = rules
        self.sched = Scheduler(seed)
        self.net = Network(self.sched)
        self.meta = MetaStore(self.sched, self.net)
        self.history = History()
        self.violations: list[str] = []
        self.notes: set[str] = set()
        self.nodes_by_name: dict[str, SimNode] = {}
        self.clients_by_name: dict[str, Client | Consumer] = {}
        for i in range(config.nodes):
            name = f"n{i}"
            self.nodes_by_name[name] = SimNode(self, name, root / name)
        for i in range(config.clients):
            name = f"c{i}"
            self.clients_by_name[name] = Client(self, name)
        if config.consumer:
            self.clients_by_name["k0"] = Consumer(self, "k0")
        self.injector = FaultInjector(self)

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def note(self, cause: str) -> None:
        """Something a known bug needs happened (not a failure by itself: the checker decides);
        a failed run that noted it says so in its report."""
        if cause not in self.notes:
            self.notes.add(cause)
            self.sched.record("note", cause)

    def stored_map(self) -> ClusterMap | None:
        found = self.meta.kv.get(keys.MAP)
        return None if found is None else found.value

    def run(self, faults: list[Fault]) -> None:
        sched, config = self.sched, self.config
        for i, name in enumerate(sorted(self.nodes_by_name)):
            sched.at(0.001 * i, self.nodes_by_name[name].start)
        deadline = MAP_WAIT_S
        while self.stored_map() is None and sched.now < deadline:
            sched.run_until(sched.now + 0.25)
        first = self.stored_map()
        if first is None:
            self.violation("no first map")
            return
        sched.run_until(sched.now + 0.5)  # the nodes apply it
        start = sched.now
        for name in sorted(self.clients_by_name):
            self.clients_by_name[name].start(first)
        self.injector.schedule(faults, start)
        sched.run_until(start + config.work_s)
        for client in self.clients_by_name.values():
            client.stop()
        self.injector.heal_all()
        for name in sorted(self.nodes_by_name):
            node = self.nodes_by_name[name]
            node.paused_until = min(node.paused_until, sched.now)
            if not node.up:
                node.start()
        sched.run_until(sched.now + config.settle_s)
        for name in sorted(self.nodes_by_name):
            self.nodes_by_name[name].stop_clean()

    def close(self) -> None:
        for node in self.nodes_by_name.values():
            if node.store is not None:
                for vbucket in node.vbuckets.values():
                    vbucket.release()
                node.store.close(clean=False)
                node.store = None


def run(
    seed: int,
    faults: list[Fault] | None = None,
    config: SimConfig | None = None,
    rules: TodayRules | None = None,
) -> RunResult:
    """One run of `seed`: `faults` (None: drawn from the seed) on `config` (None: by seed)."""
    config = config if config is not None else SimConfig.for_seed(seed)
    if faults is None:
        rng = Scheduler(seed).stream("faults")
        nodes = [f"n{i}" for i in range(config.nodes)]
        clients = [f"c{i}" for i in range(config.clients)]
        chains = placement.chains(config.nodes, config.replicas, config.vbuckets)
        victim = tuple(f"n{i}" for i in rng.choice(chains) if i != -1)
        if rng.random() < TEMPLATE_SHARE:
            faults = template_faults(rng, nodes, clients, config.work_s, victim)
        else:
            faults = random_faults(rng, nodes, clients, config.work_s, config.faults_max, victim)
        race = Scheduler(seed).stream("crash-race")
        if race.random() < CRASH_RACE_SHARE:
            from .scenarios import crash_race_faults  # scenarios builds on this module

            faults = crash_race_faults(race, config) or faults
    root = Path(tempfile.mkdtemp(prefix=f"sim-{seed}-", dir=_scratch()))
    cluster = SimCluster(seed, config, root, rules if rules is not None else rules_for_tree())
    logger = logging.getLogger("changefeed")
    level, logger.level = logger.level, logging.CRITICAL  # the nodes' logs: thousands per run
    failures: list[str] = []
    try:
        try:
            cluster.run(faults)
        except Exception as error:  # an assert in production code, or a bug in the simulator
            where = traceback.format_exception(error)[-3:]
            cluster.violation(f"exception at {cluster.sched.now:.3f} s: {error!r} {''.join(where)}")
        final = cluster.stored_map()
        if final is None or cluster.violations:
            failures = list(cluster.violations) or ["no map"]
        else:
            failures = check(cluster.history, final, cluster.nodes_by_name, cluster.violations)
        h = cluster.history
        stats = {
            "durable_acked": h.durable_acked,
            "cas_acked": h.cas_acked,
            "plain_acked": h.plain_acked,
            "unknown": h.unknown_count,
            "map_rev": final.rev if final is not None else 0,
            "consumed": getattr(cluster.clients_by_name.get("k0"), "items", 0),
            "consumer_rollbacks": getattr(cluster.clients_by_name.get("k0"), "rollbacks", 0),
        }
        return RunResult(
            seed, config, list(faults), failures, cluster.sched.trace_hash,
            cluster.sched.now, cluster.sched.events_run, stats, frozenset(cluster.notes),
        )  # fmt: skip
    finally:
        logger.setLevel(level)
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)


def _scratch() -> str | None:
    """Stores in memory when the machine has /dev/shm: the simulated disk needs no real one."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def shrink(result: RunResult, rules: TodayRules | None = None) -> RunResult:
    """Drop faults one at a time while the run still fails; the smallest failing schedule."""
    assert not result.ok, result.seed
    best = result
    changed = True
    while changed and best.faults:
        changed = False
        for i in range(len(best.faults)):
            fewer = best.faults[:i] + best.faults[i + 1 :]
            attempt = run(best.seed, fewer, best.config, rules)
            if not attempt.ok:
                best, changed = attempt, True
                break
    return best
