"""Right answers, compared: each OK response against the recording's, or against known-good references,
with noise cancelled the way Twitter's Diffy does (`responses_match`).

    against: recording   the replayed call's response vs the one recorded for it, compared online in the
                         replay engine's comparer slot (harness.responses.Validator). Noise: a field whose
                         recorded value differs between two calls with byte-identical requests varies by
                         itself (a timestamp, a latency, a request id), so it never counts.
    against: reference   a bounded, seeded sample of the run's OK calls is sent again, after the run, to two
                         references running the known-good build (the bundled agent started twice by the
                         harness, or two gRPC addresses). A field whose value differs between the two
                         references on the same request is noise; only differences from the primary
                         reference beyond that noise count.

A response is compared as a flat document: protobuf (the method's type) or JSON, flattened to dotted
paths with list indices ("levels[2].bid_price"); numbers equal within `tolerance` (absolute) or
RELATIVE (1e-5) are equal: a model computing in float32 gives one request answers that differ by
~1e-8 with the size of the batch it rode in. `ignore` globs name fields that never count.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

DIFFERS = "differs"          # the prefix of a call's mismatch lines: "differs[CHECK ID]: path: a != b"
MAX_DIFFS = 10               # lines kept per call
MAX_SAMPLES = 2000           # calls sent again to the references, at most (a seeded reservoir)
MAX_REQUEST_KEYS = 20_000    # distinct requests remembered for noise in recorded responses
MAX_LEAVES = 5_000           # fields of one document compared, at most (a bigger one is cut, and says so)
_VALUE_CHARS = 40
RELATIVE = 1e-5              # float32 rounding (numpy's allclose uses the same rtol)


@dataclass(frozen=True)
class MatchSpec:
    """One `responses_match` check's settings."""

    id: str
    against: str = "recording"                 # recording | reference
    references: tuple[str, ...] = ()           # "agent" or two HOST:PORT
    ignore: tuple[str, ...] = ()
    tolerance: float = 0.0
    method: str = ""
    max_calls: int = MAX_SAMPLES

    def applies(self, method: str | None) -> bool:
        return not self.method or bool(method) and (method == self.method or str(method).endswith(self.method))


def flatten(doc: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Leaves of a decoded document by path: {"a.b": 1, "items[0].id": 7, "empty": []} (bounded)."""
    out = {} if out is None else out
    if len(out) >= MAX_LEAVES:
        out["..."] = "cut"
        return out
    if isinstance(doc, dict) and doc:
        for key in sorted(doc):
            flatten(doc[key], f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(doc, list) and doc:
        for i, item in enumerate(doc):
            flatten(item, f"{prefix}[{i}]", out)
    else:
        out[prefix or "$"] = doc
    return out


def number(v: Any) -> float | None:
    """A JSON value as a number: ints, floats and numeric strings (protobuf's JSON form writes 64-bit
    integers as strings); None for anything else, booleans included."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def same(a: Any, b: Any, tolerance: float) -> bool:
    """Equal, numbers within `tolerance` (absolute) or RELATIVE; true is not 1."""
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if a == b:
        return True
    x, y = number(a), number(b)
    if x is None or y is None or not (math.isfinite(x) and math.isfinite(y)):
        return False
    return abs(x - y) <= max(tolerance, RELATIVE * max(abs(x), abs(y)))


def bare(path: str) -> str:
    """The path without list indices: "levels[2].bid_price" -> "levels.bid_price" (for globs, noise)."""
    out, depth = [], 0
    for ch in path:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)


def ignored(path: str, globs: Iterable[str]) -> bool:
    b = bare(path)
    return any(fnmatch.fnmatch(path, g) or fnmatch.fnmatch(b, g) for g in globs)


def differing(want: dict[str, Any], got: dict[str, Any], tolerance: float) -> dict[str, tuple[Any, Any]]:
    """Paths whose values differ between two flat documents, with (want, got); absent is None."""
    return {p: (want.get(p), got.get(p)) for p in sorted(set(want) | set(got))
            if p not in want or p not in got or not same(want[p], got[p], tolerance)}


def _short(v: Any) -> str:
    text = "missing" if v is None else json.dumps(v, ensure_ascii=False, default=str)
    return text if len(text) <= _VALUE_CHARS else text[:_VALUE_CHARS - 3] + "..."


def diff_lines(diffs: dict[str, tuple[Any, Any]], noise: set[str], globs: Iterable[str]) -> list[str]:
    """"path: want != got" for each difference that is neither noise nor ignored (at most MAX_DIFFS)."""
    out = [f"{p}: {_short(a)} != {_short(b)}" for p, (a, b) in diffs.items()
           if bare(p) not in noise and not ignored(p, globs)]
    return out[:MAX_DIFFS]


def path_of(line: str) -> str:
    """The field path of one diff line."""
    return line.split(": ", 1)[0]


class RecordingNoise:
    """Fields whose recorded values differ between calls with byte-identical requests (bounded)."""

    def __init__(self) -> None:
        self.noise: set[str] = set()
        self._seen: dict[bytes, dict[str, Any]] = {}

    def add(self, request: bytes, recorded: dict[str, Any], tolerance: float) -> None:
        key = hashlib.blake2b(request, digest_size=16).digest()
        first = self._seen.get(key)
        if first is None:
            if len(self._seen) < MAX_REQUEST_KEYS:
                self._seen[key] = recorded
            return
        self.noise |= {bare(p) for p in differing(first, recorded, tolerance)}


@dataclass
class Sample:
    """One OK call kept to be sent again to the references."""

    index: int
    intended_s: float
    method: str
    request: bytes
    response: bytes


@dataclass
class Reservoir:
    """A seeded uniform sample of at most `size` calls out of all offered (Vitter's algorithm R)."""

    size: int
    seed: int
    seen: int = 0
    items: list[Sample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def offer(self, item: Sample) -> None:
        self.seen += 1
        if len(self.items) < self.size:
            self.items.append(item)
            return
        j = self._rng.randrange(self.seen)
        if j < self.size:
            self.items[j] = item


Decode = Callable[[str, bytes], Any]   # (method, response bytes) -> document or None


def against_references(spec: MatchSpec, samples: list[Sample], primary: list[bytes | None],
                       secondary: list[bytes | None], decode: Decode) -> dict[str, Any]:
    """Judge each sampled call's response against the primary reference, with the fields the two
    references disagree on as noise. Returns {"calls": [(intended_s, method, [diff lines])], "noise":
    [...], "unanswered": n, "undecodable": n} (a call a reference did not answer is left out, counted)."""
    flat: list[tuple[Sample, dict[str, Any], dict[str, Any], dict[str, Any] | None]] = []
    unanswered = undecodable = 0
    noise: set[str] = set()
    for s, a, b in zip(samples, primary, secondary, strict=True):
        if a is None:
            unanswered += 1
            continue
        got, want = decode(s.method, s.response), decode(s.method, a)
        other = decode(s.method, b) if b is not None else None
        if got is None or want is None:
            undecodable += 1
            continue
        fw, fo = flatten(want), (flatten(other) if other is not None else None)
        if fo is not None:
            noise |= {bare(p) for p in differing(fw, fo, spec.tolerance)}
        flat.append((s, flatten(got), fw, fo))
    calls = [(s.intended_s, s.method, diff_lines(differing(fw, fg, spec.tolerance), noise, spec.ignore))
             for s, fg, fw, _ in flat]
    return {"calls": calls, "noise": sorted(noise), "unanswered": unanswered, "undecodable": undecodable}


def send_again(address: str, samples: list[Sample], timeout_s: float = 5.0, in_flight: int = 16,
               budget_s: float = 120.0) -> list[bytes | None]:
    """Each sample's request sent to the gRPC service at `address` (unary, plaintext, the bytes as
    recorded), in order, `in_flight` at a time; its response bytes, None where the call failed or the
    `budget_s` ran out (a reference that does not answer leaves those calls out, counted)."""
    import time

    import grpc

    out: list[bytes | None] = [None] * len(samples)
    deadline = time.monotonic() + budget_s
    with grpc.insecure_channel(address) as channel:
        stubs: dict[str, Any] = {}
        pending: list[tuple[int, Any]] = []

        def settle(i: int, fut: Any) -> None:
            try:
                out[i] = fut.result()
            except grpc.RpcError:
                out[i] = None

        for i, s in enumerate(samples):
            if time.monotonic() > deadline:
                break
            stub = stubs.get(s.method)
            if stub is None:
                stub = stubs[s.method] = channel.unary_unary(s.method)   # bytes in, bytes out
            pending.append((i, stub.future(s.request, timeout=timeout_s)))
            if len(pending) >= in_flight:
                settle(*pending.pop(0))
        for i, fut in pending:
            settle(i, fut)
    return out
