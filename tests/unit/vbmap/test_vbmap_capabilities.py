"""``bucketCapabilities`` in the Couchbase-format config (issue 26): SDKs refuse operations whose
capability the config does not list, so it lists what the nodes serve, and nothing more."""

from __future__ import annotations

import json

from changefeed.vbmap import ClusterMap, NodeAddress


def test_the_config_lists_what_the_nodes_serve() -> None:
    nodes = (NodeAddress("a", "127.0.0.1", 1), NodeAddress("b", "127.0.0.1", 2))
    cluster_map = ClusterMap(3, nodes, ((0, 1), (1, 0)), replicas=1)
    config = json.loads(json.dumps(cluster_map.couchbase_config("default", this_node="a")))
    capabilities = config["bucketCapabilities"]
    assert {"durableWrite", "subdoc.ReplicaRead", "cbhello", "dcp", "nodesExt"} <= set(capabilities)
    assert "couchapi" not in capabilities  # no views
    assert "xattr" not in capabilities  # user xattrs cannot be written here
    assert len(set(capabilities)) == len(capabilities)
    assert config["bucketCapabilitiesVer"] == ""
    assert ClusterMap.from_couchbase_config(config).chains == cluster_map.chains


def test_a_single_node_config_has_them_too() -> None:
    single = ClusterMap.single_node(NodeAddress("n", "127.0.0.1", 11210), 4)
    assert "durableWrite" in single.couchbase_config("default")["bucketCapabilities"]  # type: ignore[operator]
