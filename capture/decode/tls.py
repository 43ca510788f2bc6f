"""TLS flows: recognised by their ClientHello, kept as chunks, no calls (the payload is encrypted).

`client_hello_sni(data)` reads the server name (SNI) from the start of a flow's client bytes: a
bounded walk over one handshake record, None when it is not there or not parseable.
"""

from __future__ import annotations

from capture.recording import Call, Direction


class TlsDecoder:
    """Encrypted: nothing to decode (reading TLS plaintext is another matter)."""

    protocol = "tls"

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        return []

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        return []


def client_hello_sni(data: bytes) -> str | None:
    """The SNI host name of the ClientHello at the start of `data` (first 16 KiB), or None."""
    data = data[:5 + (1 << 14)]
    if len(data) < 9 or data[0] != 0x16 or data[5] != 0x01:
        return None
    end = min(len(data), 5 + int.from_bytes(data[3:5], "big"))
    pos = 9 + 2 + 32                       # record + handshake headers, version, random
    try:
        pos += 1 + data[pos]               # session id
        pos += 2 + int.from_bytes(data[pos:pos + 2], "big")     # cipher suites
        pos += 1 + data[pos]               # compression methods
        ext_end = min(end, pos + 2 + int.from_bytes(data[pos:pos + 2], "big"))
        pos += 2
        while pos + 4 <= ext_end:
            etype, elen = int.from_bytes(data[pos:pos + 2], "big"), int.from_bytes(data[pos + 2:pos + 4], "big")
            body = data[pos + 4:pos + 4 + elen]
            if etype == 0 and len(body) >= 5 and body[2] == 0:   # server_name list, host_name entry
                n = int.from_bytes(body[3:5], "big")
                name = body[5:5 + n]
                if len(name) == n and n and all(0x21 <= c < 0x7F for c in name):
                    return name.decode("ascii")
                return None
            pos += 4 + elen
    except IndexError:
        return None
    return None
