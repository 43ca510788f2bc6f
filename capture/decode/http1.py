"""HTTP/1.1 decoding: keep-alive, pipelining (responses pair with requests in order), chunked bodies.

    c2s: request line, headers, body (Content-Length | chunked) --> pending requests (FIFO)
    s2c: status line, headers, body (Content-Length | chunked | until close) --> pairs with the oldest

Gaps (bytes lost, length known or not): a gap inside a body of known length (Content-Length, or inside a
chunk whose size line was seen) that fits in what remains is stepped over: the message still becomes a call,
its body is not stored and the call says `BODY_NOT_CAPTURED`. Any other gap cannot be resynchronised: the
direction stops decoding; after a server-side one every later call of the connection is `OUTCOME_UNKNOWN`
(no status), after a client-side one the requests already parsed still pair and nothing later is paired.
"""

from __future__ import annotations

from collections import deque

from capture.recording import BODY_NOT_CAPTURED, OUTCOME_UNKNOWN, Call, Direction, Message

_BODYLESS_STATUS = {204, 304}


class _Parser:
    """Incremental parser of one direction's messages: (start line, headers, body, ts)."""

    def __init__(self, is_response: bool) -> None:
        self.buf = bytearray()
        self.is_response = is_response
        self.first_ts: int | None = None
        self.broken = False              # a gap it could not step over: no more messages
        # a message whose body had a gap: (start line, headers, first ts, bytes missing, chunked)
        self.holed: tuple[str, list[tuple[str, str]], int, int, bool] | None = None
        self.skip = 0                    # body bytes still to come before the framing resumes
        self.cut = 0                     # a holed body the connection ended inside: the bytes it lacked

    def step_over(self, nbytes: int | None, head_only: bool = False) -> int | None:
        """A gap of `nbytes`: step over it inside the current body; the bytes missing, or None if it cannot."""
        if nbytes is None or nbytes <= 0 or self.broken:
            return None
        if self.holed is not None:       # a further gap in the same body
            if nbytes > self.skip - len(self.buf):
                return None
            line, headers, first, missing, chunked = self.holed
            self.holed, self.skip = (line, headers, first, missing + nbytes, chunked), self.skip - nbytes
            return nbytes
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or head_only:
            return None
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        headers = _headers(lines)
        h = dict(headers)
        body_start = end + 4
        if "chunked" in h.get("transfer-encoding", "").lower():
            remaining = _chunk_remaining(self.buf, body_start)
            chunked = True
        elif "content-length" in h and h["content-length"].isdigit():
            remaining = int(h["content-length"]) - (len(self.buf) - body_start)
            chunked = False
        else:
            return None
        if remaining is None or nbytes > remaining:
            return None
        first = self.first_ts if self.first_ts is not None else 0
        self.holed, self.skip = (lines[0], headers, first, nbytes, chunked), remaining - nbytes
        self.buf.clear()
        return nbytes

    def next_message(self, ts_ns: int, head_only: bool = False,
                     at_eof: bool = False) -> tuple[str, list[tuple[str, str]], bytes, int, int] | None:
        if self.broken:
            return None
        if self.holed is not None:
            return self._holed_message(ts_ns, at_eof)
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return None
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        headers = _headers(lines)
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
        return lines[0], headers, body, first, 0

    def _holed_message(self, ts_ns: int, at_eof: bool = False) -> tuple[str, list[tuple[str, str]], bytes, int,
                                                                         int] | None:
        assert self.holed is not None
        line, headers, first, missing, chunked = self.holed
        if len(self.buf) < self.skip:
            if not at_eof:
                return None
            # the connection ended inside the body (a client gone mid-download): still this message
            self.cut, self.holed, self.skip = self.skip - len(self.buf), None, 0
            self.buf.clear()
            return line, headers, b"", first, missing
        used = self.skip
        if chunked:
            parsed = _dechunk(self.buf, used)
            if parsed is None:
                return None
            used += parsed[1]
        del self.buf[:used]
        self.holed, self.skip = None, 0
        self.first_ts = None if not self.buf else ts_ns
        return line, headers, b"", first, missing      # never the partial body: it has a hole


def _headers(lines: list[str]) -> list[tuple[str, str]]:
    """The header lines after the start line as (lower-cased name, value), both stripped; a line
    without ':' is a name with an empty value."""
    # `for k, _, v in (x,)` is a plain assignment in a comprehension (no generator): half the cost
    return [(k.strip().lower(), v.strip()) for ln in lines[1:] for k, _, v in (ln.partition(":"),)]


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


def _chunk_remaining(buf: bytearray, pos: int) -> int | None:
    """Bytes still to come of the chunk (data and its CRLF) the buffer ends inside; None at a chunk
    boundary, inside a size line or in the trailers (no known size to step over)."""
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";")[0].strip() or b"0", 16)
        except ValueError:
            return None
        pos = eol + 2
        if size == 0:
            return None
        if len(buf) < pos + size + 2:
            return pos + size + 2 - len(buf)
        pos += size + 2


class Http1Decoder:
    """Decode one HTTP/1.1 connection into request/response calls."""

    protocol = "http1"

    def __init__(self, flow_id: int | None = None, joined: bool = False) -> None:
        self.flow_id = flow_id
        self.req = _Parser(False)
        self.resp = _Parser(True)
        self.pending: deque[Call] = deque()
        self.how: dict[Direction, str] = {}   # why the body being stepped over is missing (e.g. sendfile)
        self.unasked = 0   # responses to requests never seen (read before the capture): dropped, not paired
        self._before_first = joined   # a joined connection whose first request the decoder has not seen yet

    def feed(self, direction: Direction, ts_ns: int, data: bytes) -> list[Call]:
        parser = self.req if direction == "c2s" else self.resp
        if parser.first_ts is None:
            parser.first_ts = ts_ns
        if not parser.broken:            # after a gap it could not step over: nothing is buffered
            parser.buf += data
        return self._drain(ts_ns)

    def _drain(self, ts_ns: int, at_eof: bool = False) -> list[Call]:
        # (an empty parser with no body being stepped over has no message: most reads skip a side)
        while (self.req.buf or self.req.holed is not None) and (m := self.req.next_message(ts_ns)) is not None:
            line, headers, body, first, missing = m
            call = Call(protocol="http1", method=line.rsplit(" ", 1)[0], request_ts_ns=first,
                        flow_id=self.flow_id, kind="request", request_metadata=headers)
            if body:
                call.requests.append(Message("c2s", 0, ts_ns, body))
            if missing:
                call.status_message = _body_missing("request", missing, self.how.pop("c2s", None))
            self.pending.append(call)
        done: list[Call] = []
        # On a connection joined mid-stream, server bytes before the first request the capture saw answer
        # requests it never saw (read before it began): paired with the next request they would shift
        # every answer on the connection by one. (Once a request was seen, every answer has its request:
        # a server reads a request before it answers it.)
        if self.pending or self.req.buf or self.req.holed is not None:
            self._before_first = False
        while self._before_first and self.resp.buf and self.resp.holed is None and not self.resp.broken:
            m = self.resp.next_message(ts_ns, head_only=self._bodyless(), at_eof=at_eof)
            if m is None:
                break
            parts = m[0].split(" ", 2)
            if not (len(parts) > 1 and parts[1][:1] == "1"):     # an interim answer is not a response
                self.unasked += 1
        if self.resp.broken:             # nothing after the server-side gap can be paired
            while self.pending:
                call = self.pending.popleft()
                call.status, call.status_message = None, OUTCOME_UNKNOWN
                done.append(call)
            return done
        while self.pending and (self.resp.buf or self.resp.holed is not None):
            head_only = self.pending[0].method is not None and self.pending[0].method.startswith("HEAD ")
            m = self.resp.next_message(ts_ns, head_only=head_only or self._bodyless(), at_eof=at_eof)
            if m is None:
                break
            line, headers, body, first, missing = m
            parts = line.split(" ", 2)
            status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
            if status is not None and 100 <= status < 200:
                continue                 # interim response: the real one follows
            call = self.pending.popleft()
            if call.status_message is None:      # else: the request's body was not captured (kept)
                call.status_message = parts[2] if len(parts) > 2 else None
                if missing:
                    call.status_message = _body_missing("response", missing, self.how.pop("s2c", None))
                if self.resp.cut:
                    call.status_message = f"{call.status_message}; the connection closed {self.resp.cut} bytes before its end"
                    self.resp.cut = 0
            call.status = status
            call.response_metadata, call.response_ts_ns, call.end_ts_ns = headers, first, ts_ns
            if body:
                call.responses.append(Message("s2c", 0, ts_ns, body))
            done.append(call)
        if self.req.broken and not self.pending:
            self.resp.buf.clear()        # answers to requests lost in the gap: paired with nothing, not kept
        return done

    def _bodyless(self) -> bool:
        if self.resp.buf[9:13] == b"200 " and ((v := self.resp.buf[:9]) == b"HTTP/1.1 " or v == b"HTTP/1.0 "):
            return False                 # the usual answer, without the split
        head = bytes(self.resp.buf[:16]).split(b" ")
        return len(head) > 1 and head[1].isdigit() and (int(head[1]) in _BODYLESS_STATUS
                                                        or 100 <= int(head[1]) < 200)

    def gap(self, direction: Direction, nbytes: int | None = None, how: str | None = None) -> None:
        """`nbytes` (None: unknown) went missing: step over them inside a body of known length, else
        stop decoding that direction (module docstring)."""
        parser = self.req if direction == "c2s" else self.resp
        head_only = (direction == "s2c" and bool(self.pending) and self.pending[0].method is not None
                     and self.pending[0].method.startswith("HEAD "))
        if parser.step_over(nbytes, head_only=head_only or (direction == "s2c" and self._bodyless())):
            if how:
                self.how[direction] = how
            return
        if direction == "c2s" and not parser.broken and parser.holed is None:
            end = parser.buf.find(b"\r\n\r\n")
            if end >= 0:                 # its head is whole: it precedes everything lost, so it still pairs
                line = bytes(parser.buf[:end]).decode("latin-1").split("\r\n")
                call = Call(protocol="http1", method=line[0].rsplit(" ", 1)[0],
                            request_ts_ns=parser.first_ts or 0, flow_id=self.flow_id, kind="request",
                            request_metadata=_headers(line))
                call.status_message = _body_missing("request", None)   # the gap may hold more
                self.pending.append(call)
        elif direction == "c2s" and parser.holed is not None:
            line_, headers, first, _, _ = parser.holed
            call = Call(protocol="http1", method=line_.rsplit(" ", 1)[0], request_ts_ns=first,
                        flow_id=self.flow_id, kind="request", request_metadata=headers)
            call.status_message = _body_missing("request", None)
            self.pending.append(call)
        parser.broken, parser.holed, parser.skip = True, None, 0
        parser.buf.clear()

    def finish(self, ts_ns: int | None = None) -> list[Call]:
        done = self._drain(ts_ns or 0, at_eof=True)
        done += list(self.pending)       # requests never answered: status None
        self.pending.clear()
        return done


def _body_missing(side: str, nbytes: int | None, how: str | None = None) -> str:
    if how and nbytes is not None:       # sent where the recorder cannot read it (sendfile, splice)
        return f"{BODY_NOT_CAPTURED}: {side}, not captured: {how}, {nbytes} bytes"
    n = "an unknown number of" if nbytes is None else str(nbytes)
    return f"{BODY_NOT_CAPTURED}: {side}, {n} bytes missing in a gap"
