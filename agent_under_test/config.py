"""`ServeOptions`: everything `agent serve` accepts, in one place (CLI, launcher and tests share it)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from agent_under_test.hooks import GuardConfig
from wire.registry import Registry

DEVICES = ("auto", "cpu", "cuda")
# The limiters by name, imported when one is made (this module stays import-light: the CLI reads it).
LIMITERS: Registry[str, Any] = Registry("limiter", {
    "seed": "agent_under_test.limiter:SeedLimiter",
    "gradient": "agent_under_test.limiter:GradientLimiter",
    "off": "agent_under_test.limiter:OffLimiter",
}, error=ValueError)
SERVERS = ("h2", "grpcio")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")
CACHES = ("off", "local", "redis")   # the response cache's modes (agent_under_test/cache.py)


@dataclass
class ServeOptions:
    """Options of the agent server; field names match the CLI flags (underscores for dashes)."""

    host: str = "127.0.0.1"
    server: str = "h2"                   # h2: the lean HTTP/2 gRPC server; grpcio: grpc.aio (see h2server.py)
    event_loop: str = "auto"             # auto: uvloop for the h2 server, asyncio for grpcio (which needs it)
    port: int = 50051                    # 0: any free port (see the ready line)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9464      # passed to the guard; None: no metrics endpoint
    device: str = "auto"
    tier: str = "full"
    weights: str | None = None
    seed: int = 0                        # seeds the model weights when --weights is not given
    batch_window_ms: float = 2.0
    batch_window: str = "adaptive"       # adaptive: wait only while calls arrive faster than a pass; fixed: always
    max_batch: int = 32
    workers: int | None = None           # forward-pass threads (one CUDA stream each); 0: inline on the loop;
                                         # None: 1 on CUDA, 0 on CPU (app.forward_workers says why)
    jit: bool = True                     # TorchScript-trace the model on CPU
    torch_threads: int = 1               # intra-op threads on CPU; 1 leaves a core for the client
    limiter: str = "off"
    p99_threshold_ms: float = 20.0
    alert_periods: int = 3
    resolve_periods: int = 3
    alerts: bool = True                  # P99 alerting; False never fires (for testing the checks)
    period_s: float = 1.0
    initial_rate: float = 2000.0
    min_rate: float = 10.0
    max_rate: float = 20000.0
    min_samples: int = 20                # fewer calls in a period: 'insufficient' (neither breach nor heal)
    rejected_ratio_threshold: float = 0.05
    queue_light_depth: int = 5           # batcher queue deeper than this serves new batches light; 0: never
    hpack_table_size: int | None = None  # 0 lets a mid-stream capture decode every header block
    max_connection_age_s: float | None = None
    idle_timeout_s: float = 600.0        # a connection with no call this long gets GOAWAY; 0: never
    grace_s: float = 5.0                 # how long SIGTERM waits for in-flight calls
    max_message_bytes: int = 65536       # larger snapshots are INVALID_ARGUMENT ('message')
    ready_file: str | None = None
    # The response cache (cache.py, docs/agent.md): off leaves the agent exactly as without it.
    cache: str = "off"                   # off | local (in-process LRU) | redis (LRU + Redis)
    redis_url: str | None = None         # redis://HOST:PORT/DB, needed with cache=redis
    cache_threshold: float = 0.85        # cosine similarity a cached answer needs
    cache_local_ttl_s: float = 60.0      # soft TTL: fresh this long, then "stale" + one refresh
    cache_redis_ttl_s: float = 3600.0    # hard TTL: Redis expiry; older entries are gone
    redis_timeout_ms: float = 5.0        # budget of one Redis operation on a call's path
    redis_tracking: bool = True          # a near copy of the buckets read, kept true by Redis's invalidations
    circuit_failures: int = 5            # consecutive Redis failures/timeouts that open the circuit
    circuit_open_s: float = 2.0          # open this long, then half-open (one probe)
    dependency_threshold_ms: float = 10.0   # DependencySlow: Redis op P99 above this

    def guard_config(self) -> GuardConfig:
        """The subset the Guard needs (see hooks.GuardConfig)."""
        names = {f.name for f in fields(GuardConfig)}
        config = GuardConfig(**{k: v for k, v in vars(self).items() if k in names})
        if self.queue_light_depth <= 0:  # off: only the P99 alert degrades (benchmarks pin a tier this way)
            config.queue_light_depth = 1 << 30
        return config

    @property
    def max_receive_bytes(self) -> int:
        """The server's own message size limit: well above ours, so oversize snapshots reach validation
        (INVALID_ARGUMENT naming the field) instead of being cut off by the transport."""
        return max(4 * 1024 * 1024, self.max_message_bytes * 4)

    def grpc_options(self) -> list[tuple[str, int]]:
        """Channel arguments for grpc.aio.server."""
        opts: list[tuple[str, int]] = [
            ("grpc.max_receive_message_length", self.max_receive_bytes),
            ("grpc.so_reuseport", 0),
        ]
        if self.hpack_table_size is not None:
            opts += [("grpc.http2.hpack_table_size.decoder", self.hpack_table_size),
                     ("grpc.http2.hpack_table_size.encoder", self.hpack_table_size)]
        if self.idle_timeout_s > 0:
            opts.append(("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)))
        if self.max_connection_age_s is not None:
            age_ms = int(self.max_connection_age_s * 1000)
            opts += [("grpc.max_connection_age_ms", age_ms),
                     ("grpc.max_connection_age_grace_ms", int(self.grace_s * 1000))]
        return opts
