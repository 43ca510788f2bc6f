"""The API's objects as Toxiproxy marshals them: toxic specs and their JSON shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from faults.proxy.toxics import TOXICS, Toxic, parse_attributes


class ApiError(Exception):
    """An API error with Toxiproxy's message and HTTP status (body: {"error": ..., "status": ...})."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message, self.status = message, status

    def joined(self, detail: str) -> ApiError:
        return ApiError(f"{self.message}: {detail}", self.status)


ERR_BAD_REQUEST_BODY = ApiError("bad request body", 400)
ERR_MISSING_FIELD = ApiError("missing required field", 400)
ERR_PROXY_NOT_FOUND = ApiError("proxy not found", 404)
ERR_PROXY_ALREADY_EXISTS = ApiError("proxy already exists", 409)
ERR_INVALID_STREAM = ApiError("stream was invalid, can be either upstream or downstream", 400)
ERR_INVALID_TOXIC_TYPE = ApiError("invalid toxic type", 400)
ERR_TOXIC_ALREADY_EXISTS = ApiError("toxic already exists", 409)
ERR_TOXIC_NOT_FOUND = ApiError("toxic not found", 404)

STREAMS = ("upstream", "downstream")


@dataclass
class ToxicSpec:
    """A toxic as configured on a proxy; `toxic` is the live implementation for its attributes."""

    name: str
    type: str
    stream: str
    toxicity: float
    attributes: dict[str, Any]
    toxic: Toxic = field(repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"attributes": dict(self.attributes), "name": self.name, "type": self.type,
                "stream": self.stream, "toxicity": self.toxicity}


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ERR_BAD_REQUEST_BODY.joined(
            f"json: cannot unmarshal {type(value).__name__} into Go struct field {what} of type float32")
    return float(value)


def spec_from_json(body: Any) -> ToxicSpec:
    """Validate a toxic-create body in Toxiproxy's order: body, stream, type, attributes."""
    if not isinstance(body, dict):
        raise ERR_BAD_REQUEST_BODY.joined("json: cannot unmarshal into Go value of type toxics.ToxicWrapper")
    stream = body.get("stream") or "downstream"
    if not isinstance(stream, str) or stream.lower() not in STREAMS:
        raise ERR_INVALID_STREAM
    ttype = body.get("type") or ""
    toxicity = _number(body.get("toxicity", 1.0), "ToxicWrapper.toxicity")
    name = body.get("name") or f"{ttype}_{stream}"
    if not isinstance(ttype, str) or ttype not in TOXICS:
        raise ERR_INVALID_TOXIC_TYPE
    try:
        attrs = parse_attributes(ttype, body.get("attributes"))
    except ValueError as exc:
        raise ERR_BAD_REQUEST_BODY.joined(str(exc)) from exc
    return ToxicSpec(str(name), ttype, stream.lower(), toxicity, attrs, TOXICS.get(ttype)(attrs))


def spec_updated(old: ToxicSpec, body: Any) -> ToxicSpec:
    """PATCH semantics: attributes and toxicity change, everything else stays."""
    if not isinstance(body, dict):
        raise ERR_BAD_REQUEST_BODY.joined("json: cannot unmarshal into Go value")
    toxicity = _number(body.get("toxicity", old.toxicity), "toxicity")
    try:
        attrs = parse_attributes(old.type, body.get("attributes"), base=old.attributes)
    except ValueError as exc:
        raise ERR_BAD_REQUEST_BODY.joined(str(exc)) from exc
    return ToxicSpec(old.name, old.type, old.stream, toxicity, attrs, TOXICS.get(old.type)(attrs))
