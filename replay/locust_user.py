"""Distributed replay with Locust: the master hands each worker a share of the calls, shadowtest's
own engine sends them with the original timing, and the master prints shadowtest's accounting.

    shadowtest locust --master --headless --expect-workers 2 -u 2 -r 2 --run-time 5m \\
        --host 127.0.0.1:50051 --shadow-recording prod.rec
    shadowtest locust --worker --master-host MASTER      # on each worker machine (no recording needed)

    master: checks the target (loopback or --shadow-allow-target) and the recording, counts the plan
      |<-- "shadow_hello" (the worker's handlers are ready; repeated until welcomed) ---------- worker
      |-- the recording, in 1 MiB custom messages (sha256-checked), "shadow_welcome" -------> worker
      |-- test start: "shadow_start" {shard (i, n), t0 (wall clock), options} ---------------> worker
      |                                          worker: child process `python -m replay.locust_child`
      |                                          (shadowtest's engine and lean senders, not gevent):
      |                                          plan shard (i, n) by call, send at t0 + due
      |<-- "shadow_progress" (counts, HDR) every 0.5 s; every call -> Locust's request event ----|
      |<-- "shadow_done" (final counts) or "shadow_error" (one line) ---------------------------|
    all shards done -> quit; --run-time reached -> "shadow_stop", the rest is counted as cut off

Sharding is by call (ScheduleOptions.shard_by): a recording of one connection splits evenly over the
workers; a call with all its stream messages stays on one worker; each worker opens its own
connections. Every worker starts at the same wall-clock t0 (hosts need synchronised clocks, as
Locust itself assumes). The replay runs whatever `-u` is; each user only waits for its worker's
share to finish (use `-u` = the number of workers).

At the end the master prints one line per worker and the totals: scheduled = ok + rejected + errors
+ timeouts + not sent + cut off (by the run time, or never reported). The run exits 1 when a call
was cut off, a worker failed or never reported, or the sums do not hold; otherwise Locust's own exit
code (1 when a request failed). `--shadow-json FILE` writes the same as JSON.

gevent isolation: this module imports locust (which monkey-patches) first and uses only the pure
parts of replay (plan counting, stats, target check); the asyncio engine runs in the child process.
"""

from __future__ import annotations

# ruff: noqa: I001  -- order matters: locust monkey-patches for gevent on import
from locust import User, constant, events, task
from locust.exception import StopUser
from locust.runners import LocalRunner, MasterRunner, Runner, WorkerRunner

import gevent
import gevent.event

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from locust.argument_parser import LocustArgumentParser
from locust.env import Environment
from locust.rpc.protocol import Message

from replay.stats import RunStats, percentiles_ms, percentiles_us
from wire.process import spawn

CHUNK = 1 << 20
_RECORDING_WAIT_S = 60.0
_HELLO_EVERY_S, _HELLO_TRIES = 0.5, 240
_PREFIX = "shadowtest: "


def _say(line: str) -> None:
    """One line on stderr (Locust's own log goes there too)."""
    sys.stderr.write(_PREFIX + " ".join(line.split()) + "\n")
    sys.stderr.flush()


@events.init_command_line_parser.add_listener  # type: ignore[untyped-decorator]  # locust's hooks are untyped
def _add_arguments(parser: LocustArgumentParser) -> None:
    g = parser.add_argument_group("shadowtest replay", "replay a shadowtest recording with its original timing")
    g.add_argument("--shadow-recording", default="", metavar="FILE",
                   help="recording to replay; read by the master and sent to every worker")
    g.add_argument("--shadow-recording-on-workers", action="store_true", default=False,
                   help="do not send the recording: each worker opens --shadow-recording itself (same path)")
    g.add_argument("--shadow-start-delay", type=float, default=2.0,
                   help="seconds after the test start at which every worker starts")
    g.add_argument("--shadow-max-recording-mb", type=int, default=256,
                   help="largest recording the master sends to workers")
    g.add_argument("--shadow-stop-grace", type=float, default=3.0,
                   help="seconds the master waits for the workers' final counts when the run time ends")
    g.add_argument("--shadow-json", default="", metavar="FILE", help="write shadowtest's accounting as JSON")
    # Every `shadowtest replay` option, as --shadow-NAME (replay/options.py: one declaration for both).
    # TLS files must exist at the same path on every worker.
    from replay.options import add_argparse
    add_argparse(g)


class ReplayFailure(Exception):
    """A call that did not succeed, as Locust's statistics show it ("error UNAVAILABLE")."""


class ReplayUser(User):
    """Waits while this process's share of the recording is replayed, then stops.

    The calls are sent by the shard's child process, not by this user: open-loop timing does not
    depend on how many users Locust spawns."""

    wait_time = constant(0)

    @task
    def wait_for_replay(self) -> None:
        _SHARD_DONE.wait()
        raise StopUser()


_SHARD_DONE = gevent.event.Event()


# ---- options ------------------------------------------------------------------------------------
def _target(host: str | None) -> str:
    """Locust's --host, without a scheme or trailing slash: HOST:PORT."""
    text = (host or "").strip()
    if "://" in text:
        text = text.split("://", 1)[1]
    return text.rstrip("/")


def _config(opts: Namespace, target: str) -> dict[str, Any]:
    """What every shard needs: the target and the replay option values (JSON; each worker builds the same
    ReplayOptions from them, replay/options.py)."""
    from replay.options import from_argparse, json_values
    return {"target": target, "values": json_values(from_argparse(opts))}


# ---- master (or a local run) ------------------------------------------------------------------
class _Master:
    """Hands out shards, collects each worker's counts and prints the accounting at the end."""

    def __init__(self, environment: Environment, runner: Runner) -> None:
        self.env, self.runner = environment, runner
        opts = environment.parsed_options
        assert opts is not None   # _on_init returns before making a master without them
        self.opts: Namespace = opts
        self.path = opts.shadow_recording
        self.send = not opts.shadow_recording_on_workers and isinstance(runner, MasterRunner)
        self.total = 0
        self.cfg = self._validate(environment)
        self.workers: list[int] = []              # shard indexes handed out
        self.latest: dict[int, RunStats] = {}
        self.finals: dict[int, dict[str, Any]] = {}
        self.errors: list[str] = []
        self.failed: set[int] = set()             # shards that reported an error
        self.problems: list[str] = []
        self.started = False
        self.quitting = False
        self.local: _Shard | None = None
        self.welcomed: set[str] = set()           # workers whose handlers are ready
        self.assigned: dict[str, dict[str, Any]] = {}  # worker client id -> its shard's config

    def _validate(self, env: Environment) -> dict[str, Any]:
        """Refuse bad options, a disallowed target or an unreadable recording with one line."""
        from replay.errors import TargetNotAllowedError
        from replay.options import LOCUST, OptionError, build, spell
        from replay.plan import estimate_total
        from replay.target import check_target
        opts = self.opts
        if not self.path:
            _exit(2, "--shadow-recording FILE is required")
        target = _target(env.host)
        if not target:
            _exit(2, "--host HOST:PORT (the replay target) is required")
        try:
            cfg = _config(opts, target)
            replay_opts = build(cfg["values"])
            check_target(target, replay_opts.allow_targets)
        except TargetNotAllowedError as exc:
            _exit(2, spell(str(exc), LOCUST))
        except OptionError as exc:
            _exit(2, exc.spelled(LOCUST))
        try:
            self.total = estimate_total(self.path, replay_opts.schedule)
        except Exception as exc:  # missing, damaged, not decoded yet: one line
            _exit(1, f"cannot read recording {self.path}: {' '.join(str(exc).split())}")
        if self.send:
            size = os.path.getsize(self.path)
            if size > opts.shadow_max_recording_mb << 20:
                _exit(2, f"recording {self.path} is {size >> 20} MiB, over --shadow-max-recording-mb "
                         f"{opts.shadow_max_recording_mb}; raise it or use --shadow-recording-on-workers")
        return cfg

    # -- worker lifecycle --
    def on_hello(self, environment: Environment, msg: Message, **_: object) -> None:
        """A worker's handlers are ready (it says hello until welcomed): send it the recording, then
        its shard if the test has started. (Messages sent before a worker's init would be lost.)"""
        client_id = msg.node_id
        if client_id in self.welcomed:
            return
        self.welcomed.add(client_id)
        if self.send:
            self._send_recording(client_id)
        self.runner.send_message("shadow_welcome", {"send": self.send}, client_id)
        if client_id in self.assigned:
            self.runner.send_message("shadow_start", self.assigned[client_id], client_id)

    def _send_recording(self, client_id: str) -> None:
        digest = _sha256(self.path)
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            seq = 0
            while True:
                data = f.read(CHUNK)
                last = f.tell() >= size
                self.runner.send_message("shadow_recording", {"seq": seq, "data": data, "size": size,
                                                              "sha256": digest, "last": last}, client_id)
                seq += 1
                if last:
                    break

    def on_test_start(self, **_: object) -> None:
        if self.started:
            return
        self.started = True
        t0 = time.time() + self.opts.shadow_start_delay
        if isinstance(self.runner, MasterRunner):
            clients = sorted((c.id for c in self.runner.clients.values() if c.state != "missing"),
                             key=self.runner.get_worker_index)
            n = len(clients)
            self.workers = list(range(n))
            for i, client_id in enumerate(clients):
                self.assigned[client_id] = {**self.cfg, "shard": [i, n], "start_wall": t0, "index": i,
                                            "send": self.send, "path": self.path}
                if client_id in self.welcomed:
                    self.runner.send_message("shadow_start", self.assigned[client_id], client_id)
        else:  # a local run: one shard, here
            self.workers = [0]
            path = str(Path(self.path).resolve())
            cfg = {**self.cfg, "shard": [0, 1], "start_wall": t0, "index": 0, "send": False, "path": path}
            self.local = _Shard(self.env, self._local_message)
            gevent.spawn(self.local.run, cfg)

    def on_test_stop(self, **_: object) -> None:
        """The run time ended (or the run was stopped): stop every shard, wait for the final counts."""
        if not self.started or self._complete():
            return
        if self.local is not None:
            self.local.stop()
        else:
            self.runner.send_message("shadow_stop", None)
        deadline = time.monotonic() + self.opts.shadow_stop_grace
        while not self._complete() and time.monotonic() < deadline:
            gevent.sleep(0.05)

    def _complete(self) -> bool:
        return bool(self.workers) and all(i in self.finals or i in self.failed for i in self.workers)

    # -- messages from the shards --
    def _local_message(self, kind: str, data: dict[str, Any]) -> None:
        self.handle(kind, data)

    def on_message(self, environment: Environment, msg: Message, **_: object) -> None:
        self.handle(msg.type, msg.data)

    def handle(self, kind: str, data: dict[str, Any]) -> None:
        i = int(data["index"])
        if data.get("stats") is not None:
            self.latest[i] = RunStats.from_wire(data["stats"])
        if kind == "shadow_done":
            self.finals[i] = data
            self.problems += [f"worker {i}: {p}" for p in data.get("problems") or []]
            if self._complete():
                self._quit()
        elif kind == "shadow_error":
            line = f"worker {i}: {data['error']}"
            self.failed.add(i)
            self.errors.append(line)
            _say(line)
            self._quit()

    def _quit(self) -> None:
        if self.quitting or not self.opts.headless:
            return
        self.quitting = True
        gevent.spawn(self.runner.quit)

    # -- the accounting --
    def summary(self) -> dict[str, Any]:
        merged = RunStats()
        shares = []
        for i in self.workers:
            part = self.latest.get(i, RunStats())
            merged.merge(part)
            o = part.outcomes
            shares.append({"worker": i, "scheduled": part.scheduled, "sent": part.sent, "ok": o["ok"],
                           "rejected": o["rejected"], "errors": sum(part.errors.values()), "timeouts": o["timeout"],
                           "not_sent": o["not_sent"] - part.not_sent.get("stopped", 0),
                           "cut_off": part.not_sent.get("stopped", 0),
                           "lag_p99_us": percentiles_us(part.lag)["p99"], "complete": i in self.finals})
        o = merged.outcomes
        stopped = merged.not_sent.get("stopped", 0)
        reasons = {k: v for k, v in merged.not_sent.items() if k != "stopped"}
        not_sent = o["not_sent"] - stopped
        errors = sum(merged.errors.values())
        accounted = o["ok"] + o["rejected"] + errors + o["timeout"] + o["not_sent"]
        unreported = self.total - accounted
        cut_off = stopped + max(0, unreported)
        failures = [*self.errors]
        if not self.started:
            failures.append("the replay never started (no worker connected?)")
        missing = [i for i in self.workers if i not in self.finals]
        if missing and not self.errors:
            failures.append(f"no final counts from worker(s) {', '.join(map(str, missing))}")
        if cut_off and self.errors:
            failures.append(f"{cut_off} of {self.total} calls never replayed (a worker failed)")
        elif cut_off:
            failures.append(f"run cut short: {cut_off} of {self.total} calls cut off by the run time "
                            f"({stopped} not sent, {max(0, unreported)} not finished or not reported); "
                            "raise --run-time")
        invariant = unreported >= 0
        if not invariant:
            failures.append(f"invariant broken: {accounted} calls accounted for but {self.total} scheduled")
        return {"scheduled": self.total, "sent": merged.sent, "ok": o["ok"], "rejected": o["rejected"],
                "errors": dict(merged.errors), "timeouts": o["timeout"], "not_sent": not_sent,
                "not_sent_reasons": reasons, "cut_off": cut_off, "latency_ms": percentiles_ms(merged.latency),
                "lag_us": percentiles_us(merged.lag), "workers": shares, "invariant_ok": invariant,
                "problems": self.problems, "failures": failures, "passed": not failures}

    def on_quitting(self, environment: Environment, **_: object) -> None:
        if self.local is not None:
            self.local.stop()
        s = self.summary()
        errors = sum(s["errors"].values())
        _say(f"scheduled {s['scheduled']}, sent {s['sent']}, ok {s['ok']}, rejected {s['rejected']}, "
             f"errors {errors}, timeouts {s['timeouts']}, not sent {s['not_sent']}, cut off {s['cut_off']}")
        for w in s["workers"]:
            _say(f"worker {w['worker']}: scheduled {w['scheduled']}, sent {w['sent']}, ok {w['ok']}, "
                 f"not sent {w['not_sent']}, cut off {w['cut_off']}, lag p99 {w['lag_p99_us']:,.0f} us"
                 + ("" if w["complete"] else " (final counts missing)"))
        lat, lag = s["latency_ms"], s["lag_us"]
        _say(f"latency from intended p50 {lat['p50']:.2f} ms p99 {lat['p99']:.2f} ms; "
             f"send lag p50 {lag['p50']:,.0f} us p99 {lag['p99']:,.0f} us")
        _say("invariant " + ("ok" if s["invariant_ok"] else "BROKEN")
             + ": scheduled = ok + rejected + errors + timeouts + not sent + cut off")
        for p in s["problems"]:
            _say(f"problem: {p}")
        if self.opts.shadow_json:
            from harness.outputs import stamped

            Path(self.opts.shadow_json).write_text(json.dumps(stamped("locust", s), indent=2) + "\n")
        if s["failures"]:
            _say("FAILED: " + "; ".join(s["failures"]))
            environment.process_exit_code = 1
        else:
            _say("passed: every scheduled call accounted for")


def _exit(code: int, line: str) -> None:
    _say(line)
    sys.exit(code)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


# ---- one shard (on a worker, or in a local run) ------------------------------------------------
class _Shard:
    """Runs `python -m replay.locust_child` for one shard and relays what it reports."""

    def __init__(self, environment: Environment, send: Callable[[str, dict[str, Any]], None]) -> None:
        self.env, self.send = environment, send
        self.proc: subprocess.Popen[bytes] | None = None
        self.stopping = False

    def stop(self) -> None:
        self.stopping = True
        proc = self.proc
        if proc is not None and proc.poll() is None and proc.stdin is not None:
            try:
                proc.stdin.write(b"stop\n")
                proc.stdin.flush()
            except OSError:
                pass

    def run(self, cfg: dict[str, Any]) -> None:
        i = cfg["index"]
        try:
            self._run(cfg)
        except Exception as exc:  # never a traceback on the worker: one line on the master
            self.send("shadow_error", {"index": i, "error": " ".join(str(exc).split()) or type(exc).__name__})
        finally:
            _SHARD_DONE.set()

    def _run(self, cfg: dict[str, Any]) -> None:
        from replay.target import check_target
        i = cfg["index"]
        check_target(cfg["target"], cfg["values"].get("allow_targets") or ())
        if self.stopping:
            return
        child = [sys.executable, "-m", "replay.locust_child"]
        root = str(Path(__file__).resolve().parents[1])   # where the replay package is, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = proc = spawn(child, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps(cfg) + "\n").encode())
        proc.stdin.flush()
        if self.stopping:
            self.stop()
        fire = self.env.events.request.fire
        finished = False
        try:
            for raw in proc.stdout:
                msg = json.loads(raw)
                for method, outcome, code, intended, sent, done, detail in msg.get("r", ()):
                    ok = outcome == "ok"
                    exc = None if ok else ReplayFailure(
                        f"not sent: {code}" if outcome == "not_sent" else f"{outcome} {code or ''}".strip())
                    fire(request_type="shadow", name=method or "call",  # type: ignore[no-untyped-call]
                         response_time=(done - intended) / 1e6 if sent else 0.0, response_length=0,
                         exception=exc, context={"detail": detail})
                if "progress" in msg and "error" not in msg:
                    self.send("shadow_progress", {"index": i, "stats": msg["progress"]})
                if "done" in msg:
                    finished = True
                    self.send("shadow_done", {"index": i, "stats": msg["done"], "problems": msg.get("problems")})
                if "error" in msg:
                    finished = True
                    self.send("shadow_error", {"index": i, "error": msg["error"], "stats": msg.get("progress")})
        finally:
            if proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            code = proc.returncode
        if not finished:
            raise RuntimeError(f"the replay process ended (exit {code}) without its final counts")


class _Worker:
    """A Locust worker: receives the recording and its shard from the master."""

    def __init__(self, environment: Environment, runner: Runner) -> None:
        self.env, self.runner = environment, runner
        self.dir = tempfile.mkdtemp(prefix="shadowtest-locust-")   # 0700
        self.path = os.path.join(self.dir, "recording.rec")
        self.file: Any = None
        self.next_seq = 0
        self.ready = gevent.event.Event()
        self.error = ""
        self.shard = _Shard(environment, self._send)
        self.welcomed = gevent.event.Event()
        gevent.spawn(self._hello)

    def _hello(self) -> None:
        """Tell the master this worker can take messages; repeated (bounded) until it answers."""
        for _ in range(_HELLO_TRIES):
            self._send("shadow_hello", {})
            if self.welcomed.wait(_HELLO_EVERY_S):
                return

    def on_welcome(self, environment: Environment, msg: Message, **_: object) -> None:
        self.welcomed.set()

    def _send(self, kind: str, data: dict[str, Any]) -> None:
        self.runner.send_message(kind, data)

    def on_recording(self, environment: Environment, msg: Message, **_: object) -> None:
        d = msg.data
        if self.ready.is_set() or self.error:
            return
        if d["seq"] != self.next_seq:
            self.error = f"recording chunk {d['seq']} arrived out of order (expected {self.next_seq})"
            self.ready.set()
            return
        if self.file is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            self.file = os.fdopen(fd, "wb")
        self.file.write(d["data"])
        self.next_seq += 1
        if self.file.tell() > d["size"]:  # never more than the master announced
            self.file.close()
            self.error = f"the recording overran its announced size ({d['size']} bytes)"
            self.ready.set()
            return
        if d["last"]:
            self.file.close()
            if os.path.getsize(self.path) != d["size"] or _sha256(self.path) != d["sha256"]:
                self.error = "the recording arrived damaged (size or sha256 differs from the master's)"
            self.ready.set()

    def on_start(self, environment: Environment, msg: Message, **_: object) -> None:
        gevent.spawn(self._start, msg.data)

    def _start(self, cfg: dict[str, Any]) -> None:
        i = cfg["index"]
        if cfg["send"]:
            if not self.ready.wait(_RECORDING_WAIT_S) or self.error:
                self._fail(i, self.error or f"the recording did not arrive from the master within {_RECORDING_WAIT_S:g} s")
                return
            cfg = {**cfg, "path": self.path}
        elif not os.path.isfile(cfg["path"]):
            self._fail(i, f"cannot open recording {cfg['path']}: no such file on this worker "
                          f"(cwd {os.getcwd()}); drop --shadow-recording-on-workers to have the master send it")
            return
        self.shard.run(cfg)

    def _fail(self, i: int, line: str) -> None:
        self._send("shadow_error", {"index": i, "error": line})
        _SHARD_DONE.set()

    def on_stop_message(self, environment: Environment, msg: Message, **_: object) -> None:
        self.shard.stop()

    def on_quitting(self, **_: object) -> None:
        self.shard.stop()
        proc = self.shard.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.wait(2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@events.init.add_listener  # type: ignore[untyped-decorator]
def _on_init(environment: Environment, runner: Runner | None, **_: object) -> None:
    if environment.parsed_options is None or runner is None:
        return  # used as a library: nothing to set up
    if isinstance(runner, WorkerRunner):
        worker = _Worker(environment, runner)
        runner.register_message("shadow_welcome", worker.on_welcome)
        runner.register_message("shadow_recording", worker.on_recording)
        runner.register_message("shadow_start", worker.on_start)
        runner.register_message("shadow_stop", worker.on_stop_message)
        environment.events.quitting.add_listener(worker.on_quitting)  # type: ignore[no-untyped-call]
        return
    if not isinstance(runner, (MasterRunner, LocalRunner)):
        return
    master = _Master(environment, runner)
    if isinstance(runner, MasterRunner):
        for kind in ("shadow_progress", "shadow_done", "shadow_error"):
            runner.register_message(kind, master.on_message)
        runner.register_message("shadow_hello", master.on_hello)
    environment.events.test_start.add_listener(master.on_test_start)  # type: ignore[no-untyped-call]
    environment.events.test_stop.add_listener(master.on_test_stop)  # type: ignore[no-untyped-call]
    environment.events.quitting.add_listener(master.on_quitting)  # type: ignore[no-untyped-call]


def launch(argv: list[str]) -> None:
    """`python -m replay.locust_user [LOCUST ARGS]` (what `shadowtest locust` runs): Locust with this
    file as its locustfile. `--help` lists Locust's options and the --shadow-* ones (Locust itself
    prints its help before it imports a locustfile, so `locust -f FILE --help` cannot show them)."""
    if any(a in ("-h", "--help") for a in argv):
        from locust.argument_parser import get_parser
        get_parser().parse_args(["--help"])  # prints and exits
    os.execv(sys.executable, [sys.executable, "-m", "locust", "-f", os.path.abspath(__file__), *argv])


if __name__ == "__main__":
    launch(sys.argv[1:])
