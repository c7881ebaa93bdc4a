"""Transports: one wire format's I/O shell per module (docs/architecture.md, "Adding a transport").

Each module has a `NAME` and `register(ctx: realtime.server.TransportContext)`, which adds its routes
(closures over what they use) and returns its state, if any (tests read it as `gateway.transports[NAME]`).
The server lists them explicitly (`realtime.server.TRANSPORTS`).
"""
