"""The node process: connections, authentication, command dispatch, the DCP pump, stats.

`node.Node` wires a `ServerContext` (bucket, users, config, registries, clock) and hands it to
every `ClientConnection`; no module here reaches back into the node or into another's privates.
"""
