"""Production-like traffic generator: open loop, each call at its scheduled time, no torch.

    arrivals (seeded) --> for each: build snapshot --> wait until intended time --> send
                                                           |  unary: its own task
                                                           |  stream share: one of N long-lived
                                                           v  DecideStream lanes (matched by sequence_id)
    latency = done - intended (so a slow server cannot slow the load: no coordinated omission)

Requests are serialized once and sent as those exact bytes, so `--log-sent` can be checked byte for
byte against a capture.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any

from grpc import aio

from agent_under_test.arrivals import PATTERNS
from agent_under_test.errors import TrafficError
from agent_under_test.market import MarketSim, symbol_names
from agent_under_test.traffic_lanes import DECIDE, DECIDE_STREAM, CallResult, StreamLane, unary_call
from agent_under_test.traffic_report import TrafficReport, summarize

__all__ = ["CallResult", "TrafficReport", "run_traffic", "DECIDE", "DECIDE_STREAM"]
_SPIN_S = 0.0005  # sleep until this close to the send time, then yield-spin: sub-ms send lag


@dataclass
class TrafficConfig:
    target: str
    rate: float
    duration_s: float
    pattern: str = "poisson"
    seed: int = 0
    stream_share: float = 0.1
    symbols: int = 4
    streams: int = 4
    levels: int = 10
    ticks: int = 16
    call_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    max_calls: int | None = None
    log_sent: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def validate(self) -> None:
        if self.rate <= 0 or self.duration_s <= 0:
            raise TrafficError(f"--rate and --duration must be positive (got {self.rate}, {self.duration_s})")
        if self.pattern not in PATTERNS:
            raise TrafficError(f"--pattern {self.pattern!r}: choose one of {', '.join(PATTERNS.names())}")
        if not 0.0 <= self.stream_share <= 1.0:
            raise TrafficError(f"--stream-share {self.stream_share}: must be between 0 and 1")
        host, _, port = self.target.rpartition(":")
        if not host or not port.isdigit():
            raise TrafficError(f"--target {self.target!r}: expected HOST:PORT, e.g. 127.0.0.1:50051")


def _open_log(path: str) -> IO[str]:
    # What we sent is production-like data: owner-only.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    return os.fdopen(fd, "w", buffering=1 << 16)


async def _wait_until(target_ns: int, stop: threading.Event) -> bool:
    while True:
        left = (target_ns - time.monotonic_ns()) / 1e9
        if stop.is_set():
            return False
        if left <= 0:
            return True
        # Chunks of at most 100 ms so a stop request is seen quickly even at low rates.
        await asyncio.sleep(min(left - _SPIN_S, 0.1) if left > _SPIN_S else 0)


async def _connect(cfg: TrafficConfig) -> aio.Channel:
    tls = cfg.extra.get("tls")  # a replay.senders.tls.TlsConfig (`shadowtest traffic --tls ...`), or None
    channel = aio.insecure_channel(cfg.target) if tls is None else \
        aio.secure_channel(cfg.target, tls.grpc_credentials(), options=tls.grpc_options())
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout=cfg.connect_timeout_s)
    except TimeoutError as exc:
        await channel.close()
        why = "is the agent running (`shadowtest agent serve`)?" if tls is None else \
            "over TLS: is it running, and do its certificate and name fit --ca, --server-name, --cert?"
        raise TrafficError(f"cannot connect to {cfg.target} within {cfg.connect_timeout_s:g} s; {why}") from exc
    return channel


class _Sender:
    """Sends one call (unary task or stream lane), records its result and logs the exact bytes."""

    def __init__(self, channel: aio.Channel, cfg: TrafficConfig) -> None:
        self._decide = channel.unary_unary(DECIDE)  # bytes in, bytes out: we send exactly what we logged
        n_lanes = cfg.streams if cfg.stream_share > 0 else 0
        self.lanes = [StreamLane(channel, i, cfg.call_timeout_s) for i in range(n_lanes)]
        self._log = _open_log(cfg.log_sent) if cfg.log_sent else None
        self._timeout_s = cfg.call_timeout_s
        self._tasks: set[asyncio.Task[None]] = set()
        self.results: list[CallResult] = []

    def send(self, seq: int, payload: bytes, lane: StreamLane | None, intended_ns: int) -> None:
        res = CallResult(intended_ns, time.monotonic_ns(), 0, DECIDE_STREAM if lane else DECIDE, "", seq,
                         lane.index if lane else None)
        self.results.append(res)
        if self._log:
            self._log.write(json.dumps({"t_ns": res.sent_ns, "wall_ns": time.time_ns(), "method": res.method,
                                        "sequence_id": seq, "request_b64": base64.b64encode(payload).decode(),
                                        "stream": res.stream}) + "\n")
        if lane:
            lane.send(payload, res)
            return
        task = asyncio.get_running_loop().create_task(unary_call(self._decide, payload, res, self._timeout_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish(self) -> None:
        """Wait for every outstanding call (each bounded by the call timeout), close the log."""
        try:
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await asyncio.gather(*(lane.close() for lane in self.lanes), return_exceptions=True)
        finally:
            self.close_log()

    def close_log(self) -> None:
        if self._log and not self._log.closed:
            self._log.close()


async def _drive(cfg: TrafficConfig, stop: threading.Event) -> tuple[list[CallResult], int, int]:
    rng = random.Random(cfg.seed)
    sim = MarketSim(random.Random(rng.random()), symbol_names(cfg.symbols), levels=cfg.levels, ticks=cfg.ticks)
    channel = await _connect(cfg)
    sender = _Sender(channel, cfg)
    limit = cfg.max_calls if cfg.max_calls is not None else int(cfg.rate * cfg.duration_s * 3) + 100
    start_ns = time.monotonic_ns() + 5_000_000  # a little head room to build the first request
    try:
        for seq, offset in enumerate(PATTERNS[cfg.pattern](cfg.rate, cfg.duration_s, rng), start=1):
            if seq > limit:
                break
            lanes = sender.lanes
            lane = lanes[rng.randrange(len(lanes))] if lanes and rng.random() < cfg.stream_share else None
            payload = sim.next(seq).SerializeToString()  # built before waiting: the send itself is cheap
            intended = start_ns + int(offset * 1e9)
            if not await _wait_until(intended, stop):
                break
            sender.send(seq, payload, lane, intended)
        end_ns = time.monotonic_ns()
        await sender.finish()
    finally:
        sender.close_log()  # also on an error mid-run: what was sent so far stays on disk
        await channel.close()
    return sender.results, start_ns, end_ns


def run_traffic(target: str, rate: float, duration_s: float, pattern: str = "poisson", seed: int = 0,
                stream_share: float = 0.1, *, stop: threading.Event | None = None, **options: Any) -> TrafficReport:
    """Send open-loop traffic to `target` and report what happened.

    Args:
        target: "host:port" of a TradingAgent server.
        rate: mean calls/s (unary calls plus stream messages); duration_s: how long to send.
        pattern: "poisson" or "bursty"; seed: fixes the schedule, symbols, prices and stream choice.
        stream_share: fraction of calls sent as DecideStream messages (over `streams` lanes).
        stop: set it (from any thread) to stop sending early; outstanding calls still complete.
        **options: symbols, streams, levels, ticks, call_timeout_s, connect_timeout_s, max_calls,
            log_sent (path).

    Runs its own event loop, so call it from any thread (not from inside a running loop).

    Raises:
        TrafficError: bad options, or the target accepts no connection within connect_timeout_s.
    """
    cfg = TrafficConfig(target, rate, duration_s, pattern, seed, stream_share, **options)
    cfg.validate()
    results, start_ns, end_ns = asyncio.run(_drive(cfg, stop or threading.Event()))
    return summarize(cfg.target, cfg.pattern, cfg.seed, cfg.rate, cfg.duration_s, results, start_ns, end_ns)

