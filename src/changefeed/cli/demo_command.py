"""``changefeed demo``: the single-node demo (demo.py) or, with ``--cluster``, the same on three
nodes and etcd with a node killed mid-way (demo_cluster.py). A module of its own so that the
cluster flavour can build on demo.py without demo.py importing it back."""

from __future__ import annotations

from pathlib import Path

import click

from changefeed import limits
from changefeed.cli.demo import run_single_node_demo
from changefeed.cli.demo_cluster import VBUCKETS_DEFAULT, run_cluster_demo


@click.command()
@click.option("--items", default=50_000, show_default=True, help="KV operations to load.")
@click.option(
    "--vbuckets",
    type=click.IntRange(1, limits.VBUCKETS_MAX),
    help="Partitions of the bucket. Default 16; 4 with --cluster (one node leads half).",
)
@click.option("--batch-rows", default=10_000, show_default=True, help="maxOffsetsPerTrigger.")
@click.option("--data-dir", type=click.Path(path_type=Path), help="Keep everything here.")
@click.option("--seed", default=1, show_default=True)
@click.option(
    "--cluster",
    "on_cluster",
    is_flag=True,
    help="3 nodes + etcd; the node leading the most vbuckets is killed mid-way (demo_cluster.py).",
)
@click.option("--replicas", type=click.IntRange(1, 2), default=1, show_default=True,
              help="With --cluster: replicas per vbucket.")  # fmt: skip
@click.option("--failover-timeout-s", type=click.IntRange(2, 3600), default=3, show_default=True,
              help="With --cluster: the nodes' lease, kill to failover.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="With --cluster: print the report as JSON.")
def demo(items: int, vbuckets: int | None, batch_rows: int, data_dir: Path | None, seed: int,
         on_cluster: bool, replicas: int, failover_timeout_s: int,
         as_json: bool) -> None:  # fmt: skip
    """Node → DCP → Spark → Delta mirror, with a query restart, verified on every column."""
    if on_cluster:
        run_cluster_demo(
            items=items, vbuckets=vbuckets or VBUCKETS_DEFAULT, replicas=replicas,
            failover_timeout_s=failover_timeout_s, batch_rows=batch_rows, data_dir=data_dir,
            seed=seed, as_json=as_json,
        )  # fmt: skip
        return
    if as_json:
        raise click.UsageError("--json goes with --cluster")
    run_single_node_demo(items, vbuckets or 16, batch_rows, data_dir, seed)
