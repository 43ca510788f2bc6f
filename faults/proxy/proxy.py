"""A proxy (listener -> upstream) and the connections it carries, each with two toxic links.

A connection's two sockets are its own (`flow.Sock`); each direction (`flow.Flow`) reads its source and
moves what it read by the fast path (no chunk, no tap, no link) while its gate (`Connection._gate_up`,
`_gate_down`) allows: no call tap on the connection, its protocol detected, no toxic and nothing queued
on that direction's link. Otherwise, and from the first read after a toxic is added, bytes take the
chunk path: the tap (HTTP/1.x, HTTP/2), then the link's toxic stages and writer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import struct
from collections import OrderedDict
from typing import Any

from faults.proxy.calls import CALL_TOXICS, CallRule
from faults.proxy.channel import CLOSE, EOF, RESET, Chunk
from faults.proxy.flow import Flow, Listener, Sock, dial
from faults.proxy.h1tap import H1Tap, looks_like_http1
from faults.proxy.h2tap import EffectRule, H2Tap
from faults.proxy.link import Link
from faults.proxy.model import ApiError, ToxicSpec
from faults.proxy.toxics import ToxicEffect
from wire.h2 import PREFACE

log = logging.getLogger(__name__)
_EARLY_LIMIT = 1 << 20
TAP_COUNTS = ("calls_seen", "calls_delayed", "calls_failed", "calls_cut")   # what each tap counts
FLOW_COUNTS = ("fast_bytes", "spliced_bytes", "chunk_bytes", "to_fast", "to_chunk")  # what each direction counts
_WRITE_HIGH = 1 << 20  # server bytes kept until we know whether the connection speaks HTTP/2
EFFECTS_KEPT = 256     # toxic names whose measured effect a proxy keeps (the newest), removed or not


class EffectLog:
    """What each toxic of one proxy was measured to do, by toxic name; kept after the toxic is removed,
    for the newest EFFECTS_KEPT names (a name added again starts a fresh record)."""

    def __init__(self, limit: int = EFFECTS_KEPT) -> None:
        self.limit = limit
        self._by_name: OrderedDict[str, ToxicEffect] = OrderedDict()

    def start(self, spec: ToxicSpec) -> ToxicEffect:
        """A fresh record for a toxic just added."""
        self._by_name.pop(spec.name, None)
        effect = self._by_name[spec.name] = ToxicEffect(spec.type, spec.stream, spec.toxicity, spec.attributes)
        while len(self._by_name) > self.limit:
            self._by_name.popitem(last=False)
        return effect

    def of(self, spec: ToxicSpec) -> ToxicEffect:
        """The record of a toxic in force (started when missing: a toxic added before the log was)."""
        effect = self._by_name.get(spec.name)
        return effect if effect is not None else self.start(spec)

    def updated(self, spec: ToxicSpec) -> None:
        """A PATCH changed what is asked; what was done so far stays counted."""
        effect = self.of(spec)
        effect.toxicity, effect.attributes = spec.toxicity, dict(spec.attributes)

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {name: e.to_json() for name, e in self._by_name.items()}


def split_hostport(addr: str) -> tuple[str, int]:
    """'host:port', '[v6]:port' or ':port' -> (host, port); raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep:
        raise ValueError(f"address {addr}: missing port")
    if port and not port.isdigit():
        raise ValueError(f"address {addr}: invalid port")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port or 0)


class Connection:
    """client <-> proxy <-> upstream, with `up` (client->upstream) and `down` links."""

    def __init__(self, proxy: Proxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.loop = asyncio.get_running_loop()
        self.client = Sock(self.loop, client, "client", _WRITE_HIGH)
        self.client.on_lost = self.on_lost
        self.rng = random.Random(proxy.rng.getrandbits(64))
        self.upstream: Sock | None = None
        self.up: Link | None = None
        self.down: Link | None = None
        self.up_flow: Flow | None = None
        self.down_flow: Flow | None = None
        self.tap: H2Tap | H1Tap | None = None
        self._proto_known = False
        self._early_down: list[bytes] = []
        self._pre: list[tuple[str, bytes | None]] = []
        self._lost: set[str] = set()
        self._ended: set[str] = set()
        self._call_draws: dict[int, bool] = {}
        self.closed = False
        proxy.connections.add(self)
        self._open_task = self.loop.create_task(self._open())
        self._open_task.add_done_callback(self._opened)

    def _opened(self, task: asyncio.Task[None]) -> None:
        """Whatever went wrong while dialling, the client is closed, never left waiting."""
        if task.cancelled():
            return self.close()
        exc = task.exception()
        if exc is not None:
            log.warning("proxy %s: connection to %s failed: %r", self.proxy.name, self.proxy.upstream, exc)
            self.close()

    async def _open(self) -> None:
        try:
            host, port = split_hostport(self.proxy.upstream)
            sock = await dial(self.loop, host, port)
        except (OSError, ValueError, OverflowError) as exc:
            # One line, and the client is closed at once (as Toxiproxy does), never held open.
            log.warning("proxy %s: upstream %s unreachable: %s", self.proxy.name, self.proxy.upstream, exc)
            return self.close()
        if self.closed:  # the proxy was disabled while we dialled
            sock.close()
            return
        up_s, cl_s = Sock(self.loop, sock, "upstream", _WRITE_HIGH), self.client
        self.upstream = up_s
        up_s.on_lost = self.on_lost
        effect_of = self.proxy.effects.of
        self.up = up = Link(up_s.write, lambda k: self._end("upstream", k), self._pause_client, self.close,
                            effect_of)
        self.down = down = Link(cl_s.write, lambda k: self._end("downstream", k), self._pause_upstream,
                                self.close, effect_of)
        up_s.on_write_paused = up.set_dest_paused
        cl_s.on_write_paused = down.set_dest_paused
        self.up_flow = Flow(cl_s, up_s, self._gate_up, self.on_data, self.on_eof)
        self.down_flow = Flow(up_s, cl_s, self._gate_down, self.on_data, self.on_eof)
        up.build(self.proxy.stage_specs("upstream"), self.rng)
        down.build(self.proxy.stage_specs("downstream"), self.rng)
        for role, data in self._pre:
            self.on_data(role, data) if data is not None else self.on_eof(role)
        self._pre.clear()
        if not self.closed:
            self.up_flow.start()
            self.down_flow.start()

    def _gate_up(self) -> bool:
        """Whether the upstream direction may move its next read by the fast path: nothing would look
        at it (no call tap, the protocol detected, no toxic) and nothing is queued ahead of it."""
        up = self.up
        return self.tap is None and self._proto_known and up is not None and not up.stages and not up.tail.items

    def _gate_down(self) -> bool:
        """`_gate_up` for the downstream direction."""
        down = self.down
        return (self.tap is None and self._proto_known and down is not None and not down.stages
                and not down.tail.items)

    def _pause_client(self, paused: bool) -> None:
        if self.up_flow is not None:
            self.up_flow.pause(paused)

    def _pause_upstream(self, paused: bool) -> None:
        if self.down_flow is not None:
            self.down_flow.pause(paused)

    # --- socket events --------------------------------------------------------------------------
    def on_data(self, role: str, data: bytes) -> None:
        if self.up is None or self.down is None:
            self._pre.append((role, data))
            return
        if role == "client":
            if not self._proto_known:
                self._detect(data)
            if self.tap is not None:
                self.tap.feed_up(data)
            else:
                self.up.push(Chunk(data, self.loop.time()))
            return
        if not self._proto_known:
            self._early_down.append(data)
            if sum(map(len, self._early_down)) > _EARLY_LIMIT:
                self._proto_known, self._early_down = True, []
        if self.tap is not None:
            self.tap.feed_down(data)
        else:
            self.down.push(Chunk(data, self.loop.time()))

    def _detect(self, data: bytes) -> None:
        """Tap the connection when its first bytes say HTTP/2 (the preface) or HTTP/1.x (a request)."""
        self._proto_known = True
        up, down = self.up, self.down
        assert up is not None and down is not None
        loop = self.loop

        def push_up(b: bytes) -> None:
            up.push(Chunk(b, loop.time()))

        def push_down(b: bytes) -> None:
            down.push(Chunk(b, loop.time()))

        rng = random.Random(self.rng.getrandbits(64))
        if data[:len(PREFACE)] == PREFACE[:len(data)]:
            self.tap = H2Tap(push_up, push_down, self.call_rules, rng)
        elif looks_like_http1(data):
            self.tap = H1Tap(push_up, push_down, self.call_rules, rng,
                             end_down=lambda: down.push(Chunk(b"", loop.time(), EOF)))
        if self.tap is not None:
            for early in self._early_down:
                self.tap.sync_down(early)
        self._early_down = []

    def call_rules(self) -> list[CallRule]:
        """The call toxics active on this connection (toxicity drawn once per connection and version)."""
        rules: list[CallRule] = []
        for spec in self.proxy.toxics:
            if spec.toxic.stage:
                continue
            key = id(spec)
            if key not in self._call_draws:
                self._call_draws[key] = self.rng.random() < spec.toxicity
            if self._call_draws[key]:
                kind, proto = CALL_TOXICS[spec.type]
                rules.append(EffectRule(kind, spec.attributes, proto, self.proxy.effects.of(spec)))
        return rules

    def on_eof(self, role: str) -> None:
        if self.up is None or self.down is None:
            self._pre.append((role, None))
            return
        if role == "client":
            up = self.up
            if self.tap is not None:
                self.tap.end_up(lambda: up.push(Chunk(b"", self.loop.time(), EOF)))
            else:
                up.push(Chunk(b"", self.loop.time(), EOF))
        else:
            if self.tap is not None:
                self.tap.eof_down()
            self.down.push(Chunk(b"", self.loop.time(), EOF))

    def on_lost(self, role: str) -> None:
        self._lost.add(role)
        if not self.closed and self.up is not None:
            self.on_eof(role)  # a reset or vanished peer ends its direction like an EOF
        if len(self._lost) == 2 or (self.up is None and role == "client"):
            self.close()

    # --- ends -----------------------------------------------------------------------------------
    def _end(self, direction: str, kind: int) -> None:
        if kind == RESET:
            return self.reset()
        if kind == CLOSE:
            return self.close()
        dest = self.upstream if direction == "upstream" else self.client
        if dest is not None and not dest.is_closing() and dest.can_write_eof():
            try:
                dest.write_eof()
            except OSError:
                pass
        self._ended.add(direction)
        source = "client" if direction == "upstream" else "upstream"
        # Both directions done, or this direction's source socket is gone entirely (so nothing of the
        # other direction can reach it any more): close everything, as Toxiproxy does.
        if len(self._ended) == 2 or source in self._lost:
            self.close()

    def close(self) -> None:
        """Close both sockets (buffered bytes are still flushed) and stop the links."""
        if self.closed:
            return
        self.closed = True
        for t in (self.client, self.upstream):
            if t is not None:
                t.close()
        for link in (self.up, self.down):
            if link is not None:
                link.stop()
        self.proxy.connections.discard(self)
        for key, value in self.call_counts().items():
            self.proxy.closed_totals[key] += value
        for flow in (self.up_flow, self.down_flow):
            if flow is not None:
                for key in FLOW_COUNTS:
                    self.proxy.closed_flows[key] += getattr(flow, key)

    def call_counts(self) -> dict[str, int]:
        """This connection (1) and the calls its tap saw, delayed, failed and cut short (0 untapped)."""
        return {"connections": 1} | {k: getattr(self.tap, k, 0) for k in TAP_COUNTS}

    def flow_stats(self) -> dict[str, dict[str, int | str]]:
        """Per direction: the way its last read went (fast or chunk), bytes each way, switches."""
        return {name: flow.stats() for name, flow in (("upstream", self.up_flow), ("downstream", self.down_flow))
                if flow is not None}

    def reset(self) -> None:
        """Abort both sockets with SO_LINGER 0, so each peer gets a TCP RST."""
        for t in (self.client, self.upstream):
            if t is None:
                continue
            if not t.closed:
                try:
                    t.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            t.abort()
        self.close()


class Proxy:
    """One named proxy: its listener, its toxics (in API order) and its live connections."""

    def __init__(self, name: str, listen: str, upstream: str, rng: random.Random) -> None:
        self.name, self.listen, self.upstream = name, listen, upstream
        self.enabled = False
        self.rng = rng
        self.toxics: list[ToxicSpec] = []
        self.connections: set[Connection] = set()
        self.closed_totals = dict.fromkeys(("connections", *TAP_COUNTS), 0)
        self.closed_flows = dict.fromkeys(FLOW_COUNTS, 0)
        self.effects = EffectLog()
        self._server: Listener | None = None

    def to_json(self, with_toxics: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "listen": self.listen, "upstream": self.upstream,
                               "enabled": self.enabled}
        if with_toxics:
            out["toxics"] = self.toxic_array()
        return out

    def toxic_array(self) -> list[dict[str, Any]]:
        """Upstream toxics first, then downstream, each in the order added (as Toxiproxy lists them)."""
        return [t.to_json() for d in ("upstream", "downstream") for t in self.toxics if t.stream == d]

    def stage_specs(self, direction: str) -> list[ToxicSpec]:
        return [t for t in self.toxics if t.stream == direction and t.toxic.stage]

    def _accepted(self, sock: socket.socket) -> None:
        Connection(self, sock)

    def flow_stats(self) -> dict[str, Any]:
        """How each live connection's directions move bytes (`Connection.flow_stats`), and the byte and
        switch counts of the closed ones summed."""
        return {"connections": [c.flow_stats() for c in self.connections], "closed": dict(self.closed_flows)}

    def find(self, name: str) -> ToxicSpec | None:
        return next((t for t in self.toxics if t.name == name), None)

    async def start(self) -> None:
        if self.enabled:
            return
        listener = Listener(asyncio.get_running_loop(), self._accepted)
        try:
            host, port = split_hostport(self.listen)
            await listener.start(host, port)
        except (OSError, ValueError, OverflowError) as exc:
            raise ApiError(f"listen tcp {self.listen}: {exc}", 500) from exc
        self._server = listener
        sock_host, sock_port = listener.sockets[0].getsockname()[:2]
        self.listen = f"{sock_host}:{sock_port}" if ":" not in sock_host else f"[{sock_host}]:{sock_port}"
        self.enabled = True

    async def stop(self) -> None:
        """Stop listening and close every connection (as Toxiproxy's disable does)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self.connections):
            conn.close()
        self.enabled = False

    async def _each_link(self, direction: str, op: str, *args: Any) -> None:
        links = [(c.up if direction == "upstream" else c.down) for c in list(self.connections)]
        await asyncio.gather(*(getattr(link, op)(*args) for link in links if link is not None))

    async def add_toxic(self, spec: ToxicSpec) -> None:
        self.toxics.append(spec)
        self.effects.start(spec)
        if spec.toxic.stage:
            await self._each_link(spec.stream, "add", spec, self.rng)

    async def update_toxic(self, spec: ToxicSpec) -> None:
        i = next(i for i, t in enumerate(self.toxics) if t.name == spec.name)
        self.toxics[i] = spec
        self.effects.updated(spec)
        if spec.toxic.stage:
            await self._each_link(spec.stream, "update", spec)

    async def remove_toxic(self, name: str) -> None:
        spec = self.find(name)
        if spec is None:
            return
        self.toxics.remove(spec)
        if spec.toxic.stage:
            await self._each_link(spec.stream, "remove", name)
