"""Replay a recording open-loop with its original timing and measure how well it did.

Public faces (imported from their modules; this package imports nothing so that the Locust user can
use the pure parts without pulling in the asyncio engine):

    replay.engine     ReplayRun, ReplayOptions, replay_to        the open-loop replayer (asyncio)
    replay.workers    WorkerPool                                 --workers N processes, merged HDRs
    replay.schedule   ScheduleOptions, PlannedCall, build_plan   the pure plan
    replay.plan       plan_from_recording, estimate_total        recording file -> plan
    replay.senders    Sender, SendOutcome, SENDERS, get_sender  grpc | h2 | http1 | tcp by name
    replay.compare    CompareSpec, Comparer                      the shadow check
    replay.clock      TimerfdClock, real_clock (on wire.clock: Clock, MonotonicClock, FakeClock)
    replay.stats      CallResult, RunStats;  replay.report: ReplayReport
    replay.target     check_target                               the allowlist
    replay.locust_user ReplayUser                                Locust (gevent) integration
    replay.testing    FakeSender, EchoServer, recording builders (tests and benchmarks)
"""
