"""Distributed replay with Locust: each worker replays its shard of a recording with the original timing.

    locust master (--expect-workers N) --spawn--> worker i (index from the master's ack)
                                                   ReplayUser: plan shard (i, N) -> gevent sleep/spin
                                                   -> one greenlet per call -> events.request (stats, UI)

    locust -f replay/locust_user.py --master --headless -u 2 -r 2 --expect-workers 2 --run-time 90s \
        --shadow-recording prod.rec --host 127.0.0.1:50051
    locust -f replay/locust_user.py --worker --master-host MASTER   # on each worker machine

Run one user per worker (`-u` = number of workers): the first user on a worker claims the worker's
shard, further users stop at once. Every worker starts at the master's spawn time plus
--shadow-start-delay, so shards line up (hosts need synchronised clocks, as Locust itself assumes).

gevent isolation: this module imports locust (which monkey-patches) and grpc's gevent support first,
and uses only the pure parts of replay (schedule, plan, metadata filter) -- never the asyncio engine.
"""

from __future__ import annotations

# ruff: noqa: I001  -- order matters: locust monkey-patches for gevent on import, before grpc loads
from locust import User, events, task
from locust.exception import StopUser

import gevent
import gevent.pool
import grpc
import grpc.experimental.gevent as grpc_gevent

import time
from typing import Any

from replay.plan import plan_from_recording
from replay.schedule import PlannedCall, ScheduleOptions
from replay.senders.base import replayable_metadata

grpc_gevent.init_gevent()
_SPIN_S = 0.0003
_claimed = False  # one replaying user per worker process


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    group = parser.add_argument_group("shadowtest replay")
    group.add_argument("--shadow-recording", default="", help="recording file to replay (same path on every worker)")
    group.add_argument("--shadow-speed", type=float, default=1.0, help="time multiplier 0.1-100")
    group.add_argument("--shadow-loop", type=int, default=1, help="play the recording N times")
    group.add_argument("--shadow-timeout", type=float, default=10.0, help="per-call timeout in seconds")
    group.add_argument("--shadow-start-delay", type=float, default=1.0, help="seconds after the spawn to start")
    group.add_argument("--shadow-max-in-flight", type=int, default=256, help="per connection (drop-new)")
    group.add_argument("--shadow-window", default="", help="A:B, only seconds A to B of the recording")
    group.add_argument("--shadow-method", default="", help="only these methods (comma separated)")


def sleep_until(deadline: float) -> None:
    """gevent-friendly sleep-then-spin until time.time() >= deadline (yields while spinning)."""
    remaining = deadline - time.time()
    if remaining > _SPIN_S:
        gevent.sleep(remaining - _SPIN_S)
    while time.time() < deadline:
        gevent.sleep(0)


def shard_of(environment: Any) -> tuple[int, int]:
    """(worker index, workers) on a Locust worker; (0, 1) when running locally."""
    runner = environment.runner
    workers = int(getattr(environment.parsed_options, "expect_workers", 1) or 1)
    index = getattr(runner, "worker_index", -1)
    return (index, workers) if index >= 0 and type(runner).__name__ == "WorkerRunner" else (0, 1)


def _window(text: str | None) -> tuple[float, float] | None:
    """--shadow-window START:END (recorded seconds) -> (start, end); empty -> None."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(f"--shadow-window {text!r}: expected START:END in seconds")
    return float(start), float(end)


class ReplayUser(User):
    """Replays this worker's shard once (or --shadow-loop times) and then stops."""

    abstract = False

    def on_start(self) -> None:
        global _claimed
        if _claimed:
            raise StopUser()
        _claimed = True
        self.opts = self.environment.parsed_options
        self.channels: dict[str, grpc.Channel] = {}
        self.in_flight: dict[str, int] = {}

    @task
    def replay(self) -> None:
        shard = shard_of(self.environment)
        window = _window(self.opts.shadow_window)
        methods = frozenset(m for m in self.opts.shadow_method.split(",") if m)
        sched = ScheduleOptions(speed=self.opts.shadow_speed, loop=self.opts.shadow_loop, shard=shard,
                                window=window, methods=methods)
        rec, plan = plan_from_recording(self.opts.shadow_recording, sched)
        spawned = getattr(self.environment.runner, "last_received_spawn_timestamp", None) or time.time()
        t0 = spawned + self.opts.shadow_start_delay
        group = gevent.pool.Group()
        try:
            for planned in plan:
                sleep_until(t0 + planned.due_ns / 1e9)
                group.spawn(self._send, planned, t0 + planned.due_ns / 1e9)
        finally:
            rec.close()
        group.join()
        for ch in self.channels.values():
            ch.close()
        raise StopUser()

    def _channel(self, connection: str) -> grpc.Channel:
        if connection not in self.channels:
            self.channels[connection] = grpc.insecure_channel(
                self.environment.host, options=[("grpc.use_local_subchannel_pool", 1)])
        return self.channels[connection]

    def _send(self, p: PlannedCall, intended: float) -> None:
        name = p.method or p.protocol
        if self.in_flight.get(p.connection, 0) >= self.opts.shadow_max_in_flight:
            self._fire(name, intended, 0, RuntimeError("not_sent: in_flight_cap"))
            return
        self.in_flight[p.connection] = self.in_flight.get(p.connection, 0) + 1
        try:
            size = self._invoke(p, intended)
            self._fire(name, intended, size, None)
        except grpc.RpcError as exc:
            self._fire(name, intended, 0, exc)
        finally:
            self.in_flight[p.connection] -= 1

    def _invoke(self, p: PlannedCall, intended: float) -> int:
        ch, md = self._channel(p.connection), tuple(replayable_metadata(p.metadata)) or None
        timeout = self.opts.shadow_timeout + p.last_offset_ns / 1e9

        def requests() -> Any:
            for m in p.messages:  # each stream message at its own time
                sleep_until(intended + m.offset_ns / 1e9)
                yield m.data
        if p.kind in ("client_stream", "bidi"):
            if p.kind == "client_stream":
                return len(ch.stream_unary(p.method)(requests(), timeout=timeout, metadata=md))
            return sum(len(r) for r in ch.stream_stream(p.method)(requests(), timeout=timeout, metadata=md))
        if p.kind == "server_stream":
            return sum(len(r) for r in ch.unary_stream(p.method)(p.messages[0].data, timeout=timeout, metadata=md))
        return len(ch.unary_unary(p.method)(p.messages[0].data, timeout=timeout, metadata=md))

    def _fire(self, name: str, intended: float, size: int, exc: Exception | None) -> None:
        # Response time from the intended send time: coordinated omission corrected.
        self.environment.events.request.fire(
            request_type="grpc", name=name, response_time=(time.time() - intended) * 1000,
            response_length=size, exception=exc, context={})
