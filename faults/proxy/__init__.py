"""An asyncio proxy that speaks Toxiproxy 2.x's HTTP API, plus call-level HTTP/2 (gRPC) toxics.

    client --> [listener] --> Link(upstream):   chunk -> toxic -> toxic -> writer --> upstream service
    client <-- [writer]   <-- Link(downstream): chunk <- toxic <- toxic <- reader <-- upstream service

Every chunk carries its arrival time, so a latency toxic sleeps `delay - age` and never reorders.
A direction with no toxic (and a connection with no HTTP call tap) skips the chunks: its bytes go
socket to socket (recv_into/send, or splice for bulk; `flow.py`) until a toxic is added.
Public face: `faults.proxy.EmbeddedToxiproxy` (in-process, own thread and loop) and
`faults.proxy.spawn_proxy_server` (a subprocess); both serve the same HTTP API.
"""

from faults.proxy.server import EmbeddedToxiproxy, ProxyProcess, ToxicApplied, spawn_proxy_server

__all__ = ["EmbeddedToxiproxy", "ProxyProcess", "ToxicApplied", "spawn_proxy_server"]
