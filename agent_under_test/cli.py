"""Click commands shared by `python -m agent_under_test` and `shadowtest agent` / `shadowtest traffic`.

Only click is imported here; torch and grpc load inside the commands, so `shadowtest --help` stays fast.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from agent_under_test.arrivals import PATTERNS
from agent_under_test.config import CACHES, DEVICES, EVENT_LOOPS, LIMITERS, SERVERS, ServeOptions
from agent_under_test.degrade import TIERS
from wire.clicktypes import Seconds

if TYPE_CHECKING:   # numpy: not imported at run time here (see above)
    from agent_under_test.traffic_report import TrafficReport

_D = ServeOptions()
_F = TypeVar("_F", bound=Callable[..., Any])


def _opt(name: str, **kw: Any) -> Callable[[_F], _F]:
    """click.option with the default shown (`kw`: click's own option attributes)."""
    return click.option(name, show_default=True, **kw)


def _require_agent_extra(*modules: str) -> None:
    """The agent's model needs the `agent` extra; say so in one line instead of an ImportError."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(
            f"the reference agent needs {', '.join(missing)}, which this install lacks: "
            "pip install 'shadowtest[agent]'")


@click.command("serve")
@_opt("--host", default=_D.host, help="address to listen on")
@_opt("--port", type=int, default=_D.port, help="gRPC port; 0 picks a free one (see the ready line)")
@_opt("--server", type=click.Choice(SERVERS), default=_D.server,
      help="gRPC server: h2 (lean, far less CPU per call) or grpcio (grpc.aio)")
@_opt("--event-loop", type=click.Choice(EVENT_LOOPS), default=_D.event_loop,
      help="auto: uvloop under --server h2; grpcio always runs on asyncio's loop")
@_opt("--metrics-host", default=_D.metrics_host, help="address of the guard's /metrics endpoint")
@_opt("--metrics-port", type=int, default=_D.metrics_port, help="/metrics port (0: any free port, -1: none)")
@_opt("--device", type=click.Choice(DEVICES), default=_D.device, help="where the model runs")
@_opt("--tier", type=click.Choice(TIERS), default=_D.tier, help="model tier served when healthy")
@_opt("--weights", type=click.Path(dir_okay=False), default=None, help="weights file (default: seeded)")
@_opt("--seed", type=int, default=_D.seed, help="seed of the default weights")
@_opt("--batch-window-ms", type=float, default=_D.batch_window_ms, help="micro-batching window (the longest wait)")
@_opt("--batch-window", type=click.Choice(("adaptive", "fixed")), default=_D.batch_window,
      help="adaptive: a free model waits only while calls arrive faster than a forward pass runs; fixed: always")
@_opt("--max-batch", type=click.IntRange(1, 1024), default=_D.max_batch, help="largest forward pass")
@_opt("--workers", type=click.IntRange(0, 64), default=None,
      help="forward-pass threads, one CUDA stream each (0: inline on the event loop; default 1 on CUDA, 0 on CPU)")
@_opt("--jit/--no-jit", default=_D.jit, help="TorchScript-trace the model on CPU")
@_opt("--torch-threads", type=click.IntRange(0, 256), default=_D.torch_threads,
      help="torch intra-op threads on CPU (0: torch's default)")
@_opt("--limiter", type=click.Choice(LIMITERS.names()), default=_D.limiter, help="adaptive concurrency limiter")
@_opt("--p99-threshold-ms", type=float, default=_D.p99_threshold_ms, help="P99 alert threshold")
@_opt("--alert-periods", type=int, default=_D.alert_periods, help="periods over threshold before firing")
@_opt("--resolve-periods", type=int, default=_D.resolve_periods, help="periods under it before resolving")
@_opt("--alerts/--no-alerts", default=_D.alerts, help="P99 alerting; --no-alerts never fires (to prove the chaos checks catch it)")
@_opt("--period-s", type=float, default=_D.period_s, help="monitor period")
@_opt("--initial-rate", type=float, default=_D.initial_rate, help="limiter start, calls/s")
@_opt("--min-rate", type=float, default=_D.min_rate, help="limiter floor, calls/s")
@_opt("--max-rate", type=float, default=_D.max_rate, help="limiter ceiling, calls/s")
@_opt("--min-samples", type=click.IntRange(1), default=_D.min_samples,
      help="calls a period needs for a P99 (fewer: insufficient, neither breaching nor healthy)")
@_opt("--rejected-ratio-threshold", type=float, default=_D.rejected_ratio_threshold,
      help="RejectedRatioHigh fires above this share of offered calls")
@_opt("--queue-light-depth", type=click.IntRange(0), default=_D.queue_light_depth,
      help="serve new batches light while more than this many calls queue for the model (0: never)")
@_opt("--hpack-table-size", type=int, default=None, help="HPACK dynamic table size (0: captures decode mid-stream)")
@_opt("--max-connection-age-s", type=float, default=None, help="close connections after this age")
@_opt("--idle-timeout-s", type=click.FloatRange(0), default=_D.idle_timeout_s,
      help="GOAWAY a connection that has had no call this long (0: never)")
@_opt("--grace-s", type=Seconds(0), default=_D.grace_s, help="SIGTERM: time to finish in-flight calls")
@_opt("--max-message-bytes", type=int, default=_D.max_message_bytes, help="larger snapshots are rejected")
@_opt("--ready-file", type=click.Path(dir_okay=False), default=None, help="also write the ready line here")
@_opt("--cache", type=click.Choice(CACHES), default=_D.cache,
      help="response cache in front of the model: local (in-process LRU) or redis (LRU + Redis); off: none")
@_opt("--redis-url", default=None, help="Redis of --cache redis, e.g. redis://127.0.0.1:6379/0")
@_opt("--cache-threshold", type=float, default=_D.cache_threshold,
      help="cosine similarity a cached answer needs (0-1]")
@_opt("--cache-local-ttl-s", type=float, default=_D.cache_local_ttl_s,
      help="soft TTL: an entry is fresh this long, then answers 'stale' while one refresh runs")
@_opt("--cache-redis-ttl-s", type=float, default=_D.cache_redis_ttl_s,
      help="hard TTL: Redis expiry; older entries are gone")
@_opt("--redis-timeout-ms", type=float, default=_D.redis_timeout_ms,
      help="budget of one Redis operation on a call's path (then the slow path answers)")
@_opt("--redis-tracking/--no-redis-tracking", default=_D.redis_tracking,
      help="keep a near copy of the Redis buckets read, kept true by Redis's invalidations (CLIENT TRACKING, "
           "Redis >= 6): a miss in a bucket nobody else changed asks Redis nothing")
@_opt("--circuit-failures", type=int, default=_D.circuit_failures,
      help="consecutive Redis failures or timeouts that open the circuit")
@_opt("--circuit-open-s", type=float, default=_D.circuit_open_s,
      help="seconds the circuit stays open before one probe (half-open)")
@_opt("--dependency-threshold-ms", type=float, default=_D.dependency_threshold_ms,
      help="DependencySlow alert: Redis operation P99 above this (or the circuit open) for --alert-periods")
def serve_command(**kwargs: Any) -> None:   # click's values, already converted by the options' types
    """Serve the reference trading agent over gRPC until SIGTERM/SIGINT (then drain and exit 0).

    Prints one JSON ready line on stdout once the model is warm and the port is open.

    \b
    Examples:
      shadowtest agent serve --port 50051 --metrics-port 9464
      shadowtest agent serve --port 0 --tier light --ready-file /tmp/agent.json
      shadowtest agent serve --limiter gradient --p99-threshold-ms 20 --hpack-table-size 0
      shadowtest agent serve --cache redis --redis-url redis://127.0.0.1:6379/0 --redis-timeout-ms 5
      python -m agent_under_test serve --device cpu --torch-threads 1
    """
    _require_agent_extra("numpy", "torch")
    from agent_under_test import app

    if kwargs["metrics_port"] is not None and int(kwargs["metrics_port"]) < 0:
        kwargs["metrics_port"] = None
    sys.exit(app.run(ServeOptions(**kwargs)))


@click.command("save-weights")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--seed", type=int, default=0, show_default=True)
def save_weights_command(path: str, seed: int) -> None:
    """Write the seeded weights of both tiers to PATH (load them with `serve --weights PATH`).

    \b
    Examples:
      shadowtest agent save-weights /tmp/agent-weights.pt --seed 7
    """
    _require_agent_extra("numpy", "torch")
    from agent_under_test import model

    model.save_weights(path, seed)
    click.echo(path)


@click.command("traffic")
@click.option("--target", required=True, help="HOST:PORT of the agent")
@click.option("--rate", type=click.FloatRange(0, min_open=True), required=True, help="mean calls/s (unary + stream messages)")
@click.option("--duration", "duration_s", type=Seconds(0, low_open=True), required=True,
              help="how long to send (seconds, or 30s, 2m)")
@click.option("--pattern", type=click.Choice(PATTERNS.names()), default="poisson", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="fixes schedule, prices and mix")
@click.option("--stream-share", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="fraction of calls sent on DecideStream")
@click.option("--symbols", type=click.IntRange(1, 1000), default=4, show_default=True)
@click.option("--streams", type=click.IntRange(1, 64), default=4, show_default=True, help="stream lanes")
@click.option("--connect-timeout", type=Seconds(0), default=10.0, show_default=True,
              help="how long to wait for the target (seconds, or 500ms)")
@click.option("--json", "--json-out", "json_out", type=click.Path(dir_okay=False), default=None,
              is_flag=False, flag_value="-", help="--json: the report as JSON on stdout; --json-out FILE: to a file")
@click.option("--log-sent", type=click.Path(dir_okay=False), default=None,
              help="write every request sent (time, method, bytes) as JSON lines, mode 0600")
def traffic_command(target: str, rate: float, duration_s: float, pattern: str, seed: int, stream_share: float,
                    symbols: int, streams: int, connect_timeout: float, json_out: str | None,
                    log_sent: str | None) -> None:
    """Send production-like open-loop traffic to an agent and report rate, p50/p95/p99 and errors.

    Latency is measured from each call's intended send time. Exit 1 when no call succeeded.

    \b
    Examples:
      shadowtest traffic --target 127.0.0.1:50051 --rate 500 --duration 10
      shadowtest traffic --target 127.0.0.1:50051 --rate 1500 --duration 30 --pattern bursty --seed 7
      shadowtest traffic --target 127.0.0.1:50051 --rate 200 --duration 5 --log-sent sent.jsonl --json -
    """
    import json

    _require_agent_extra("numpy")
    from agent_under_test.traffic import run_traffic

    report = run_traffic(target, rate, duration_s, pattern, seed, stream_share, symbols=symbols,
                         streams=streams, log_sent=log_sent, connect_timeout_s=connect_timeout)
    doc = json.dumps(report.to_dict(), indent=2)
    if json_out == "-":
        click.echo(doc)
    else:
        if json_out:
            with open(json_out, "w") as f:
                f.write(doc + "\n")
        _print_report(report)
    sys.exit(0 if report.ok else 1)


def _print_report(report: TrafficReport) -> None:
    r = report
    lines = [
        f"target {r.target}  pattern {r.pattern}  seed {r.seed}",
        f"sent {r.sent}  ok {r.ok}  achieved {r.achieved_rate}/s (asked {r.rate:g}/s)",
        f"latency ms  p50 {r.p50_ms}  p95 {r.p95_ms}  p99 {r.p99_ms}  (send lag p99 {r.send_lag_p99_ms} ms)",
        f"by method {r.by_method}  errors {r.errors or 'none'}",
    ]
    if sys.stdout.isatty():
        from rich.console import Console

        Console().print("\n".join(lines), highlight=True)
    else:
        click.echo("\n".join(lines))
