"""The response cache in front of the model: the fast path of the agent.

    request -> parse -> features -> probe (bucket key + unit vector)
        |-- local tier (in-process LRU)       hit: answer now ("local", or "stale" + one background refresh)
        |-- Redis tier (budget, circuit)      hit: answer now ("redis" / "stale"), copied into the local tier
    |   (its near copy answers buckets nobody else changed since they were read: no round trip)
        `-- miss: batcher -> model -> answer; stored locally at once, in Redis fire-and-forget

What is cached is the model's output row and tier, never a whole Decision: a hit still runs the risk
rules on THIS request (its mid, book and position) and echoes its sequence_id and symbol.

Matching. A bucket holds the few most recent entries (PER_BUCKET) of one symbol, book depth and
position step; a hit is the entry whose vector has cosine similarity >= `threshold` with the request's.
The vector is the features matrix with each column's mean over the levels taken out: the raw features
of any two books of one symbol are 0.94-0.99 alike (sizes and the position column dominate), so 0.85
on them would match everything; centred, two different books of one symbol score 0.1-0.7 and only the
same or nearly the same book reaches 0.85. The position column, constant over levels, is what the
bucket's position step stands for.

Ages. An entry is fresh for `local_ttl_s` (soft TTL); from then until `redis_ttl_s` (hard TTL, also the
Redis key's expiry) it answers "stale" and one refresh runs the slow path (at most one per entry, at
most MAX_REFRESHES in all); past the hard TTL it is gone.

Redis is optional: every operation has a budget (`timeout_s`), a circuit breaker stops trying after
`failures` consecutive failures or timeouts for `open_s` (then one probe), reads in flight are bounded,
and writes are fire-and-forget: queued (at most MAX_PENDING_WRITES) for one background writer that sends
them WRITE_BATCH to a round trip, after up to WRITE_LINGER_S for others to join. A slow or dead Redis costs a
call at most the budget. Every operation goes over one pipelined connection (resp.RespConnection): an
operation abandoned at its budget leaves its reply to be read and dropped, not a connection to remake.

Cost. A miss is on every uncached call's path: its vector work is two compiled calls (similarity.py;
as numpy calls, 2-4 us each in a serving agent whose caches the model has just evicted, a local miss
cost ~40 us); a Redis lookup is one round trip on the pipelined connection (RespConnection), or none
in a bucket the tier holds a near copy of (RedisTier: client tracking keeps it true).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

from agent_under_test.config import CACHES
from agent_under_test.degrade import TIERS
from agent_under_test.errors import ServeError
from agent_under_test.features import Features
from agent_under_test.resp import Push, RedisReplyError, RespConnection, Then, command, parse_url, with_key
from agent_under_test.similarity import scan, scan_tails, sims, unit
from wire.clock import Clock, MonotonicClock

if TYPE_CHECKING:
    from agent_under_test.config import ServeOptions

CACHE_MODES = CACHES
SOURCES = ("local", "redis", "stale")                  # Decision.cache on a hit ("" when computed now)
RESULTS = ("hit_local", "hit_redis", "stale", "miss")  # agent_cache_total{result}
CLOSED, HALF_OPEN, OPEN = "closed", "half_open", "open"
CIRCUIT_STATES = (CLOSED, HALF_OPEN, OPEN)             # agent_dependency_circuit_state = the index
DEPENDENCY = "redis"

PER_BUCKET = 32             # entries searched per bucket (local and Redis): one matrix-vector product
LOCAL_MAX_ENTRIES = 16384   # local tier bound, over all buckets (least recently used bucket goes first)
POSITION_STEP = 100.0       # position quantum of a bucket
MAX_REFRESHES = 16          # background refreshes in flight; more stale hits wait for a later one
MAX_REDIS_READS = 32        # lookups in flight; beyond that a call skips Redis (a miss, not a failure)
MAX_PENDING_WRITES = 1024   # entries waiting for Redis; beyond that a write is dropped
WRITE_BATCH = 128           # entries per write (one pipeline: LPUSH, LTRIM, EXPIRE per bucket)
WRITE_LINGER_S = 0.1        # a write waits this long for others to join it: at 1000 misses/s, ~100 a round
                            # trip instead of 1. A round trip costs the agent ~100 us of CPU (a send, a
                            # wake-up, a read: syscalls are dear in a VM), ~6 us per entry at 20 ms; what
                            # another agent may miss meanwhile is 100 ms of answers, of entries that live 60 s
WRITE_EARLY_S = 0.08        # a write this far into the linger sends the batch (RedisTier._linger)
HEALTH_INTERVAL_S = 0.025  # a lookup sends a PING when nothing else went to Redis this long (RedisTier.tick)
IDLE_HEALTH_S = 1.0         # without lookups, a timer sends one this often (see RedisTier._keep_measured)
NEAR_MAX_BYTES = 16 << 20  # the Redis tier's near copy (rows of the buckets read), least recently used out
KEY_PREFIX = "shadowtest:agent:cache:"
_SAME = 0.999999            # an entry this similar to a new one is the same book: the new one replaces it
_TIERS = TIERS   # an entry stores its tier as an index into this (FULL 0, LIGHT 1)

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


class CacheHooks(Protocol):
    """Where the cache reports (the guard: metrics, events, the DependencySlow alert)."""

    def on_cache(self, result: str) -> None:
        """Once per lookup: hit_local | hit_redis | stale | miss."""

    def on_dependency(self, dependency: str, op: str, seconds: float, error: str | None) -> None:
        """Once per Redis operation tried: op get | set, error None | timeout | error."""

    def on_circuit(self, dependency: str, old: str, new: str) -> None:
        """On every circuit state change."""


class NullCacheHooks:
    """Reports nowhere (unit tests, or a guard without the hooks)."""

    def on_cache(self, result: str) -> None:
        pass

    def on_dependency(self, dependency: str, op: str, seconds: float, error: str | None) -> None:
        pass

    def on_circuit(self, dependency: str, old: str, new: str) -> None:
        pass


@dataclass(frozen=True)
class CacheSettings:
    """The cache options of `agent serve` (see ServeOptions)."""

    mode: str = "off"
    redis_url: str | None = None
    threshold: float = 0.85
    local_ttl_s: float = 60.0
    redis_ttl_s: float = 3600.0
    redis_timeout_ms: float = 5.0
    circuit_failures: int = 5
    circuit_open_s: float = 2.0
    redis_tracking: bool = True

    @classmethod
    def from_options(cls, o: ServeOptions) -> CacheSettings:
        return cls(o.cache, o.redis_url, o.cache_threshold, o.cache_local_ttl_s, o.cache_redis_ttl_s,
                   o.redis_timeout_ms, o.circuit_failures, o.circuit_open_s, o.redis_tracking)

    def validate(self) -> None:
        """Raises ServeError, one line naming the flag, for a value the cache cannot work with."""
        if self.mode not in CACHE_MODES:
            raise ServeError(f"--cache {self.mode}: must be one of {', '.join(CACHE_MODES)}")
        if not (math.isfinite(self.threshold) and 0 < self.threshold <= 1):
            raise ServeError(f"--cache-threshold {self.threshold:g}: must be in (0, 1] (a cosine similarity)")
        for flag, value in (("--cache-local-ttl-s", self.local_ttl_s), ("--cache-redis-ttl-s", self.redis_ttl_s),
                            ("--redis-timeout-ms", self.redis_timeout_ms), ("--circuit-open-s", self.circuit_open_s)):
            if not (math.isfinite(value) and value > 0):
                raise ServeError(f"{flag} {value:g}: must be a positive number")
        if self.redis_ttl_s < self.local_ttl_s:
            raise ServeError(f"--cache-redis-ttl-s {self.redis_ttl_s:g} is shorter than --cache-local-ttl-s "
                             f"{self.local_ttl_s:g}: the hard TTL must be at least the soft one")
        if self.circuit_failures < 1:
            raise ServeError(f"--circuit-failures {self.circuit_failures}: must be at least 1")
        if self.mode == "redis":
            self._validate_url()

    def _validate_url(self) -> None:
        if not self.redis_url:
            raise ServeError("--cache redis needs --redis-url (e.g. redis://127.0.0.1:6379/0)")
        try:
            parse_url(self.redis_url)
        except ValueError as exc:
            raise ServeError(f"--redis-url {self.redis_url}: {exc}") from exc


# -- matching ---------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Probe:
    """A request as the cache sees it: its bucket and its unit vector (`ready`: see _Ready)."""

    key: str
    vector: bytes   # float32 bytes (similarity.py), unit norm (or all zeros: matches nothing)
    ready: _Ready | None = None


@dataclass(slots=True)
class Entry:
    """One cached model answer."""

    vector: bytes               # float32 bytes, as Probe.vector
    output: tuple[float, ...]   # the model's output row
    tier: str
    written: float              # clock.wall() when computed (comparable across agents, for Redis)
    refreshing: bool = False


@dataclass(frozen=True, slots=True)
class Hit:
    entry: Entry
    source: str                 # local | redis | stale


def probe_for(symbol: str, position: float, feats: Features) -> Probe:
    """The bucket key (symbol, book depth, position step) and the centred, normalised feature vector."""
    x = feats.x
    n = len(x)
    return Probe(f"{symbol}|{n}|{round(position / POSITION_STEP)}", unit(x, n))


def _youngest_best(entries: Sequence[Entry], matrix: bytes, vector: bytes, best: int, threshold: float,
                   now: float, hard_ttl_s: float) -> Entry | None:
    """The most similar entry at or above `threshold` that is younger than the hard TTL, once
    entries[best] (the first maximum of the matrix's rows against `vector`) is known to reach `threshold`."""
    if now - entries[best].written < hard_ttl_s:  # the usual hit
        return entries[best]
    s = sims(matrix, vector)                    # the best is too old: the next most similar
    for i in sorted(range(len(s)), key=s.__getitem__, reverse=True):
        if s[i] < threshold:
            return None
        if now - entries[i].written < hard_ttl_s:
            return entries[i]
    return None


class _Ready:
    """What a local lookup that missed prepares for the store that follows it: the bucket it looked in
    (None: there was none), that bucket's version then, and the bucket's next matrix (the probe's vector
    first, the oldest row dropped when full). The store uses it when the bucket is the same and unchanged:
    no entry there was the same book, so nothing else goes, and the store compares nothing."""

    __slots__ = ("bucket", "version", "matrix")

    def __init__(self, bucket: _Bucket | None, version: int, matrix: bytes) -> None:
        self.bucket, self.version, self.matrix = bucket, version, matrix


class _Bucket:
    """One bucket's entries, newest first, and their vectors as one matrix (the rows' bytes one after
    another: matrix == b"".join(e.vector for e in entries)); `version` counts the changes.

    A miss is on every uncached call's path: the probe is one call (unit), the lookup one (scan) and a
    slice and concatenation of bytes, the store none (see similarity.py)."""

    __slots__ = ("entries", "matrix", "version")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.matrix = b""
        self.version = 0

    def find(self, probe: Probe, threshold: float, now: float, hard_ttl_s: float, limit: int) -> Entry | None:
        entries, vector, matrix = self.entries, probe.vector, self.matrix
        if not entries or len(entries[0].vector) != len(vector):
            return None
        best, top = scan(matrix, vector)
        if top >= threshold:
            return _youngest_best(entries, matrix, vector, best, threshold, now, hard_ttl_s)
        if top < _SAME:               # no entry is this book: ready the store that follows
            kept = matrix if len(entries) < limit else matrix[:(limit - 1) * len(vector)]
            probe.ready = _Ready(self, self.version, vector + kept)
        return None

    def push(self, entry: Entry, matrix: bytes, limit: int) -> int:
        """Add `entry` first with the matrix a lookup readied (see _Ready). Returns the change in size."""
        self.version += 1
        self.matrix = matrix
        self.entries.insert(0, entry)
        if len(self.entries) <= limit:
            return 1
        self.entries.pop()
        return 0

    def put(self, entry: Entry, replaces: Entry | None, limit: int) -> int:
        """Add `entry` first; drop `replaces`, entries with its vector, and the oldest beyond `limit`.
        Returns the change in size."""
        before = len(self.entries)
        self.version += 1
        vector = entry.vector
        if not self.entries or len(self.entries[0].vector) != len(vector):
            self.entries, self.matrix = [entry], vector
            return 1 - before
        s = sims(self.matrix, vector)
        kept = [e for e, sim in zip(self.entries, s, strict=True) if e is not replaces and sim < _SAME][:limit - 1]
        self.entries = [entry, *kept]
        self.matrix = b"".join([e.vector for e in self.entries])
        return len(self.entries) - before


# -- the local tier -------------------------------------------------------------------------------------

class LocalTier:
    """In-process LRU of buckets, each the PER_BUCKET most recent entries; at most `max_entries` in all."""

    def __init__(self, max_entries: int = LOCAL_MAX_ENTRIES, per_bucket: int = PER_BUCKET) -> None:
        self.max_entries, self.per_bucket = max_entries, per_bucket
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()
        self.size = 0

    def find(self, probe: Probe, threshold: float, now: float, hard_ttl_s: float) -> Entry | None:
        bucket = self._buckets.get(probe.key)
        if bucket is None:
            probe.ready = _Ready(None, 0, probe.vector)
            return None
        self._buckets.move_to_end(probe.key)
        return bucket.find(probe, threshold, now, hard_ttl_s, self.per_bucket)

    def put(self, key: str, entry: Entry, replaces: Entry | None = None, probe: Probe | None = None) -> None:
        """Add `entry` as the newest of its bucket; `replaces` (an entry it refreshes) or an entry with the
        same vector goes, as does the bucket's oldest when it is full, then whole buckets, LRU first.
        `probe`: the one whose lookup missed just before (entry.vector is its vector; see _Ready)."""
        bucket = self._buckets.get(key)
        ready = probe.ready if probe is not None and replaces is None and entry.vector is probe.vector else None
        if ready is not None and (ready.bucket is not bucket or (bucket is not None and ready.version != bucket.version)):
            ready = None             # the bucket changed since the lookup: it may hold this book now
        if bucket is None:
            bucket = self._buckets[key] = _Bucket()
        else:
            self._buckets.move_to_end(key)
        self.size += bucket.push(entry, ready.matrix, self.per_bucket) if ready is not None \
            else bucket.put(entry, replaces, self.per_bucket)
        while self.size > self.max_entries and self._buckets:
            _, evicted = self._buckets.popitem(last=False)
            self.size -= len(evicted.entries)

    def __len__(self) -> int:
        return self.size


# -- the circuit breaker --------------------------------------------------------------------------------

class Circuit:
    """closed --(`failures` consecutive failures)--> open --(`open_s`)--> half_open: one probe
    --success--> closed, --failure--> open again. While open nothing is tried."""

    def __init__(self, failures: int, open_s: float, clock: Clock,
                 on_change: Callable[[str, str], None] | None = None) -> None:
        self.failures_to_open, self.open_s, self.clock = failures, open_s, clock
        self._on_change = on_change
        self.state = CLOSED
        self.failures = 0
        self.opened_at = 0.0
        self._probing = False

    def allow(self) -> bool:
        """May an operation be tried now? In half_open only one at a time (the probe)."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if not self._half_open_due(self.clock.now()):
                return False
            self._move(HALF_OPEN)
        if self._probing:
            return False
        self._probing = True
        return True

    def _half_open_due(self, now: float) -> bool:
        return now - self.opened_at >= self.open_s

    def success(self) -> None:
        self.failures = 0
        self._probing = False
        if self.state != CLOSED:
            self._move(CLOSED)

    def failure(self) -> None:
        self._probing = False
        self.failures += 1
        if self.state == HALF_OPEN or (self.state == CLOSED and self.failures >= self.failures_to_open):
            self.open()

    def abandon(self) -> None:
        """The operation was cancelled (its caller went away): neither a success nor a failure."""
        self._probing = False

    def open(self) -> None:
        """Open now (also at start when Redis does not answer)."""
        self.opened_at = self.clock.now()
        if self.state != OPEN:
            self._move(OPEN)

    def _move(self, new: str) -> None:
        old, self.state = self.state, new
        if new == CLOSED:
            self.failures = 0
        if self._on_change is not None:
            self._on_change(old, new)


# -- the Redis tier -------------------------------------------------------------------------------------

_HEADER = struct.Struct("<dBB")   # written (wall s), tier index, output length; then doubles, then float32s


def pack_entry(entry: Entry) -> bytes:
    n = len(entry.output)
    return struct.pack(f"<dBB{n}d", entry.written, _TIERS.index(entry.tier) if entry.tier in _TIERS else 0, n,
                       *entry.output) + entry.vector


def unpack_entry(data: bytes) -> Entry | None:
    """An entry read back from Redis; None for bytes that are not one (another writer, a truncation)."""
    try:
        written, tier, n = _HEADER.unpack_from(data)
        output = struct.unpack_from(f"<{n}d", data, _HEADER.size)
    except struct.error:
        return None
    vector = bytes(data[_HEADER.size + 8 * n:])
    if not vector or len(vector) % 4:
        return None
    return Entry(vector, tuple(output), _TIERS[tier] if tier < len(_TIERS) else _TIERS[0], written)


def match_rows(rows: Sequence[object], vector: bytes, threshold: float, now: float,
               hard_ttl_s: float) -> Entry | None:
    """The best match (as _youngest_best) among packed entries read from Redis: a bucket holds up to
    PER_BUCKET of them; rows that are not entries of this vector's length are skipped. The usual case
    costs one compiled scan over the rows' tails and, on a hit, the decoding of one row; a best row that
    is not an entry, or is too old, takes the full path (every row decoded)."""
    listed = rows if isinstance(rows, list) else list(rows)
    best, top = scan_tails(listed, vector)
    if top < threshold:           # the usual miss: nothing decoded
        return None
    entry = unpack_entry(listed[best])   # type: ignore[arg-type]  # scan_tails took only bytes
    if entry is not None and len(entry.vector) == len(vector) and now - entry.written < hard_ttl_s:
        return entry
    entries = [e for row in listed if isinstance(row, bytes)
               and (e := unpack_entry(row)) is not None and len(e.vector) == len(vector)]
    if not entries:
        return None
    matrix = b"".join([e.vector for e in entries])
    best, top = scan(matrix, vector)
    return _youngest_best(entries, matrix, vector, best, threshold, now, hard_ttl_s) if top >= threshold else None


def _size(rows: list[bytes]) -> int:
    return sum(map(len, rows)) + 64     # + a little for the bucket itself: an empty one is not free


class _Failed:
    """The operation was skipped, timed out or failed."""


FAILED = _Failed()


class AskRedis:
    """Only a round trip to Redis can answer this lookup (see RedisTier.find_near)."""


ASK_REDIS = AskRedis()


def _retrieve(task: asyncio.Task[RespConnection]) -> None:
    if not task.cancelled():
        task.exception()


_PING = command("PING")
_HELLO3 = command("HELLO", "3")
_TRACKING = command("CLIENT", "TRACKING", "ON", "BCAST", "PREFIX", KEY_PREFIX, "NOLOOP")
_LRANGE = b"*4\r\n$6\r\nLRANGE\r\n"
_LTRIM = b"*4\r\n$5\r\nLTRIM\r\n"
_EXPIRE = b"*3\r\n$6\r\nEXPIRE\r\n"
_TO_LAST = command("0", str(PER_BUCKET - 1))[4:]   # "0 PER_BUCKET-1": LRANGE's and LTRIM's range, RESP


class RedisTier:
    """The shared long-term tier: one Redis list per bucket (newest first, PER_BUCKET long, expiring
    after the hard TTL), over one pipelined connection (RespConnection). Every operation goes through
    `_bounded`: circuit, budget, metrics (op "get": one lookup, LRANGE; op "set": one write batch, LPUSH,
    LTRIM, EXPIRE per bucket; op "ping": a health PING, see tick).

    The near copy (`tracking`, Redis >= 6). A lookup's round trip is most of what a Redis miss costs
    the agent (~50 us of CPU in asyncio and syscalls against ~10 us for the rest of the cache). So the
    connection asks Redis to track it (HELLO 3; CLIENT TRACKING ON BCAST PREFIX <ours> NOLOOP): Redis
    then pushes an invalidation on this connection whenever another client changes one of our keys (a
    write, an expiry, an eviction, a flush), and the tier keeps the rows of each bucket it has read
    until one comes. A lookup in a bucket held there, while the circuit is closed, asks Redis nothing
    (find_near: no await either). Replies and pushes arrive in one ordered stream, and a read's rows are
    kept as its reply is parsed (RespConnection `then`), so no invalidation can slip between the two.
    Our own writes invalidate nothing (NOLOOP) and are not added to the copy: the local tier holds them.
    Any failure (a timeout, an error, a lost connection) drops the copy: the next lookups read Redis,
    as without one. What the copy lacks or still holds is never a wrong answer: every row in it is an
    entry some agent computed, judged by its own age; the cost is a miss (our own entry, once the local
    tier has evicted it) or a hit on an entry Redis has trimmed since. Redis refusing HELLO 3 or CLIENT
    TRACKING (older than 6, a proxy, an ACL without them) leaves the tier without a copy, every miss one
    round trip, logged once."""

    def __init__(self, url: str, timeout_s: float, ttl_s: float, circuit: Circuit, hooks: CacheHooks,
                 tracking: bool = True, health_s: float | None = HEALTH_INTERVAL_S,
                 idle_health_s: float = IDLE_HEALTH_S) -> None:
        self.timeout_s, self.ttl_s, self.circuit, self.hooks = timeout_s, ttl_s, circuit, hooks
        self.tracking, self.health_s, self.idle_health_s = tracking, health_s, idle_health_s
        self._health: asyncio.Task[None] | None = None
        self._ping: asyncio.Task[object] | None = None
        self._last_sent = 0.0
        self._tracked: RespConnection | None = None     # the connection whose invalidations keep the copy true
        self._near: OrderedDict[bytes, list[bytes]] = OrderedDict()   # bucket key -> its rows, newest first
        self._near_bytes = 0
        self.near_reads = 0                             # lookups the copy answered (no round trip)
        self._refused_logged = False
        self.address = parse_url(url)
        # A backstop only (the budget bounds a call): a connect slower than this fails, and a connection
        # whose oldest reply is overdue by this much is taken for dead and replaced. None: no backstop.
        self.backstop: float | None = max(1.0, 20 * timeout_s)
        self._conn: RespConnection | None = None
        self._connecting: asyncio.Task[RespConnection] | None = None
        self.reads = 0
        self._pending: deque[tuple[bytes, bytes]] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._soon: asyncio.Future[None] | None = None   # the writer's linger, ended early by put()
        self._lingering_since = 0.0
        self.dropped_writes = 0

    async def start(self, timeout_s: float) -> bool:
        """PING within `timeout_s`; on failure the circuit opens (the agent starts all the same). Then the
        idle health PINGs start (see tick and _keep_measured)."""
        if self.health_s is not None and self._health is None:
            self._health = asyncio.get_running_loop().create_task(self._keep_measured(self.idle_health_s))
        try:
            async with asyncio.timeout(timeout_s):
                await self._call(_PING, 1)
        except (TimeoutError, RedisReplyError, OSError) as exc:
            _log.warning("redis not answering at start (%s); circuit open", type(exc).__name__)
            self.circuit.open()
            return False
        return True

    def tick(self) -> None:
        """Every lookup calls this: a health PING (op "ping": within the budget, counted by the circuit,
        in the histogram) when nothing else went to Redis for `health_s`. With the near copy most misses
        ask Redis nothing and the writes go out every 100 ms: without these, a busy period has too few
        operations for DependencySlow to judge (it could fire and never resolve), and a slow Redis would
        show only in the writes. With an open circuit the PING is skipped until it half-opens; then it
        is the probe. ~40 a second at most. A PING rides on a lookup, not a timer: in a VM a wake-up
        from idle costs ~100-200 us of CPU, more than the PING, and a call has woken the loop already."""
        if self.health_s is None:
            return
        now = time.monotonic()
        if now - self._last_sent >= self.health_s and (self._ping is None or self._ping.done()):
            self._last_sent = now
            self._ping = asyncio.get_running_loop().create_task(self._health_ping())

    async def _health_ping(self) -> object:
        """One health PING: op "ping", within the budget, counted by the circuit (see tick)."""
        return await self._bounded("ping", partial(self._call, _PING, 1))

    async def _keep_measured(self, interval_s: float) -> None:
        """Without lookups (an agent without calls), a PING whenever nothing went to Redis for
        `interval_s`: the circuit still half-opens and closes, and the dependency stays measured."""
        while True:
            await asyncio.sleep(interval_s)
            if time.monotonic() - self._last_sent >= interval_s:
                await self._health_ping()

    async def _call(self, payload: bytes, replies: int, then: Then | None = None) -> object:
        """Send `payload` on the connection (made first if there is none) and wait for its last reply."""
        conn = self._conn
        now = self._last_sent = time.monotonic()
        if conn is None or conn.lost or self._overdue(conn, now):
            conn = await self._connection()
        return await conn.send(payload, replies, now, then)

    def _overdue(self, conn: RespConnection, now: float) -> bool:
        backstop = self.backstop
        oldest = conn.oldest()
        if backstop is None or oldest is None or now - oldest < backstop:
            return False
        _log.warning("redis: a reply is %.1f s overdue; reconnecting", now - oldest)
        conn.close()
        self._conn = None
        return True

    async def _connection(self) -> RespConnection:
        """The connection, made by one task that every caller waits on (a caller that gives up at its
        budget leaves it running for the others)."""
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.get_running_loop().create_task(self._connect())
            self._connecting.add_done_callback(_retrieve)   # its failure is each waiter's, reported there
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> RespConnection:
        address, loop = self.address, asyncio.get_running_loop()
        setup = address.setup()
        async with asyncio.timeout(self.backstop):
            if address.path is not None:
                _, conn = await loop.create_unix_connection(RespConnection, address.path)
            else:
                _, conn = await loop.create_connection(RespConnection, address.host, address.port)
        try:
            if setup:
                await conn.send(b"".join(setup), len(setup), time.monotonic())
            if self.tracking:
                await self._track(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    async def _track(self, conn: RespConnection) -> None:
        """Turn on client tracking for our keys (see the class); a Redis that refuses leaves no copy."""
        try:
            await conn.send(_HELLO3, 1, time.monotonic())       # pushes need RESP3 (one at a time: a
            await conn.send(_TRACKING, 1, time.monotonic())     # refused HELLO must not leave RESP2 tracking)
        except RedisReplyError as exc:
            if not self._refused_logged:
                self._refused_logged = True
                _log.warning("redis refused client tracking (%s): every miss asks Redis", str(exc)[:120])
            return
        self._forget()
        conn.on_push, conn.on_lost = self._invalidated, self._lost
        self._tracked = conn

    def _lost(self, conn: RespConnection) -> None:
        if conn is self._tracked:
            self._tracked = None
            self._forget()

    def _forget(self) -> None:
        self._near.clear()
        self._near_bytes = 0

    def _invalidated(self, push: Push) -> None:
        """Redis's word that keys changed: ["invalidate", [key, ...]], or None for all (a flush)."""
        if len(push) < 2 or push[0] != b"invalidate":
            return
        keys = push[1]
        if keys is None:
            self._forget()
        elif isinstance(keys, list):
            for key in keys:
                rows = self._near.pop(key, None) if isinstance(key, bytes) else None
                if rows is not None:
                    self._near_bytes -= _size(rows)

    def _keep(self, key: bytes, conn: RespConnection, reply: object) -> None:
        """A lookup's reply, as it is parsed: keep its rows in the near copy (see the class)."""
        if conn is not self._tracked or not isinstance(reply, list):
            return
        rows = [row for row in reply[:PER_BUCKET] if isinstance(row, bytes)]
        old = self._near.pop(key, None)
        if old is not None:
            self._near_bytes -= _size(old)
        self._near[key] = rows
        self._near_bytes += _size(rows)
        while self._near_bytes > NEAR_MAX_BYTES and self._near:
            _, evicted = self._near.popitem(last=False)
            self._near_bytes -= _size(evicted)

    @property
    def tracking_active(self) -> bool:
        """Is the near copy in use (tracking asked for, and Redis agreed on the current connection)?"""
        return self._tracked is not None      # (a lost connection unsets it: _lost)

    async def _bounded(self, op: str, call: Callable[[], Awaitable[_T]]) -> _T | _Failed:
        """Run `call()` if the circuit allows, abandoning it at the budget; report it either way."""
        if not self.circuit.allow():
            return FAILED
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout_s):
                result = await call()
        except TimeoutError:
            return self._failed(op, start, "timeout")
        except asyncio.CancelledError:
            self.circuit.abandon()
            raise
        except Exception:  # noqa: BLE001 - RedisReplyError, OSError or a client bug: never the call's failure
            return self._failed(op, start, "error")
        self.hooks.on_dependency(DEPENDENCY, op, time.perf_counter() - start, None)
        self.circuit.success()
        return result

    def _failed(self, op: str, start: float, kind: str) -> _Failed:
        self.hooks.on_dependency(DEPENDENCY, op, time.perf_counter() - start, kind)
        self.circuit.failure()
        self._forget()     # Redis is slow or failing: its invalidations may lag, our writes may be lost
        return FAILED

    def find_near(self, probe: Probe, threshold: float, now: float) -> Entry | None | AskRedis:
        """The best match in the probe's bucket from the near copy, without an await; ASK_REDIS when the
        copy does not hold the bucket (or is not in use: no tracking, the circuit not closed)."""
        if self._tracked is None or self.circuit.state != CLOSED:
            return ASK_REDIS
        key = (KEY_PREFIX + probe.key).encode()
        near = self._near.get(key)
        if near is None:
            return ASK_REDIS
        self._near.move_to_end(key)
        self.near_reads += 1
        return match_rows(near, probe.vector, threshold, now, self.ttl_s) if near else None

    async def find(self, probe: Probe, threshold: float, now: float) -> Entry | None:
        """The best match in the probe's bucket, or None (also when Redis is skipped, slow or failing):
        from the near copy if it holds the bucket, else one round trip (fetch)."""
        near = self.find_near(probe, threshold, now)
        if isinstance(near, AskRedis):
            return await self.fetch(probe, threshold, now)
        return near

    async def fetch(self, probe: Probe, threshold: float, now: float) -> Entry | None:
        """find() by a round trip (LRANGE); the rows are kept in the near copy when it is in use."""
        key = (KEY_PREFIX + probe.key).encode()
        if self.reads >= MAX_REDIS_READS:
            return None
        self.reads += 1
        payload = with_key(_LRANGE, key, _TO_LAST)
        try:
            rows = await self._bounded("get", partial(self._call, payload, 1,
                                                      partial(self._keep, key) if self._tracked is not None else None))
        finally:
            self.reads -= 1
        if not isinstance(rows, list) or not rows:
            return None
        return match_rows(rows, probe.vector, threshold, now, self.ttl_s)

    def put(self, key: str, entry: Entry) -> None:
        """Queue a write for the one background writer (fire-and-forget); dropped when MAX_PENDING_WRITES
        wait already. Writes made while the writer lingers or is busy go together in its next round trip;
        a put that finds the oldest waiting WRITE_EARLY_S (or a full batch) sends them now (see _linger)."""
        pending = self._pending
        if len(pending) >= MAX_PENDING_WRITES:
            self.dropped_writes += 1
            return
        pending.append(((KEY_PREFIX + key).encode(), pack_entry(entry)))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._drain())
        elif (soon := self._soon) is not None and not soon.done() and (
                len(pending) >= WRITE_BATCH or time.monotonic() - self._lingering_since >= WRITE_EARLY_S):
            soon.set_result(None)

    async def _drain(self) -> None:
        """Write what is queued, WRITE_BATCH entries per round trip, until nothing is, lingering while
        less than a batch waits; a batch the circuit or Redis refuses is dropped (the cache is an
        optimisation: nothing retries)."""
        while self._pending:
            if len(self._pending) < WRITE_BATCH:
                await self._linger()
                if not self._pending:       # (emptied meanwhile: close())
                    break
            batch = [self._pending.popleft() for _ in range(min(WRITE_BATCH, len(self._pending)))]
            payload, replies = self._push_commands(batch)
            if isinstance(await self._bounded("set", partial(self._call, payload, replies)), _Failed):
                self.dropped_writes += len(batch)

    async def _linger(self) -> None:
        """Wait WRITE_LINGER_S for more writes to join, or until a put() ends the wait: one that comes
        WRITE_EARLY_S into it, or fills a batch. While calls flow, a call sends the batch and the timer
        never fires: in a VM a timer's wake-up from idle costs more CPU than the round trip."""
        self._lingering_since = time.monotonic()
        self._soon = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(WRITE_LINGER_S):
                await self._soon
        except TimeoutError:
            pass
        finally:
            self._soon = None

    def _push_commands(self, batch: list[tuple[bytes, bytes]]) -> tuple[bytes, int]:
        """LPUSH (the last value ends up first: newest first), LTRIM, EXPIRE per key, as one payload."""
        by_key: dict[bytes, list[bytes]] = {}
        for key, data in batch:
            by_key.setdefault(key, []).append(data)
        ttl = command(str(max(1, math.ceil(self.ttl_s))))[4:]
        parts: list[bytes] = []
        for key, values in by_key.items():
            pushed = b"".join([b"$%d\r\n%s\r\n" % (len(v), v) for v in values])
            parts += (with_key(b"*%d\r\n$5\r\nLPUSH\r\n" % (2 + len(values)), key, pushed),
                      with_key(_LTRIM, key, _TO_LAST), with_key(_EXPIRE, key, ttl))
        return b"".join(parts), len(parts)

    async def close(self, timeout_s: float = 1.0) -> None:
        """Cancel the writes in flight and close the connection, within `timeout_s` (a stopped Redis
        must not hold up the agent's shutdown)."""
        self._pending.clear()
        self._forget()
        tasks = [t for t in (self._writer, self._connecting, self._health, self._ping) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await asyncio.gather(*tasks, return_exceptions=True)
        if self._conn is not None:
            self._conn.close()      # the transport closes at the loop's next turn: nothing to wait for
            self._conn = None


# -- the cache ------------------------------------------------------------------------------------------

Compute = Callable[[], Awaitable[tuple[tuple[float, ...], str]]]


@dataclass
class ResponseCache:
    """Local tier, optional Redis tier, stale-while-revalidate. Lives on the event loop thread."""

    settings: CacheSettings
    hooks: CacheHooks = field(default_factory=NullCacheHooks)
    clock: Clock = field(default_factory=MonotonicClock)
    local: LocalTier = field(default_factory=LocalTier)
    redis: RedisTier | None = None
    refreshes: set[asyncio.Task[None]] = field(default_factory=set)

    def probe(self, symbol: str, position: float, feats: Features) -> Probe:
        return probe_for(symbol, position, feats)

    async def lookup(self, probe: Probe) -> Hit | None:
        """Local first, then Redis (within its budget); reports hit_local | hit_redis | stale | miss."""
        hit = self.lookup_now(probe)
        if isinstance(hit, AskRedis):
            return await self.lookup_redis(probe)
        return hit

    def lookup_now(self, probe: Probe) -> Hit | None | AskRedis:
        """lookup() as far as it goes without an await: the local tier, then the Redis tier's near copy;
        ASK_REDIS (nothing reported yet) when only a round trip can tell, then lookup_redis(). A miss is
        on every uncached call's path, and a coroutine or two per call cost it a few us for nothing."""
        now = self.clock.wall()
        s = self.settings
        entry = self.local.find(probe, s.threshold, now, s.redis_ttl_s)
        redis = self.redis
        if redis is not None:
            redis.tick()
        if entry is not None or redis is None:
            return self._answer(entry, "local", now)
        near = redis.find_near(probe, s.threshold, now)
        if isinstance(near, AskRedis):
            return near
        return self._from_redis(probe, near, now)

    async def lookup_redis(self, probe: Probe) -> Hit | None:
        """The rest of a lookup that lookup_now() could not answer: one round trip, within its budget."""
        assert self.redis is not None, "lookup_now() says ASK_REDIS only with a Redis tier"
        now = self.clock.wall()
        return self._from_redis(probe, await self.redis.fetch(probe, self.settings.threshold, now), now)

    def _from_redis(self, probe: Probe, entry: Entry | None, now: float) -> Hit | None:
        if entry is not None:
            self.local.put(probe.key, entry)
        return self._answer(entry, "redis", now)

    def _answer(self, entry: Entry | None, source: str, now: float) -> Hit | None:
        if entry is None:
            self.hooks.on_cache("miss")
            return None
        if now - entry.written >= self.settings.local_ttl_s:
            source = "stale"
        self.hooks.on_cache("hit_" + source if source != "stale" else "stale")
        return Hit(entry, source)

    def store(self, probe: Probe, output: Sequence[float], tier: str,
              replaces: Entry | None = None) -> Entry:
        """Keep a freshly computed answer: locally now, in Redis in the background."""
        entry = Entry(probe.vector, tuple(output), tier, self.clock.wall())
        self.local.put(probe.key, entry, replaces, probe)
        if self.redis is not None:
            self.redis.put(probe.key, entry)
        return entry

    def revalidate(self, probe: Probe, stale: Entry, compute: Compute) -> bool:
        """Start one background refresh of a stale entry through the slow path; False when one already
        runs for it or MAX_REFRESHES are in flight (a later stale hit tries again)."""
        if stale.refreshing or len(self.refreshes) >= MAX_REFRESHES:
            return False
        stale.refreshing = True
        task = asyncio.get_running_loop().create_task(self._refresh(probe, stale, compute))
        self.refreshes.add(task)
        task.add_done_callback(self.refreshes.discard)
        return True

    async def _refresh(self, probe: Probe, stale: Entry, compute: Compute) -> None:
        try:
            output, tier = await compute()
        except Exception:  # noqa: BLE001 - a failed refresh leaves the stale entry; a later hit retries
            stale.refreshing = False
            _log.debug("cache refresh failed", exc_info=True)
            return
        self.store(probe, output, tier, replaces=stale)

    async def close(self) -> None:
        for task in list(self.refreshes):
            task.cancel()
        await asyncio.gather(*self.refreshes, return_exceptions=True)
        if self.redis is not None:
            await self.redis.close()


async def build_cache(settings: CacheSettings, hooks: CacheHooks, clock: Clock | None = None) -> ResponseCache | None:
    """The cache for `settings` (None when off); with Redis, PINGs it once (down: circuit open, still starts)."""
    settings.validate()
    if settings.mode == "off":
        return None
    clock = clock or MonotonicClock()
    cache = ResponseCache(settings, hooks, clock)
    if settings.mode == "redis":
        assert settings.redis_url is not None, "validate() requires it"

        def changed(old: str, new: str) -> None:
            hooks.on_circuit(DEPENDENCY, old, new)

        circuit = Circuit(settings.circuit_failures, settings.circuit_open_s, clock, changed)
        cache.redis = RedisTier(settings.redis_url, settings.redis_timeout_ms / 1000, settings.redis_ttl_s,
                                circuit, hooks, settings.redis_tracking)
        await cache.redis.start(max(0.25, settings.redis_timeout_ms / 1000))
    return cache
