"""Test helpers for capture: real HTTP/2 conversations built with the `h2` library.

`h2_conversation` drives a real h2 client and server connection against each other in memory and
returns the bytes each side wrote, in order, exactly as a capture would see them on the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from capture.recording import Direction


def grpc_frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message (uncompressed)."""
    return b"\0" + len(message).to_bytes(4, "big") + message


@dataclass
class GrpcCall:
    method: str
    requests: list[bytes]
    responses: list[bytes]
    status: int = 0
    metadata: list[tuple[str, str]] = field(default_factory=list)


def h2_conversation(calls: list[GrpcCall], header_table_size: int | None = None) -> list[tuple[Direction, bytes]]:
    """Bytes of one HTTP/2 connection carrying `calls` one after another: [(direction, bytes), ...].

    Each request message and each response message is written separately, so streaming calls
    show up as several DATA frames at distinct positions. `header_table_size=0` makes the server
    advertise a zero HPACK table (what `agent serve --hpack-table-size 0` does)."""
    import h2.config
    import h2.connection
    import h2.settings

    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    server = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    out: list[tuple[Direction, bytes]] = []

    def pump(src: h2.connection.H2Connection, dst: h2.connection.H2Connection, direction: Direction) -> None:
        data = src.data_to_send()
        if data:
            out.append((direction, data))
            dst.receive_data(data)

    client.initiate_connection()
    server.initiate_connection()
    if header_table_size is not None:
        server.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: header_table_size})
    pump(client, server, "c2s")
    pump(server, client, "s2c")
    pump(client, server, "c2s")
    for call in calls:
        _one_call(client, server, call, pump)
    return out


def _one_call(client: Any, server: Any, call: GrpcCall, pump: Any) -> None:
    sid = client.get_next_available_stream_id()
    client.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", call.method),
                              (":authority", "agent"), ("content-type", "application/grpc"), ("te", "trailers"),
                              *call.metadata])
    pump(client, server, "c2s")
    for i, msg in enumerate(call.requests):
        client.send_data(sid, grpc_frame(msg), end_stream=i == len(call.requests) - 1)
        pump(client, server, "c2s")
    server.send_headers(sid, [(":status", "200"), ("content-type", "application/grpc")])
    for msg in call.responses:
        server.send_data(sid, grpc_frame(msg))
        pump(server, client, "s2c")
    server.send_headers(sid, [("grpc-status", str(call.status)), ("grpc-message", "ok" if not call.status else "bad")],
                        end_stream=True)
    pump(server, client, "s2c")
    pump(client, server, "c2s")  # window updates and acks
