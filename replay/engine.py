"""The open-loop replayer: every send at its intended time, however slow the target is.

    plan (lazy) --lookahead--> heap of timed events --sleep_until/spin--> dispatch every overdue event
                                  start call: in-flight cap check -> sender.start (written now)
                                              or task(sender.call) -> CallResult
                                  stream message: released into its call's request queue

One loop sleeps; everything due goes out on each wake-up, so a slow response never delays a later
send (calls run as independent tasks). Each call's backstop deadline (senders enforce timeout_s
themselves) sits in one heap swept on every wake-up, instead of a timer per call.

In-flight cap policy (per connection): a call that finds `max_in_flight` calls still outstanding on its connection is NOT sent and is counted as
not_sent/in_flight_cap -- shedding instead of queueing keeps memory bounded and the schedule honest.

Never blind: a gRPC or HTTP/2 call whose method is unknown (recorded on a connection joined mid-stream
and not named by the file's method map or `--method-map`) is not sent; it is counted as
not_sent/unknown_method (sending it to some guessed path would only measure UNIMPLEMENTED).
"""

from __future__ import annotations

import asyncio
import functools
import gc
import heapq
import itertools
import logging
import threading
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack

from replay import report as report_mod
from replay.clock import TimerfdClock, real_clock, run_ticks
from replay.options import ReplayOptions
from replay.schedule import PlannedCall, PlannedMessage, ScheduleOptions
from replay.senders import Sender, SendOutcome, get_sender
from replay.senders.headers import HeaderPolicy
from replay.senders.tls import TlsConfig
from replay.stats import CallResult, RunStats
from replay.target import check_target
from wire.clock import Clock

if TYPE_CHECKING:   # replay.compare pulls in protobuf: imported only when a run compares
    from capture.integrity import Integrity
    from replay.compare import Comparer, CompareSpec

log = logging.getLogger(__name__)
_WAKE_NS = 100_000_000  # the longest sleep between stop checks
# During a run the cyclic collector runs rarely: a call's objects are freed by reference counting
# (the engine and the h2 sender break their own cycles when a call ends), and each collection
# pass stalls every send due meanwhile. At the default (700, 10, 10) a 2,000 calls/s run did ~170
# young passes (0.1-2 ms each) and ~16 middle ones (1-6 ms) in 6 s; at these thresholds, 3.
_GC_THRESHOLDS = (50_000, 20, 100)
_WARM_S = 1.0  # the longest wait for connections before the clock starts
_READ_MARGIN_NS = 200_000  # read ahead only while the next send is further away than this
# The lookahead is refilled once less than this share of it is read (then up to all of it), not topped
# up by a call or two per wake-up: the reading code runs for dozens of calls at a time while it is in
# the CPU's caches. At 1,500 calls/s that cut client CPU by ~11 us per call (140 -> 129, medians of 8
# interleaved runs on a busy 2-core host). A call still enters the lookahead at least 3/4 of it
# (150 ms by default) before it is due, so its connection opens in time.
_REFILL_AT = 0.75
# A refill reads this many calls per wake-up as reading used to (the margin only), and more only while
# the next send is further away than the margin plus the slowest recent read (a batch from SQLite): a
# burst then makes a send late no more often, and by no more, than a call or two per wake-up did.
_FREE_READS = 2
# gRPC goes to the lean h2 sender by default: the same outcomes as grpcio's (tested call kind by call
# kind against real servers) at about half the client CPU per call and a tighter send lag; `--sender
# grpc` replays through grpcio itself. Plain HTTP/2 (not gRPC) goes to the h2 sender too, which sends
# it as recorded (method, path, headers, body) and reports HTTP statuses as the http1 sender does.
_PROTOCOL_SENDER = {"grpc": "h2", "http2": "h2", "http1": "http1", "tcp": "tcp"}
_LEAN_SENDERS = frozenset({"h2", "http1", "tcp"})  # no grpcio: safe on uvloop
_NAMED = frozenset({"grpc", "http2"})  # protocols whose calls need a method (:path) to be sent
_BODYLESS = frozenset({"http1", "http2"})  # HTTP requests may have no body (GET); gRPC calls never do


@dataclass(eq=False, slots=True)  # identity hashing: live calls sit in a set
class _Live:
    planned: PlannedCall
    intended_ns: int
    sent_ns: int
    queue: asyncio.Queue[PlannedMessage | None] | None
    task: asyncio.Task[None] | None = None  # the call's task (Sender.call) ...
    cancel: Callable[[], None] | None = None  # ... or its cancel function (Starter.start)
    timed_out: bool = False  # set by the backstop sweep just before it cancels the call
    aborted: bool = False  # cancelled by the engine: the outcome says why, not the sender
    finished: bool = False  # its backstop entry is stale (dropped lazily, see _compact)


# (due_ns, tie-break sequence, a call to start or a live call, the stream message to release or None)
_Timed = tuple[int, int, PlannedCall | _Live, PlannedMessage | None]


class ReplayRun:
    """Replay a recording (path) or a plan (iterable of PlannedCall) to `target`.

    Args:
        source: a recording path, or an iterable of PlannedCall in due order (already sharded).
        target: "host:port"; checked against the allowlist (TargetNotAllowedError).
        options: ReplayOptions. on_result: called with each CallResult in the run's thread; its
            exceptions are logged, never raised. clock: defaults to MonotonicClock.

    `run()` blocks and returns the ReplayReport; `stop()` (any thread) ends it early: unsent calls
    count as not_sent/stopped, in-flight calls get `stop_grace_s` and are then cancelled.
    """

    def __init__(self, source: str | Path | Iterable[PlannedCall], target: str,
                 options: ReplayOptions | None = None, *,
                 on_result: Callable[[CallResult], None] | None = None, clock: Clock | None = None) -> None:
        self.options = options or ReplayOptions()
        self.target = check_target(target, self.options.allow_targets)
        self.source = source
        self.on_result = on_result
        self._own_clock = clock is None
        self.clock = clock or real_clock(None if self.options.spin_us < 0 else self.options.spin_us * 1000)
        self.stats = RunStats()
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._senders: dict[str, Sender] = {}
        self._by_conn: dict[str, int] = defaultdict(int)
        self._live: set[_Live] = set()
        self._prepared: set[str] = set()
        self._incomplete = 0  # planned calls recorded without an outcome (capture cut off mid-call)
        self._hidden = 0      # planned calls whose recorded status HPACK hid (joined connection)
        self._seq = itertools.count()
        self._backstops: list[tuple[float, int, _Live]] = []  # (loop time, seq, call): the backstop heap
        self._stale = 0  # finished calls still in _backstops
        self._loop: asyncio.AbstractEventLoop | None = None
        self._idle: asyncio.Future[None] | None = None  # set when the last in-flight call ends (_drain)
        self._spawned = False  # this tick started a call as a task (it sends after the tick)
        self._heap: list[_Timed] = []
        self._plan: Iterator[PlannedCall] = iter(())
        self._pending: PlannedCall | None = None
        self._refilling = False  # reading the lookahead up to full (see _REFILL_AT)
        self._slowest_read = 0  # ns: the longest recent read of one call from the plan (see _read_plan)
        self._warming: list[Awaitable[object]] | None = []  # connections opening before t0
        self.t0_ns = 0
        self.end_ns = 0
        self.comparer: Comparer | None = None   # options.compare, built (at the start of the run)

    # ---- public -----------------------------------------------------------------------------
    def run(self) -> report_mod.ReplayReport:
        """Replay to completion (or stop) and return the report; safe to call from any thread."""
        with asyncio.Runner(loop_factory=self._loop_factory()) as runner:
            runner.run(self.run_async())
        return self.report()

    def _loop_factory(self) -> Callable[[], asyncio.AbstractEventLoop] | None:
        """uvloop's factory when options.event_loop asks for it (see ReplayOptions), else None."""
        choice = self.options.event_loop
        if choice not in ("auto", "asyncio", "uvloop"):
            raise ValueError(f"event_loop must be auto, asyncio or uvloop, not {choice!r}")
        sender = self.options.sender
        lean = (sender in _LEAN_SENDERS or (sender == "auto" and _LEAN_SENDERS.issuperset(_PROTOCOL_SENDER.values()))) \
            and self.options.compare is None
        if choice == "asyncio" or (choice == "auto" and not lean):
            return None
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ValueError("event_loop uvloop: uvloop is not installed (pip install uvloop)") from None
            return None
        return uvloop.new_event_loop

    def stop(self) -> None:
        """Ask a running replay to end early (thread-safe, idempotent)."""
        self._stop.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def report(self) -> report_mod.ReplayReport:
        problems = list(self.problems)
        if self._incomplete and isinstance(self.source, (str, Path)):  # generated plans have no outcomes
            problems.append(f"{self._incomplete} calls were recorded without their outcome (the capture "
                            f"ended mid-call or the connection broke): replayed, but their status is not compared")
        if self._hidden and isinstance(self.source, (str, Path)):
            problems.append(f"{self._hidden} calls' recorded status is unknown (their trailers referred to HPACK "
                            f"entries from before the capture joined): replayed, but their status is not compared")
        return report_mod.build(self.stats, self.t0_ns, self.end_ns, target=self.target,
                                options=self.options, problems=problems, comparer=self.comparer)

    async def run_async(self) -> None:
        """The run itself, for callers that already have an event loop."""
        from replay.compare import CompareSpec
        self._loop = asyncio.get_running_loop()
        thresholds = gc.get_threshold()
        gc.set_threshold(*_GC_THRESHOLDS)
        try:
            self._heap, self._plan = [], self._open_plan()
            if isinstance(self.options.compare, CompareSpec):
                # after the plan: the comparer is chosen by the recording's protocols (no reflection
                # probe, an HTTP/2 preface, goes to a target whose recording has no gRPC call)
                self.options.compare = self.options.compare.build(self.target, self._protocols())
            self.comparer = self.options.compare
            self._pending = next(self._plan, None)
            # Before the clock starts, read the first lookahead (skipping to a window, reading and
            # connecting must not count as lag) and wait, briefly, for its connections to open.
            self._read_plan(int(self.options.lookahead_s * 1e9))
            await self._warm_up()
            self.t0_ns = self.options.start_at_ns or self.clock.now_ns()
            await self._schedule_loop()
            await self._drain()
        finally:
            gc.set_threshold(*thresholds)
            self.end_ns = self.clock.now_ns()
            for sender in self._senders.values():
                await sender.close()
            if self._own_clock and isinstance(self.clock, TimerfdClock):
                self.clock.close()
            self._close_source()

    # ---- plan -------------------------------------------------------------------------------
    def _open_plan(self) -> Iterator[PlannedCall]:
        if not isinstance(self.source, (str, Path)):
            return iter(self.source)
        from capture.errors import RecordingError
        from replay.errors import PlanError
        from replay.plan import plan_from_recording
        try:
            found = self._integrity() if self.options.salvage else None
            self._recording, plan = plan_from_recording(self.source, self.options.schedule, salvage=found)
            if found is not None and not found.intact:
                self._count_lost(found)
        except RecordingError as exc:
            raise PlanError(f"cannot replay {self.source}: {exc}") from exc
        return plan

    def _integrity(self) -> Integrity:
        from capture.integrity import check
        assert isinstance(self.source, (str, Path))
        return check(self.source)

    def _count_lost(self, found: Integrity) -> None:
        """--salvage: the calls the damage cost, counted as not sent (damaged_recording) once per loop, by
        the first shard only (workers each read the whole file), and said in the problems."""
        from capture.integrity import calls_lost, loss_text
        self.problems += [p for p in found.problems if p not in self.problems]
        lost = calls_lost(self._recording, found)
        if lost is None:
            self.problems.append(f"{report_mod.DAMAGE_PREFIX}{loss_text(None)} ({found.problems[0]})")
            return
        self.problems.append(f"{report_mod.DAMAGE_PREFIX}{loss_text(lost)} (not sent: {report_mod.DAMAGED_RECORDING})")
        if lost and self.options.schedule.shard[0] == 0:
            n = lost * self.options.schedule.loop
            self.stats.scheduled += n
            self.stats.outcomes["not_sent"] += n
            self.stats.not_sent[report_mod.DAMAGED_RECORDING] += n

    def _protocols(self) -> frozenset[str] | None:
        """The protocols of the recording's calls (None for a plan given as calls)."""
        rec = getattr(self, "_recording", None)
        return None if rec is None else rec.call_protocols()

    def _close_source(self) -> None:
        rec = getattr(self, "_recording", None)
        if rec is not None:
            from replay.source import recording_problems
            self.problems.extend(p for p in recording_problems(rec) if p not in self.problems)
            rec.close()

    # ---- the scheduling loop ----------------------------------------------------------------
    async def _warm_up(self) -> None:
        """Wait up to _WARM_S for the connections the first lookahead opened (senders that can say
        when a connection is ready, see senders.base.Preparer); then no more waiting."""
        waiting, self._warming = [asyncio.ensure_future(w) for w in self._warming or ()], None
        if not waiting:
            return
        _, late = await asyncio.wait(waiting, timeout=_WARM_S)
        for w in late:  # an unreachable target: its calls will say so
            w.cancel()

    async def _schedule_loop(self) -> None:
        await run_ticks(self.clock, self._tick)
        if self._stop.is_set():
            self._count_unsent(self._heap, self._pending, self._plan)

    def _tick(self) -> int | None:
        """One wake-up: dispatch everything due, read the plan ahead; the next wake-up (clock ns), or
        None when the plan is done or the run stopped. Synchronous, so the clock may call it straight
        from its timer callback: the sends go out in the very loop step that noticed they were due.

        Reading the plan is what could delay a send (a batch of calls from SQLite), so calls due now
        are read and sent first, and the lookahead is filled only while the next send is more than
        `_READ_MARGIN_NS` away: a read can then be late by at most one small batch. It is refilled in
        bursts, once less than `_REFILL_AT` of it is read. Calls started as tasks send only when this
        returns, so after those the reading waits for the next tick."""
        if self._stop.is_set():
            return None
        self._sweep()
        heap = self._heap
        now = self.clock.now_ns() - self.t0_ns
        self._read_plan(now)
        self._spawned = False
        while heap and heap[0][0] <= now:
            due, _, item, msg = heapq.heappop(heap)
            if isinstance(item, PlannedCall):
                self._start(item, heap)
            elif item.task is not None and not item.task.done():
                self._release(item, msg, heap)
        lookahead = int(self.options.lookahead_s * 1e9)
        horizon, pending = now + lookahead, self._pending
        if pending is not None and (not heap or pending.due_ns <= now + lookahead * _REFILL_AT):
            self._refilling = True
        if self._refilling:
            if self._spawned and pending is not None and pending.due_ns <= horizon:
                return self.t0_ns + now  # read once the new tasks have sent: at once, after them
            self._read_plan(horizon, budget=True, guard_ns=self._slowest_read)
            self._refilling = self._pending is not None and self._pending.due_ns <= horizon
        if not heap:
            return None if self._pending is None else self.t0_ns + now
        return self.t0_ns + min(heap[0][0], now + _WAKE_NS)

    def _read_plan(self, until: int, budget: bool = False, guard_ns: int = 0) -> None:
        """Move planned calls due by `until` (run-relative ns) into the heap; always those due before
        the heap's first entry. With `budget`, stop once the next send is within the margin; after
        the first _FREE_READS calls, within the margin plus `guard_ns`. Keeps `_slowest_read`: the
        longest recent read of one call (ns), decaying."""
        heap, pending, clock, t0 = self._heap, self._pending, self.clock, self.t0_ns
        margin, slowest, n = _READ_MARGIN_NS, self._slowest_read, 0
        while pending is not None and (pending.due_ns <= until or not heap):
            if budget and heap and pending.due_ns > heap[0][0] \
                    and clock.now_ns() - t0 > heap[0][0] - (margin if n < _FREE_READS else margin + guard_ns):
                break
            n += 1
            heapq.heappush(heap, (pending.due_ns, next(self._seq), pending, None))
            self.stats.scheduled += 1
            if not _unnamed(pending):  # never sent: neither incomplete nor worth a connection
                unknown = pending.expected_status is None and pending.protocol != "tcp"
                self._hidden += unknown and pending.status_hidden
                self._incomplete += unknown and not pending.status_hidden
                self._prepare(pending)
            began = clock.now_ns()
            pending = next(self._plan, None)
            slowest -= slowest >> 6  # forgets a slow read within a few hundred calls
            slowest = max(slowest, clock.now_ns() - began)
        self._pending, self._slowest_read = pending, slowest

    def _count_unsent(self, heap: list[_Timed], pending: PlannedCall | None, plan: Iterator[PlannedCall]) -> None:
        for _, _, item, msg in heap:
            if isinstance(item, PlannedCall):
                self._not_sent(item, "stopped")
            elif msg is item.planned.messages[-1] and item.queue is not None:
                item.queue.put_nowait(None)  # end the stream so the call can finish
        for item in itertools.chain([pending] if pending else [], plan):
            self.stats.scheduled += 1
            self._not_sent(item, "stopped")

    def _start(self, planned: PlannedCall, heap: list[_Timed]) -> None:
        if _unnamed(planned):  # never sent blind (module docstring)
            self._not_sent(planned, "unknown_method")
            return
        if planned.request_body_missing:  # its body fell in a capture gap: never send an invented one
            self._not_sent(planned, "request_body_not_captured")
            return
        if not planned.messages and planned.protocol not in _BODYLESS:  # a damaged recording lost the request
            self._not_sent(planned, "no_request_in_recording")
            return
        if self._by_conn[planned.connection] >= self.options.max_in_flight:
            self._not_sent(planned, "in_flight_cap")
            return
        try:
            sender = self._sender_for(planned)
        except Exception:  # an unknown protocol is this call's problem, not the run's
            self._not_sent(planned, f"no_sender:{planned.protocol}")
            return
        live = _Live(planned, self.t0_ns + planned.due_ns, 0, None)
        self._by_conn[planned.connection] += 1
        self._live.add(live)
        assert self._loop is not None
        limit = self.options.timeout_s + planned.last_offset_ns / 1e9 + 1.0
        heapq.heappush(self._backstops, (self._loop.time() + limit, next(self._seq), live))
        if planned.last_offset_ns == 0 and self._started(sender, live):
            return
        if planned.last_offset_ns == 0:
            requests: AsyncIterator[PlannedMessage] = _Ready(planned.messages)  # no queue
        else:
            live.queue = asyncio.Queue()
            requests = _drain_queue(live.queue)
            for msg in planned.messages:
                if msg.offset_ns == 0:
                    self._release(live, msg, heap)
                else:
                    heapq.heappush(heap, (planned.due_ns + msg.offset_ns, next(self._seq), live, msg))
        live.task = self._loop.create_task(self._call(sender, live, requests))
        self._spawned = True

    def _started(self, sender: Sender, live: _Live) -> bool:
        """The fast path (senders.base.Starter): the sender writes the call right here, in this loop
        step, and reports its end through a callback: no task, and no loop hop between deciding to
        send and sending. False: the sender declined; use a task."""
        start = getattr(sender, "start", None)
        if start is None:
            return False
        live.sent_ns = now = self.clock.now_ns()
        try:
            cancel = start(live.planned, self.options.timeout_s, functools.partial(self._done, live))
        except Exception as exc:  # a sender bug must not lose the call from the accounting
            log.exception("sender failed on call %s", live.planned.index)
            self.stats.on_sent(live.intended_ns, now)
            self._finish(live, SendOutcome("error", type(exc).__name__, detail=str(exc)))
            return True
        if cancel is None:
            live.sent_ns = 0
            return False
        self.stats.on_sent(live.intended_ns, now)
        live.cancel = cancel
        return True

    def _done(self, live: _Live, out: SendOutcome) -> None:
        if not live.finished:
            self._finish(live, self._cancelled(live) if live.aborted else out)

    def _abort(self, live: _Live) -> None:
        """Cancel an in-flight call (backstop or stop); it is counted as its outcome says."""
        live.aborted = True
        if live.cancel is not None:
            cancel, live.cancel = live.cancel, None
            cancel()
        elif live.task is not None:
            live.task.cancel()

    @staticmethod
    def _cancelled(live: _Live) -> SendOutcome:
        return (SendOutcome("timeout", "CLIENT_TIMEOUT") if live.timed_out  # the backstop (_sweep)
                else SendOutcome("error", "CANCELLED", detail="stopped while in flight"))

    def _sweep(self) -> None:
        """Cancel calls past their backstop (on the loop's clock, like asyncio's own timeouts)."""
        heap = self._backstops
        if not heap or self._loop is None:
            return
        now = self._loop.time()
        while heap and heap[0][0] <= now:
            live = heapq.heappop(heap)[2]
            if live.finished:
                self._stale -= 1
            else:
                live.timed_out = True
                self._abort(live)

    def _release(self, live: _Live, msg: PlannedMessage | None, heap: list[_Timed]) -> None:
        assert live.queue is not None
        live.queue.put_nowait(msg)
        if msg is live.planned.messages[-1]:
            live.queue.put_nowait(None)

    def _prepare(self, planned: PlannedCall) -> None:
        """Open a connection when its first call enters the lookahead, so connecting is not lag."""
        if planned.connection in self._prepared:
            return
        self._prepared.add(planned.connection)
        try:
            sender = self._sender_for(planned)
        except Exception:  # reported when the call itself is due
            return
        prepare = getattr(sender, "prepare", None)  # an optional ability (see senders.base.Preparer)
        if prepare is not None:
            ready = prepare(planned.connection)
            if ready is not None and self._warming is not None:
                self._warming.append(ready)
            elif asyncio.iscoroutine(ready):
                ready.close()  # after the warm-up nobody waits: an unawaited coroutine would warn

    def _sender_for(self, planned: PlannedCall) -> Sender:
        name = self.options.sender
        if name == "auto":
            name = _PROTOCOL_SENDER.get(planned.protocol, planned.protocol)
        if name not in self._senders:
            extra: dict[str, object] = {}  # only when set: a registered factory need not know them
            if self.options.tls is not None:
                extra["tls"] = self.options.tls
            if self.options.headers is not None:
                extra["headers"] = self.options.headers
            self._senders[name] = get_sender(name, self.target, **{**self.options.sender_options, **extra})
        return self._senders[name]

    # ---- one call ---------------------------------------------------------------------------
    async def _call(self, sender: Sender, live: _Live, requests: AsyncIterator[PlannedMessage]) -> None:
        p = live.planned
        # The send time is taken here, when the call really starts, so lag includes the loop hop.
        live.sent_ns = self.clock.now_ns()
        self.stats.on_sent(live.intended_ns, live.sent_ns)
        try:
            out = await sender.call(p, requests, self.options.timeout_s)
        except TimeoutError:
            out = SendOutcome("timeout", "CLIENT_TIMEOUT")
        except asyncio.CancelledError:
            out = self._cancelled(live)
        except Exception as exc:  # a sender bug must not lose the call from the accounting
            log.exception("sender failed on call %s", p.index)
            out = SendOutcome("error", type(exc).__name__, detail=str(exc))
        self._finish(live, out)

    def _compact(self) -> None:
        """Drop finished calls from the backstop heap once they are half of it (as asyncio does with
        cancelled timers): memory stays proportional to the calls in flight, not to rate x timeout."""
        if self._stale > 64 and 2 * self._stale > len(self._backstops):
            self._backstops = [e for e in self._backstops if not e[2].finished]
            heapq.heapify(self._backstops)
            self._stale = 0

    def _finish(self, live: _Live, out: SendOutcome) -> None:
        live.finished = True
        if not live.timed_out:  # a timed-out call's entry was already popped by _sweep
            self._stale += 1
            self._compact()
        p = live.planned
        self._by_conn[p.connection] -= 1
        self._live.discard(live)
        if not self._live and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)
        result = CallResult(p.index, p.method, p.connection, p.flow_id, live.intended_ns, live.sent_ns,
                            self.clock.now_ns(), out.outcome, out.code, detail=out.detail)
        if self.comparer is not None and out.outcome in ("ok", "error", "rejected"):
            result.mismatch = self.comparer.compare(p, out)
        self.stats.add(result)
        self._emit(result)

    def _not_sent(self, planned: PlannedCall, reason: str) -> None:
        intended = self.t0_ns + planned.due_ns
        result = CallResult(planned.index, planned.method, planned.connection, planned.flow_id, intended,
                            0, 0, "not_sent", reason)
        self.stats.add(result)
        self._emit(result)

    def _emit(self, result: CallResult) -> None:
        if self.on_result is None:
            return
        try:
            self.on_result(result)
        except Exception:  # listener errors are logged, not raised (Locust's event-hook habit)
            log.exception("on_result callback failed")

    async def _drain(self) -> None:
        """Wait for in-flight calls (each bounded by its own timeout); after stop(), only the grace."""
        while self._live and not self._stop.is_set():
            await self._quiet(0.1)
            self._sweep()
        if self._live:
            await self._quiet(self.options.stop_grace_s)
            late = list(self._live)
            for live in late:
                self._abort(live)
            tasks = [lv.task for lv in late if lv.task is not None and not lv.task.done()]
            if tasks:
                await asyncio.wait(tasks)

    async def _quiet(self, timeout: float) -> None:
        """Until no call is in flight, or `timeout` seconds."""
        assert self._loop is not None
        self._idle = self._loop.create_future()
        await asyncio.wait([self._idle], timeout=timeout)


def _unnamed(planned: PlannedCall) -> bool:
    """A gRPC/HTTP/2 call without a method: recorded on a joined connection and not mapped."""
    return planned.method is None and planned.protocol in _NAMED


async def _drain_queue(queue: asyncio.Queue[PlannedMessage | None]) -> AsyncIterator[PlannedMessage]:
    while (msg := await queue.get()) is not None:
        yield msg


class _Ready:
    """The requests of a call whose messages are all due at its start: no queue, no generator."""

    __slots__ = ("_it",)

    def __init__(self, messages: list[PlannedMessage]) -> None:
        self._it = iter(messages)

    def __aiter__(self) -> _Ready:
        return self

    async def __anext__(self) -> PlannedMessage:
        try:
            return next(self._it)
        except StopIteration:
            raise StopAsyncIteration from None


class ReplayOptionFields(TypedDict, total=False):
    """The ReplayOptions fields `replay_to` takes as keywords (all but `schedule`, built from `speed`)."""

    sender: str
    sender_options: dict[str, object]
    timeout_s: float
    max_in_flight: int
    lookahead_s: float
    start_at_ns: int | None
    stop_grace_s: float
    spin_us: int
    allow_targets: tuple[str, ...]
    compare: Comparer | CompareSpec | None
    event_loop: str
    tls: TlsConfig | None
    headers: HeaderPolicy | None
    salvage: bool


def replay_to(source: str | Path | Iterable[PlannedCall], target: str, *, speed: float = 1.0,
              on_result: Callable[[CallResult], None] | None = None,
              **options: Unpack[ReplayOptionFields]) -> report_mod.ReplayReport:
    """Replay `source` straight to `target` (e.g. a fault proxy's listen address) and return the report.

    `options` are ReplayOptions fields (timeout_s, max_in_flight, allow_targets, ...). Blocks; for an
    early stop from another thread, build a ReplayRun and call its stop()."""
    opts = ReplayOptions(schedule=ScheduleOptions(speed=speed), **options)
    return ReplayRun(source, target, opts, on_result=on_result).run()
