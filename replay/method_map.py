"""`--method-map [FLOW:]REF=METHOD`: name a group of calls whose method the recording could not see.

A recorder that joined a connection mid-stream stores calls whose :path sat in the HPACK table before
the join with `method = NULL` and a `method_ref` such as "hpack:5,4,3"; the calls of one flow with
the same ref had the same method (capture/recording.py, "Method groups"). `inspect` lists the groups.

    3:hpack:5,4,3=/pkg.Service/Method     that group of flow 3
    hpack:5,4,3=/pkg.Service/Method       that ref on every flow

`shadowtest replay --method-map` applies them for one replay (the file is unchanged);
`shadowtest infer --method-map` writes them into the file's method map.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from replay.errors import PlanError

# A ref as the decoder writes it: "hpack:" (or "hpack@N:" after N gaps) and pre-join ordinals.
REF_PATTERN = re.compile(r"hpack(@\d+)?:\d+(,\d+)*")
_FLOW = re.compile(r"(\d+):(.+)")
_EXAMPLE = "use [FLOW:]REF=METHOD, e.g. 3:hpack:5,4,3=/pkg.Service/Method (`shadowtest inspect FILE` lists them)"


class MethodMapError(PlanError, ValueError):
    """A --method-map value that does not parse (a usage error: nothing is sent or written). A
    ValueError too, for callers that treat it as a bad value."""


def parse_method_map(values: Iterable[str]) -> dict[tuple[int | None, str], str]:
    """{(flow_id or None for every flow, ref): method} from `[FLOW:]REF=METHOD` strings.

    Raises MethodMapError (a PlanError and a ValueError) naming the bad value: no '=', a ref that is not one the
    decoder writes, a method that is not a path (it starts with '/'), or one group given two methods."""
    out: dict[tuple[int | None, str], str] = {}
    for value in values:
        left, eq, method = value.strip().partition("=")
        if not eq:
            raise MethodMapError(f"--method-map {value!r}: no '='; {_EXAMPLE}")
        m = _FLOW.fullmatch(left)
        flow, ref = (int(m.group(1)), m.group(2)) if m else (None, left)
        if not REF_PATTERN.fullmatch(ref):
            raise MethodMapError(f"--method-map {value!r}: {ref!r} is not a group ref like hpack:5,4,3; {_EXAMPLE}")
        if not method.startswith("/") or any(c.isspace() for c in method):
            raise MethodMapError(f"--method-map {value!r}: the method must be a path such as "
                                 f"/pkg.Service/Method, not {method!r}")
        if out.get((flow, ref), method) != method:
            raise MethodMapError(f"--method-map: {left} is given two methods, {out[(flow, ref)]} and {method}")
        out[(flow, ref)] = method
    return out
