"""HTTP/1.1 decoding: keep-alive, pipelining (responses pair with requests in order), chunked bodies.

    c2s: request line, headers, body (Content-Length | chunked) --> pending requests (FIFO)
    s2c: status line, headers, body (Content-Length | chunked | until close) --> pairs with the oldest
"""

from __future__ import annotations

from collections import deque

from capture.recording import Call, Direction, Message

_BODYLESS_STATUS = {204, 304}


class _Parser:
    """Incremental parser of one direction's messages: (start line, headers, body, ts)."""

    def __init__(self, is_response: bool) -> None:
        self.buf = bytearray()
        self.is_response = is_response
        self.first_ts: int | None = None

    def next_message(self, ts_ns: int, head_only: bool = False,
                     at_eof: bool = False) -> tuple[str, list[tuple[str, str]], bytes, int] | None:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        headers = [(k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:])]
        body_start = end + 4
        h = dict(headers)
        if head_only:
            body, used = b"", 0
        elif "chunked" in h.get("transfer-encoding", "").lower():
            parsed = _dechunk(self.buf, body_start)
            if parsed is None:
                return None
            body, used = parsed
        elif "content-length" in h:
            n = int(h["content-length"] or 0)
            if len(self.buf) < body_start + n:
                return None
            body, used = bytes(self.buf[body_start:body_start + n]), n
        elif self.is_response:
            if not at_eof:
                return None              # body runs to the end of the connection
            body, used = bytes(self.buf[body_start:]), len(self.buf) - body_start
        else:
            body, used = b"", 0
        del self.buf[:body_start + used]
        first = self.first_ts if self.first_ts is not None else ts_ns
        self.first_ts = None if not self.buf else ts_ns
        return lines[0], headers, body, first


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    out = bytearray()
    start = pos
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(bytes(buf[pos:eol]).split(b";")[0].strip() or b"0", 16)
        pos = eol + 2
        if size == 0:
            end = buf.find(b"\r\n\r\n", pos - 2)   # trailers end with an empty line
            if end < 0:
                return None
            return bytes(out), end + 4 - start
        if len(buf) < pos + size + 2:
            return None
        out += buf[pos:pos + size]
        pos += size + 2


class Http1Decoder:
    """Decode one HTTP/1.1 connection into request/response calls."""

    protocol = "http1"

    def __init__(self, flow_id: int | None = None, joined: bool = False) -> None:
        self.flow_id = flow_id
        self.req = _Parser(False)
        self.resp = _Parser(True)
        self.pending: deque[Call] = deque()

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        parser = self.req if direction == "c2s" else self.resp
        if parser.first_ts is None:
            parser.first_ts = ts_ns
        parser.buf += data
        return self._drain(ts_ns)

    def _drain(self, ts_ns: int, at_eof: bool = False) -> list[Call]:
        while (m := self.req.next_message(ts_ns)) is not None:
            line, headers, body, first = m
            call = Call(protocol="http1", method=line.rsplit(" ", 1)[0], request_ts_ns=first,
                        flow_id=self.flow_id, kind="request", request_metadata=headers)
            if body:
                call.requests.append(Message("c2s", 0, ts_ns, body))
            self.pending.append(call)
        done: list[Call] = []
        while self.pending:
            head_only = self.pending[0].method is not None and self.pending[0].method.startswith("HEAD ")
            m = self.resp.next_message(ts_ns, head_only=head_only or self._bodyless(), at_eof=at_eof)
            if m is None:
                break
            line, headers, body, first = m
            parts = line.split(" ", 2)
            status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
            if status is not None and 100 <= status < 200:
                continue                 # interim response: the real one follows
            call = self.pending.popleft()
            call.status, call.status_message = status, parts[2] if len(parts) > 2 else None
            call.response_metadata, call.response_ts_ns, call.end_ts_ns = headers, first, ts_ns
            if body:
                call.responses.append(Message("s2c", 0, ts_ns, body))
            done.append(call)
        return done

    def _bodyless(self) -> bool:
        head = bytes(self.resp.buf[:16]).split(b" ")
        return len(head) > 1 and head[1].isdigit() and (int(head[1]) in _BODYLESS_STATUS
                                                        or 100 <= int(head[1]) < 200)

    def gap(self, direction: Direction) -> None:
        """Bytes went missing: what is buffered for that direction cannot be trusted."""
        (self.req if direction == "c2s" else self.resp).buf.clear()

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        done = self._drain(ts_ns or 0, at_eof=True)
        done += list(self.pending)       # requests never answered: status None
        self.pending.clear()
        return done
