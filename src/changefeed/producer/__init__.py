"""The DCP producer, sans-IO: stream-request decisions, streams, encoders, flow control, noops.

The server's connection feeds a `DcpProducer` requests, acks and the clock and writes what its
`pump` returns; nothing here touches a socket. Reads go through the checkpoint layer's
`StreamReader`; vbuckets are reached only through the `VbucketSource` protocol.
"""
