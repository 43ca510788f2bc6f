"""The shadow check: replayed responses against recorded ones, by status, bytes, JSON path and protobuf field.

    recorded Call (status, response bytes) --+
                                             +--> Comparer.compare -> ["status: 0 != 8", "confidence", ...]
    replayed SendOutcome (code, bytes) ------+        |
                                                      v  summary(): by method {compared, mismatched, fields},
                                                         calls: the first mismatched calls and where they differ

The comparer is chosen by each call's protocol. gRPC: field by field with the method's output type,
from server reflection (`descriptors_from_reflection`) or from generated modules / a protoset file
(`descriptors_from_modules`, `descriptors_from_file`); without one, differing bytes are one mismatch,
"bytes: ... at byte N". HTTP/1 and plain HTTP/2 bodies: as JSON when both sides parse as JSON (a
difference is its path, "$.price: 10 != 11"), else byte-wise ("body: differs at byte N ...").
Reflection is asked only when the recording holds gRPC calls: an HTTP/1 target never gets an HTTP/2
preface. Noisy fields are ignored by glob on their path ("server_latency_ns", "stages*", "*.ts_ns"; for
JSON "items.id" is the id of every element of items).
"""

from __future__ import annotations

import fnmatch
import importlib
import json
from collections import Counter, defaultdict
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError, Message

from replay.errors import CompareError
from replay.schedule import PlannedCall
from replay.senders import SendOutcome
from replay.senders.tls import TlsConfig


class Descriptors:
    """Output (and input) message classes by full method name, looked up lazily in a descriptor pool."""

    def __init__(self, pool: descriptor_pool.DescriptorPool, services: Iterable[str] = ()) -> None:
        self.pool = pool
        self.services = tuple(services)  # full names of the services the source offers (method inference)
        self._cache: dict[tuple[str, bool], type[Message] | None] = {}

    def output_class(self, method: str | None) -> type[Message] | None:
        return self._class(method, output=True)

    def input_class(self, method: str | None) -> type[Message] | None:
        return self._class(method, output=False)

    def _class(self, method: str | None, output: bool) -> type[Message] | None:
        if not method:
            return None
        if (method, output) not in self._cache:
            self._cache[method, output] = self._lookup(method, output)
        return self._cache[method, output]

    def _lookup(self, method: str, output: bool) -> type[Message] | None:
        service, _, name = method.strip("/").rpartition("/")
        try:
            desc = self.pool.FindServiceByName(service).FindMethodByName(name)
        except KeyError:
            return None
        if desc is None:
            return None
        cls: type[Any] = message_factory.GetMessageClass(desc.output_type if output else desc.input_type)
        return cls


def descriptors_from_modules(*modules: str) -> Descriptors:
    """Descriptors from generated `_pb2` modules (their files land in the default pool on import)."""
    services: list[str] = []
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise CompareError(f"cannot import descriptor module {name}: {exc}") from exc
        file = getattr(module, "DESCRIPTOR", None)
        services += [s.full_name for s in getattr(file, "services_by_name", {}).values()]
    return Descriptors(descriptor_pool.Default(), services)


def descriptors_from_file(path: str | Path) -> Descriptors:
    """Descriptors from a protoset (`protoc --include_imports --descriptor_set_out=FILE`)."""
    try:
        fds = descriptor_pb2.FileDescriptorSet.FromString(Path(path).read_bytes())
    except (OSError, DecodeError) as exc:
        raise CompareError(f"cannot read descriptor set {path}: {exc}; make one with protoc "
                           f"--include_imports --descriptor_set_out") from exc
    pool = descriptor_pool.DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    return Descriptors(pool, [f"{f.package}.{s.name}".lstrip(".") for f in fds.file for s in f.service])


def descriptors_from_reflection(target: str, timeout_s: float = 5.0, tls: TlsConfig | None = None,
                                metadata: tuple[tuple[str, str], ...] = ()) -> Descriptors:
    """Descriptors fetched from the target's server reflection (read-only: it lists the services and
    asks for the files that define them). Every reflection call has a `timeout_s` deadline.

    tls: a replay.senders.tls.TlsConfig for a TLS target (verified: grpcio cannot skip verification);
    metadata: sent with every reflection call (the replay's --set-header credentials and its marker).
    Raises CompareError when the target does not answer reflection."""
    import grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    if tls is None:
        channel = grpc.insecure_channel(target)
    elif tls.insecure:
        raise CompareError(f"cannot ask {target} for reflection with --insecure (grpcio always verifies): give "
                           "the CA with --ca, or pass --descriptors FILE.protoset")
    else:
        channel = grpc.secure_channel(target, tls.grpc_credentials(), options=tls.grpc_options())
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        # The database sets no deadline of its own: a server that accepts and never answers would hang us.
        db = ProtoReflectionDescriptorDatabase(_with_deadline(channel, timeout_s, metadata))
        services = db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        for s in services:  # fetch now, while the channel is known good; the run needs no reflection
            pool.FindServiceByName(s)
    except (grpc.FutureTimeoutError, grpc.RpcError, KeyError, AssertionError) as exc:
        # KeyError / AssertionError: the database's answer to a NOT_FOUND or another error response
        channel.close()
        how = " over TLS" if tls is not None else ""
        raise CompareError(f"{target} does not answer server reflection{how} ({_reason(exc)}); pass "
                           f"--descriptors FILE.protoset or compare bytes only") from exc
    return Descriptors(pool, services)


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def _reason(exc: BaseException) -> str:
    """One line: an RpcError's status and details, else the exception's repr."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    if isinstance(exc, Exception) and type(exc).__name__ == "FutureTimeoutError":
        return "no connection within the timeout"
    return repr(exc)


def _with_deadline(channel: Any, timeout_s: float, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    """`channel` whose stream-stream calls (reflection's only kind) each get a `timeout_s` deadline
    and carry `metadata` besides their own."""
    import grpc

    class Deadline(grpc.StreamStreamClientInterceptor):  # type: ignore[misc]  # grpc has no types
        def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
            md = tuple(details.metadata or ()) + tuple(metadata)
            return continuation(_CallDetails(details.method, timeout_s, md or None, details.credentials,
                                             details.wait_for_ready, details.compression), request_iterator)

    return grpc.intercept_channel(channel, Deadline())


def field_diff(a: Message, b: Message, prefix: str = "") -> list[str]:
    """Paths of fields that differ between two messages of one type (recursing into messages)."""
    out: list[str] = []
    for fd in a.DESCRIPTOR.fields:
        path = prefix + fd.name
        va, vb = getattr(a, fd.name), getattr(b, fd.name)
        is_msg = fd.message_type is not None and not fd.message_type.GetOptions().map_entry
        if is_msg and not fd.is_repeated:
            out += field_diff(va, vb, path + ".") if va != vb else []
        elif is_msg:
            if len(va) != len(vb):
                out.append(f"{path}[len]")
            out += [d for i, (x, y) in enumerate(zip(va, vb, strict=False)) for d in field_diff(x, y, f"{path}[{i}].")]
        elif va != vb:
            out.append(path)
    return out


_DIFFS_PER_CALL = 20     # what one call's mismatch lists at most (a body can differ everywhere)
_EXAMPLES = 20           # mismatched calls kept, with where they differ, for the verdict and --json
_VALUE_CHARS = 40        # a differing JSON value is shown up to this many characters
_HTTP = frozenset({"http1", "http2"})


def first_difference(a: bytes, b: bytes) -> int:
    """The offset of the first byte where `a` and `b` differ (the shorter length if one is a prefix)."""
    n = min(len(a), len(b))
    lo = 0
    step = 4096
    while lo < n and a[lo:lo + step] == b[lo:lo + step]:   # slices compare in C: big bodies stay cheap
        lo += step
    hi = min(lo + step, n)
    return next((i for i in range(lo, hi) if a[i] != b[i]), hi)


def _short(value: object) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= _VALUE_CHARS else text[:_VALUE_CHARS - 3] + "..."


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{json.dumps(key)}]"


def json_diff(want: object, got: object, path: str = "$") -> list[str]:
    """Where two parsed JSON documents differ: "$.a.b[2]: 1 != 2", "$.x: missing in the replay",
    "$.items[len]: 3 != 4". Types count (true is not 1)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out: list[str] = []
        for key in sorted(set(want) | set(got)):
            sub = _key_path(path, key)
            if key not in got:
                out.append(f"{sub}: missing in the replay")
            elif key not in want:
                out.append(f"{sub}: not in the recording")
            else:
                out += json_diff(want[key], got[key], sub)
        return out
    if isinstance(want, list) and isinstance(got, list):
        out = [f"{path}[len]: {len(want)} != {len(got)}"] if len(want) != len(got) else []
        for i, (w, g) in enumerate(zip(want, got, strict=False)):
            out += json_diff(w, g, f"{path}[{i}]")
        return out
    if type(want) is not type(got) or want != got:
        return [f"{path}: {_short(want)} != {_short(got)}"]
    return []


def _as_json(body: bytes) -> tuple[bool, object]:
    """(True, document) when `body` is a JSON document (UTF-8), else (False, None)."""
    stripped = body.strip()
    if not stripped or stripped[:1] not in b'{["-0123456789tfn':
        return False, None
    try:
        return True, json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return False, None


class Comparer:
    """Compare each replayed call with its recording and keep a summary by method.

    Args:
        descriptors: message types for field-by-field comparison of gRPC calls, or None for bytes only.
        ignore: glob patterns on field paths that never count ("server_latency_ns", "stages*"), also on
            the JSON paths of HTTP bodies (without their leading "$.").
    """

    def __init__(self, descriptors: Descriptors | None = None, ignore: Iterable[str] = ()) -> None:
        self.descriptors = descriptors
        self.ignore = tuple(ignore)
        self._by_method: dict[str, dict[str, Any]] = defaultdict(
            lambda: {"compared": 0, "mismatched": 0, "fields": Counter(), "not_comparable": 0, "why": Counter()})
        self._examples: list[dict[str, Any]] = []

    def _ignored(self, path: str) -> bool:
        path = path[2:] if path.startswith("$.") else path.lstrip("$")
        bare = path.replace("[", ".[").split(".")
        plain = ".".join(p for p in bare if p and not p.startswith("["))
        return any(fnmatch.fnmatch(path, g) or fnmatch.fnmatch(plain, g) for g in self.ignore)

    def compare(self, planned: PlannedCall, outcome: SendOutcome) -> list[str]:
        """Mismatches of one call (empty when it matches); counted into the summary. A call whose
        recording is damaged (`PlannedCall.not_comparable`: a gap, a body or status not captured, no
        status) is neither: it is counted as not comparable, with why."""
        why = planned.not_comparable
        if why:
            entry = self._by_method[planned.method or "?"]
            entry["not_comparable"] += 1
            entry["why"][why] += 1
            return []
        diffs: list[str] = []
        if planned.expected_status is not None and outcome.status is not None \
                and planned.expected_status != outcome.status:
            diffs.append(f"status: {planned.expected_status} != {outcome.status}")
        elif planned.expected_responses and outcome.outcome == "ok":
            diffs += self._responses(planned, outcome.responses)
        diffs = diffs[:_DIFFS_PER_CALL]
        entry = self._by_method[planned.method or "?"]
        entry["compared"] += 1
        entry["mismatched"] += bool(diffs)
        entry["fields"].update(d.split(":")[0] for d in diffs)
        if diffs and len(self._examples) < _EXAMPLES:
            self._examples.append({"index": planned.index, "call_id": planned.call_id, "flow": planned.flow_id,
                                   "connection": planned.connection, "method": planned.method,
                                   "protocol": planned.protocol, "diffs": diffs[:5]})
        return diffs

    def _responses(self, planned: PlannedCall, got: list[bytes]) -> list[str]:
        want = planned.expected_responses
        diffs = [f"responses: {len(want)} != {len(got)}"] if len(want) != len(got) else []
        if planned.protocol in _HTTP:
            for w, g in zip(want, got, strict=False):
                diffs += self._body(w, g) if w != g else []
            return diffs
        cls = self.descriptors.output_class(planned.method) if self.descriptors else None
        for i, (w, g) in enumerate(zip(want, got, strict=False)):
            if w == g:
                continue
            if cls is None:
                diffs.append(f"bytes: response {i} differs at byte {first_difference(w, g)} "
                             f"(recorded {len(w)} bytes, replayed {len(g)})")
                continue
            try:
                paths = field_diff(cls.FromString(w), cls.FromString(g))
            except DecodeError:
                diffs.append(f"bytes: response {i} is not a valid {cls.DESCRIPTOR.full_name}")
                continue
            diffs += [p for p in paths if not self._ignored(p) and p not in diffs]
        return diffs

    def _body(self, want: bytes, got: bytes) -> list[str]:
        """An HTTP body: by JSON path when both sides are JSON (--ignore-field applies), else byte-wise."""
        w_json, w_doc = _as_json(want)
        g_json, g_doc = _as_json(got)
        if w_json and g_json:
            return [d for d in json_diff(w_doc, g_doc) if not self._ignored(d.split(":")[0])]
        return [f"body: differs at byte {first_difference(want, got)} (recorded {len(want)} bytes, "
                f"replayed {len(got)})"]

    def summary(self) -> dict[str, Any]:
        """{'total': mismatched calls, 'not_comparable': n, 'by_method': {method: {compared, mismatched,
        fields: {path: n}, not_comparable, why: {reason: n}}}}. Not comparable calls are not compared."""
        return _summary(self._by_method, self._examples)

    @staticmethod
    def merge_summaries(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
        """Merge summaries from worker processes."""
        by: dict[str, dict[str, Any]] = {}
        examples: list[dict[str, Any]] = []
        for part in parts:
            examples += part.get("calls", [])
            for m, e in part.get("by_method", {}).items():
                cur = by.setdefault(m, {"compared": 0, "mismatched": 0, "fields": Counter(), "not_comparable": 0,
                                        "why": Counter()})
                cur["compared"] += e["compared"]
                cur["mismatched"] += e["mismatched"]
                cur["fields"].update(e["fields"])
                cur["not_comparable"] += e.get("not_comparable", 0)
                cur["why"].update(e.get("why", {}))
        return _summary(by, sorted(examples, key=lambda c: c["index"])[:_EXAMPLES])


def _summary(by_method: dict[str, dict[str, Any]], examples: list[dict[str, Any]]) -> dict[str, Any]:
    by = {m: {**e, "fields": dict(e["fields"].most_common()), "why": dict(e["why"].most_common())}
          for m, e in sorted(by_method.items())}
    return {"total": sum(e["mismatched"] for e in by.values()),
            "compared": sum(e["compared"] for e in by.values()),
            "not_comparable": sum(e["not_comparable"] for e in by.values()), "by_method": by,
            "calls": list(examples)}


class CompareSpec:
    """A picklable recipe for a Comparer (worker processes each build their own).

    source: "reflection" (ask the target), "bytes" (no descriptors), a protoset path ending in
    .protoset/.pb, or comma-separated module names ("agent_under_test.proto.agent_pb2").
    """

    def __init__(self, source: str = "reflection", ignore: Iterable[str] = (), tls: TlsConfig | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.source, self.ignore = source, tuple(ignore)
        self.tls, self.metadata = tls, tuple(metadata)   # for reflection: the replay's TLS and credentials

    def build(self, target: str, protocols: Collection[str] | None = None) -> Comparer:
        """The Comparer for a recording whose calls use `protocols` (None: unknown, as for a plan given
        as calls). Reflection is asked only when they include gRPC: descriptors serve gRPC calls alone,
        and asking means an HTTP/2 preface to the target. Raises CompareError when they cannot be had."""
        if self.source == "bytes" or (self.source == "reflection" and protocols is not None
                                      and "grpc" not in protocols):
            desc = None
        elif self.source == "reflection":
            desc = descriptors_from_reflection(target, tls=self.tls, metadata=self.metadata)
        elif self.source.endswith((".protoset", ".pb", ".desc")):
            desc = descriptors_from_file(self.source)
        else:
            desc = descriptors_from_modules(*self.source.split(","))
        return Comparer(desc, self.ignore)
