"""Name the methods of calls whose `:path` was lost (connections joined mid-stream), from service descriptors.

    unknown groups (flow, ref) with sample calls --+
                                                   +--> shape fits?  every message parses STRICTLY?
    every method of the descriptors' services -----+        exactly one method -> assigned, with how
                                                            else unknown, with the candidates or the reason

A group is every call of one connection whose `:path` referred to the same HPACK entry inserted
before the recorder joined (capture/recording.py): they share one method, found once.

Shape: a call with more than one request needs a client-streaming method, more than one response a
server-streaming one. A method whose streaming matches the group's shape exactly is preferred over one
that merely admits it (a bidi call that carried one message each way looks unary on the wire).

Parsing is strict, by walking the protobuf wire format here: every field number must exist in the
type with a compatible wire type (packed repeated scalars are length-delimited), nested messages are
checked recursively, groups are rejected. `ParseFromString` would keep unknown fields and accept
anything that is well-formed. An empty message parses as every type, so it counts for nothing;
compressed messages cannot be checked and are skipped (and said so).

Descriptor sources (`load_source`): `reflection=HOST:PORT` (gRPC server reflection, read-only, only
to loopback or allowed targets), a protoset file (`protoc --include_imports --descriptor_set_out`),
or generated module names (`agent_under_test.proto.agent_pb2`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor, ServiceDescriptor

from capture.recording import MethodGroup

if TYPE_CHECKING:
    from replay.compare import Descriptors

MAX_DEPTH = 32          # nesting deeper than this is not a message we would believe
_SHOWN = 4              # candidates named in a how-line before "+N more"


class WireType(IntEnum):
    VARINT = 0
    I64 = 1
    LEN = 2
    SGROUP = 3
    EGROUP = 4
    I32 = 5


_F = FieldDescriptor
_WIRE_OF_TYPE: dict[int, WireType] = {
    _F.TYPE_INT32: WireType.VARINT, _F.TYPE_INT64: WireType.VARINT, _F.TYPE_UINT32: WireType.VARINT,
    _F.TYPE_UINT64: WireType.VARINT, _F.TYPE_SINT32: WireType.VARINT, _F.TYPE_SINT64: WireType.VARINT,
    _F.TYPE_BOOL: WireType.VARINT, _F.TYPE_ENUM: WireType.VARINT,
    _F.TYPE_FIXED64: WireType.I64, _F.TYPE_SFIXED64: WireType.I64, _F.TYPE_DOUBLE: WireType.I64,
    _F.TYPE_FIXED32: WireType.I32, _F.TYPE_SFIXED32: WireType.I32, _F.TYPE_FLOAT: WireType.I32,
    _F.TYPE_STRING: WireType.LEN, _F.TYPE_BYTES: WireType.LEN, _F.TYPE_MESSAGE: WireType.LEN,
}   # TYPE_GROUP is absent on purpose: groups are rejected
_FIXED_SIZE = {WireType.I64: 8, WireType.I32: 4}


# -- strict wire-format check ------------------------------------------------------------------------

class _Invalid(Exception):
    pass


def check_message(data: bytes, desc: Descriptor) -> str | None:
    """None when `data` is a valid `desc` message with no unknown field; else what is wrong."""
    try:
        _walk(memoryview(data), desc, 0)
    except _Invalid as exc:
        return str(exc)
    return None


def _varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    for i in range(pos, min(pos + 10, len(buf))):
        value |= (buf[i] & 0x7F) << shift
        if not buf[i] & 0x80:
            return value, i + 1
        shift += 7
    raise _Invalid(f"bad varint at byte {pos}")


def _walk(buf: memoryview, desc: Descriptor, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _Invalid(f"nested deeper than {MAX_DEPTH}")
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        field = desc.fields_by_number.get(number)
        if field is None:
            raise _Invalid(f"field {number} is not in {desc.full_name}")
        pos = _field(buf, pos, field, wire, depth)


def _field(buf: memoryview, pos: int, field: FieldDescriptor, wire: int, depth: int) -> int:
    declared = _WIRE_OF_TYPE.get(field.type)
    if declared is None:
        raise _Invalid(f"{field.full_name} is a group (not supported)")
    if wire == declared == WireType.VARINT:
        return _varint(buf, pos)[1]
    if wire == declared and declared in _FIXED_SIZE:
        return _take(buf, pos, _FIXED_SIZE[declared])[1]
    if wire == WireType.LEN and (declared == WireType.LEN or field.is_repeated):
        body, end = _take(buf, pos, None)
        if declared != WireType.LEN:
            _packed(body, declared, field)
        elif field.type == _F.TYPE_MESSAGE:
            _walk(body, field.message_type, depth + 1)
        elif field.type == _F.TYPE_STRING and _checks_utf8(field.file):
            _utf8(body, field)
        return end
    raise _Invalid(f"{field.full_name} sent as wire type {wire}, declared {declared.name}")


def _take(buf: memoryview, pos: int, size: int | None) -> tuple[memoryview, int]:
    """The next `size` bytes (a length-delimited body when None) and the position after them."""
    if size is None:
        size, pos = _varint(buf, pos)
    if pos + size > len(buf):
        raise _Invalid(f"truncated: {size} bytes wanted at byte {pos} of {len(buf)}")
    return buf[pos:pos + size], pos + size


def _packed(body: memoryview, wire: WireType, field: FieldDescriptor) -> None:
    if wire in _FIXED_SIZE:
        if len(body) % _FIXED_SIZE[wire]:
            raise _Invalid(f"packed {field.full_name}: {len(body)} bytes is not a whole number of values")
        return
    pos = 0
    while pos < len(body):
        pos = _varint(body, pos)[1]


def _utf8(body: memoryview, field: FieldDescriptor) -> None:
    try:
        bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        raise _Invalid(f"{field.full_name} is not valid UTF-8") from None


_PROTO3: dict[tuple[int, str], bool] = {}


def _checks_utf8(file: FileDescriptor) -> bool:
    """proto3 strings must be UTF-8 (the runtimes refuse others); proto2 strings need not be."""
    key = (id(file.pool), file.name)   # pools live as long as their sources: one parse per file
    if key not in _PROTO3:
        _PROTO3[key] = descriptor_pb2.FileDescriptorProto.FromString(file.serialized_pb).syntax == "proto3"
    return _PROTO3[key]


# -- methods -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MethodType:
    """One method a call could be: its gRPC path, types and streaming."""

    path: str
    input: Descriptor
    output: Descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def shape(self) -> str:
        return _shape_name(self.client_streaming, self.server_streaming)


def _shape_name(client: bool, server: bool) -> str:
    return {(False, False): "unary", (True, False): "client_stream",
            (False, True): "server_stream", (True, True): "bidi"}[(client, server)]


def methods_of_services(services: Iterable[ServiceDescriptor]) -> list[MethodType]:
    return [MethodType(f"/{s.full_name}/{m.name}", m.input_type, m.output_type, m.client_streaming,
                       m.server_streaming) for s in services for m in s.methods]


def methods_of(descriptors: Descriptors) -> list[MethodType]:
    """Every method of every service the descriptors' source offers."""
    return methods_of_services(descriptors.pool.FindServiceByName(s) for s in descriptors.services)


@dataclass(frozen=True)
class Source:
    """Descriptors with a label for how-lines ("reflection 127.0.0.1:50051", "protoset api.protoset")."""

    label: str
    methods: tuple[MethodType, ...]


def load_source(spec: str, allow: Iterable[str] = (), timeout_s: float = 2.0, tls: Any = None,
                metadata: tuple[tuple[str, str], ...] = ()) -> Source:
    """`reflection=HOST:PORT`, a protoset file, or comma-separated generated module names.

    tls, metadata: for reflection, the TLS config and the metadata to send (see descriptors_from_reflection).

    Raises replay's TargetNotAllowedError for a reflection target that is neither loopback nor
    allowed, CompareError when the descriptors cannot be had (no reflection, unreadable file)."""
    from replay.compare import descriptors_from_file, descriptors_from_modules, descriptors_from_reflection
    from replay.errors import TargetNotAllowedError
    from replay.target import check_target

    if spec.startswith("reflection="):
        target = spec.removeprefix("reflection=")
        try:
            check_target(target, allow)
        except TargetNotAllowedError as exc:
            raise TargetNotAllowedError(f"cannot ask {target} for reflection: {exc}") from exc
        desc = descriptors_from_reflection(target, timeout_s, tls=tls, metadata=metadata)
        return Source(f"reflection {target}", tuple(methods_of(desc)))
    if spec.endswith((".protoset", ".pb", ".desc")) or Path(spec).is_file():
        return Source(f"protoset {Path(spec).name}", tuple(methods_of(descriptors_from_file(spec))))
    return Source(f"modules {spec}", tuple(methods_of(descriptors_from_modules(*spec.split(",")))))


# -- groups and their calls (capture.recording's MethodGroup and Call fit these) ----------------------

class MessageLike(Protocol):
    @property
    def data(self) -> bytes: ...
    @property
    def compressed(self) -> bool: ...


class CallLike(Protocol):
    @property
    def requests(self) -> Sequence[MessageLike]: ...
    @property
    def responses(self) -> Sequence[MessageLike]: ...


class GroupLike(Protocol):
    @property
    def flow_id(self) -> int: ...
    @property
    def ref(self) -> str: ...
    @property
    def protocol(self) -> str: ...
    @property
    def kinds(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Inference:
    """What inference decided for one group: `method` (None: still unknown) and `how`, one line."""

    flow_id: int
    ref: str
    method: str | None
    how: str
    candidates: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Sample:
    """A group's messages to check, with its shape (from every call's kind and the sample's counts)."""

    requests: tuple[bytes, ...]
    responses: tuple[bytes, ...]
    compressed: int
    empty: int
    client: bool
    server: bool

    @property
    def shape(self) -> str:
        return _shape_name(self.client, self.server)


def _sample(group: GroupLike, calls: Sequence[CallLike]) -> _Sample:
    kinds = {k for k, n in group.kinds.items() if n}
    client = bool(kinds & {"client_stream", "bidi"}) or any(len(c.requests) > 1 for c in calls)
    server = bool(kinds & {"server_stream", "bidi"}) or any(len(c.responses) > 1 for c in calls)
    msgs = [(m, i == 0) for c in calls for i, ms in enumerate((c.requests, c.responses)) for m in ms]
    checkable = [(bytes(m.data), is_req) for m, is_req in msgs if not m.compressed and m.data]
    return _Sample(tuple(d for d, r in checkable if r), tuple(d for d, r in checkable if not r),
                   compressed=sum(m.compressed for m, _ in msgs),
                   empty=sum(not m.compressed and not m.data for m, _ in msgs), client=client, server=server)


def _carries(method: MethodType, sample: _Sample) -> bool:
    """A unary side carries at most one message a call; a call still open or reset may carry fewer."""
    return (method.client_streaming or not sample.client) and (method.server_streaming or not sample.server)


def _parse_problem(method: MethodType, sample: _Sample, cache: dict[tuple[str, bool, int], str | None]) -> str | None:
    """The first message that does not parse as `method`'s types (None: every checked message does)."""
    for is_req, desc, datas in ((True, method.input, sample.requests), (False, method.output, sample.responses)):
        for i, data in enumerate(datas):
            key = (desc.full_name, is_req, i)   # methods share types: check each message once per type
            if key not in cache:
                cache[key] = check_message(data, desc)
            if cache[key] is not None:
                return f"{'request' if is_req else 'response'} {cache[key]}"
    return None


def _names(paths: Sequence[str]) -> str:
    more = f" +{len(paths) - _SHOWN} more" if len(paths) > _SHOWN else ""
    return ", ".join(paths[:_SHOWN]) + more


def infer_group(group: GroupLike, calls: Sequence[CallLike], source: Source) -> Inference:
    """Decide one group's method from its sample calls and the source's methods (see module docstring)."""
    if group.protocol != "grpc":
        return Inference(group.flow_id, group.ref, None, f"{group.protocol} calls: descriptors do not apply; "
                         f"name them with --method-map {group.flow_id}:{group.ref}=PATH")
    sample = _sample(group, calls)
    cache: dict[tuple[str, bool, int], str | None] = {}
    shaped = [m for m in source.methods if _carries(m, sample)]
    problems = {m.path: _parse_problem(m, sample, cache) for m in shaped}
    fits = [m for m in shaped if problems[m.path] is None]
    if not sample.requests and not sample.responses:
        return _unchecked(group, source, sample, fits)
    return _verdict(group, source, sample, fits, problems)


def _verdict(group: GroupLike, source: Source, sample: _Sample, fits: list[MethodType],
             problems: dict[str, str | None]) -> Inference:
    """One method fits (exactly, or alone): assigned; several: the candidates; none: why not."""
    checked = len(sample.requests) + len(sample.responses)
    skipped = f", {sample.compressed} compressed not checked" if sample.compressed else ""
    parsed = f"{checked} messages parsed{skipped}"
    exact = [m for m in fits if m.shape == sample.shape]
    chosen = exact or fits
    if len(chosen) == 1:
        also = [m.path for m in fits if m not in exact] if exact else []
        note = (f" exactly (streaming {_names(also)} admits it too)" if also
                else "" if exact else f" (as {chosen[0].shape})")
        return Inference(group.flow_id, group.ref, chosen[0].path, f"{source.label}: {sample.shape} shape, "
                         f"{parsed}, 1 of {len(source.methods)} methods fits{note}")
    if chosen:
        paths = tuple(m.path for m in chosen)
        return Inference(group.flow_id, group.ref, None, f"{source.label}: {len(paths)} methods fit: {_names(paths)} "
                         f"({sample.shape} shape, {parsed})", paths)
    why = "; ".join(f"{p}: {r}" for p, r in list(problems.items())[:_SHOWN])
    return Inference(group.flow_id, group.ref, None, f"{source.label}: no method of {len(source.methods)} fits "
                     f"({sample.shape} shape, {checked} messages checked{skipped})" + (f": {why}" if why else ""))


def _unchecked(group: GroupLike, source: Source, sample: _Sample, fits: list[MethodType]) -> Inference:
    """No message could be checked: the shape alone is not evidence enough to name a method."""
    if sample.compressed:
        reason = f"{sample.compressed} compressed messages cannot be checked" + (
            f", {sample.empty} empty" if sample.empty else "")
    else:
        reason = f"no message to check ({sample.empty} empty)" if sample.empty else "no message to check"
    paths = tuple(m.path for m in fits)
    shape = f"{len(paths)} methods admit the {sample.shape} shape" + (f": {_names(paths)}" if paths else "")
    return Inference(group.flow_id, group.ref, None, f"{source.label}: {reason}; {shape}", paths)


def infer_groups(groups: Iterable[GroupLike], calls_of: Callable[[GroupLike], Sequence[CallLike]],
                 sources: Sequence[Source]) -> list[Inference]:
    """Each group against each source in turn, until one names its method; the reasons of every
    source that did not are kept (joined by " | ")."""
    out: list[Inference] = []
    for group in groups:
        calls = calls_of(group)
        tried: list[Inference] = []
        for source in sources:
            tried.append(infer_group(group, calls, source))
            if tried[-1].method is not None or group.protocol != "grpc":
                break
        if not tried:
            continue
        last = tried[-1]
        how = last.how if last.method else " | ".join(t.how for t in tried)
        out.append(Inference(group.flow_id, group.ref, last.method, how, last.candidates))
    return out


# -- a recording's groups: the manual map first, then inference for what is still unknown -------------

class RecordedGroup(GroupLike, Protocol):
    @property
    def calls(self) -> int: ...
    @property
    def method(self) -> str | None: ...
    @property
    def how(self) -> str | None: ...


MANUAL = "--method-map"


@dataclass(frozen=True)
class GroupState(MethodGroup):
    """A group as it stands after the map and inference; `changed` when this run decided it."""

    candidates: tuple[str, ...] = ()
    changed: bool = False

    def as_json(self) -> dict[str, object]:
        return {"flow": self.flow_id, "ref": self.ref, "protocol": self.protocol, "calls": self.calls,
                "kinds": self.kinds, "method": self.method, "how": self.how, "candidates": list(self.candidates),
                "changed": self.changed}


def describe(state: GroupState) -> str:
    """One line for a group: "flow 3 hpack:5 (40 calls): /pkg.S/M: how"."""
    how = state.how or "no descriptors to infer from"
    return f"flow {state.flow_id} {state.ref} ({state.calls} calls): {state.method or 'unknown'}: {how}"


def manual_method(group: GroupLike, manual: dict[tuple[int | None, str], str]) -> str | None:
    """The method `--method-map` gives this group: `FLOW:REF` first, then a bare `REF` (any flow)."""
    return manual.get((group.flow_id, group.ref), manual.get((None, group.ref)))


def unmatched_map_keys(groups: Iterable[GroupLike], manual: dict[tuple[int | None, str], str]) -> list[str]:
    """`--method-map` keys that name no group of the recording (a typo would otherwise do nothing)."""
    have = {(g.flow_id, g.ref) for g in groups} | {(None, g.ref) for g in groups}
    return [f"{flow}:{ref}" if flow is not None else ref for flow, ref in manual if (flow, ref) not in have]


def resolve_groups(groups: Iterable[RecordedGroup], calls_of: Callable[[GroupLike], Sequence[CallLike]],
                   sources_for: Callable[[GroupLike], Sequence[Source]],
                   manual: dict[tuple[int | None, str], str] | None = None) -> list[GroupState]:
    """Every group with its method: mapped by hand (which wins, even over an earlier assignment), kept
    when already known, else inferred from the sources `sources_for(group)` gives (none: left as is)."""
    out: list[GroupState] = []
    for g in groups:
        base = GroupState(g.flow_id, g.ref, g.protocol, g.calls, dict(g.kinds), g.method, g.how)
        mapped = manual_method(g, manual or {})
        if mapped is not None:
            out.append(replace(base, method=mapped, how=MANUAL, changed=(mapped, MANUAL) != (g.method, g.how)))
            continue
        sources = sources_for(g) if g.method is None else ()
        if not sources:
            out.append(base)
            continue
        found = infer_groups([g], calls_of, sources)[0]
        out.append(replace(base, method=found.method, how=found.how, candidates=found.candidates,
                           changed=(found.method, found.how) != (g.method, g.how)))
    return out
