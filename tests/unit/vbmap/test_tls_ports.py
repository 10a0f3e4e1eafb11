"""Each node's TLS port travels with the map: stored (to_json), served to clients (kvSSL in
nodesExt, as Couchbase does) and read back by our clients (from_couchbase_config)."""

from __future__ import annotations

from changefeed.vbmap import ClusterMap, NodeAddress


def a_map() -> ClusterMap:
    nodes = (NodeAddress("n1", "10.0.0.1", 11210, 11207), NodeAddress("n2", "10.0.0.2", 11210))
    return ClusterMap(3, nodes, ((0, 1), (1, 0)), 1)


def test_every_node_with_a_tls_port_advertises_it_and_others_do_not() -> None:
    config = a_map().couchbase_config("default", "n2")
    services = [entry["services"] for entry in config["nodesExt"]]  # type: ignore[attr-defined]
    assert services == [{"kv": 11210, "kvSSL": 11207}, {"kv": 11210}]


def test_tls_ports_survive_both_forms() -> None:
    original = a_map()
    assert ClusterMap.from_json(original.to_json()) == original
    served = ClusterMap.from_couchbase_config(original.couchbase_config("default"))
    assert [n.tls_port for n in served.nodes] == [11207, 0]
    assert [n.server for n in served.nodes] == ["10.0.0.1:11210", "10.0.0.2:11210"]
