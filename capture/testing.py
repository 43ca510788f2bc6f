"""Test helpers for capture: real HTTP/2 conversations built with the `h2` library.

`h2_conversation` drives a real h2 client and server connection against each other in memory and
returns the bytes each side wrote, in order, exactly as a capture would see them on the wire.
`HpackConnection` builds one connection's bytes call by call from HPACK encoders the test holds, so
a test can fill their dynamic tables "before the join" and decode only what comes after.
"""

from __future__ import annotations

from collections.abc import Sequence
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


class HpackConnection:
    """One HTTP/2 connection's bytes, call by call, from `hpack` Encoders the test holds.

    Every header field is encoded with incremental indexing (what gRPC clients do with `:path` and
    most metadata), so the client's dynamic table fills as calls go by. To imitate a recorder that
    joins mid-connection: encode some calls and throw their bytes away (their entries stay in the
    encoders' tables), then feed a decoder (joined=True) only the bytes of later calls.

    `call()` returns [(direction, bytes), ...]: request HEADERS, request DATA (gRPC-framed, or raw
    for `grpc=False`), response HEADERS, response DATA, trailers (gRPC). A plain HTTP/2 call (grpc
    False) with no request or response body ends each direction on its HEADERS."""

    def __init__(self, header_table_size: int | None = None) -> None:
        import hpack

        self.client = hpack.Encoder()
        self.server = hpack.Encoder()
        if header_table_size is not None:      # a size update starts the client's next block
            self.client.header_table_size = header_table_size
        self.next_sid = 1

    def preface(self) -> list[tuple[Direction, bytes]]:
        from wire.h2 import PREFACE, SETTINGS_ACK, settings

        return [("c2s", PREFACE + settings({})), ("s2c", settings({}) + SETTINGS_ACK), ("c2s", SETTINGS_ACK)]

    def call(self, path: str, requests: Sequence[bytes] = (b"q",), responses: Sequence[bytes] = (b"r",),
             *, status: int = 0, metadata: Sequence[tuple[str, str]] = (), authority: str = "agent",
             grpc: bool = True, content_type: str | None = None) -> list[tuple[Direction, bytes]]:
        from wire.h2 import data_frames, headers

        sid, self.next_sid = self.next_sid, self.next_sid + 2
        ctype = content_type or ("application/grpc" if grpc else "application/json")
        req = [(":method", "POST" if grpc or requests else "GET"), (":scheme", "http"), (":path", path),
               (":authority", authority), ("content-type", ctype)] + ([("te", "trailers")] if grpc else [])
        out: list[tuple[Direction, bytes]] = []
        body = [grpc_frame(m) if grpc else m for m in requests]
        out.append(("c2s", headers(sid, self.client.encode(req + list(metadata)), 16384, end_stream=not body)))
        out += [("c2s", data_frames(sid, m, 16384, end_stream=i == len(body) - 1)) for i, m in enumerate(body)]
        answer = [grpc_frame(m) if grpc else m for m in responses]
        resp = [(":status", "200"), ("content-type", ctype)]
        out.append(("s2c", headers(sid, self.server.encode(resp), 16384, end_stream=not grpc and not answer)))
        out += [("s2c", data_frames(sid, m, 16384, end_stream=not grpc and i == len(answer) - 1))
                for i, m in enumerate(answer)]
        if grpc:
            trailers = [("grpc-status", str(status)), ("grpc-message", "ok" if not status else "bad")]
            out.append(("s2c", headers(sid, self.server.encode(trailers), 16384, end_stream=True)))
        return out
