"""Connection sampling (`record --sample PCT [--sample-seed N]`): keep a deterministic share of connections.

A connection is kept or not as a whole, when it opens, by a hash of its 4-tuple and the seed:

    keep  <=>  blake2b(seed | client ip | client port | server ip | server port) mod 1,000,000 < PCT x 10,000

so the same seed keeps the same connections on every host that sees them (a client-side and a
server-side recorder agree; two runs over the same connections agree), and a kept connection has all
its bytes: no call is ever half-sampled. Where a backend does not know a connection's client end when
it opens (an accept with no address whose peer /proc no longer shows), the process, fd and open time
stand in for it: still a fair coin, but one that another host cannot repeat (counted: `by_process`).

The recording's meta `sampling` says what was kept: {pct, seed, kept_flows, dropped_flows, by_process};
`replay --scale-to-full` multiplies the flow rate by 100 / pct, so a 10 % recording drives full load with
new connections shaped like the recorded ones.
"""

from __future__ import annotations

import hashlib

from capture.errors import CaptureError
from capture.recording import Flow

_BUCKETS = 1_000_000


class Sampler:
    def __init__(self, pct: float, seed: int = 0) -> None:
        if not 0.0 < pct <= 100.0:
            raise CaptureError(f"--sample must be a percentage in (0, 100], not {pct:g}")
        self.pct = pct
        self.seed = seed
        self._limit = round(pct * _BUCKETS / 100.0)
        self.kept = 0
        self.dropped = 0
        self.by_process = 0

    def keeps(self, client: tuple[str, int], server: tuple[str, int]) -> bool:
        """Whether the connection client -> server is kept (a pure function of the 4-tuple and the seed)."""
        text = f"{self.seed}|{client[0]}|{client[1]}|{server[0]}|{server[1]}".encode()
        h = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")
        return h % _BUCKETS < self._limit

    def decide(self, flow: Flow) -> bool:
        """Keep `flow`? Counted either way."""
        client, server = flow.src, flow.dst
        if not client[1] or not server[1]:      # an end unknown: the process, fd and open time stand in
            self.by_process += 1
            client = (f"pid:{flow.pid}", int(flow.opened_ns or 0))
        keep = self.keeps(client, server)
        if keep:
            self.kept += 1
        else:
            self.dropped += 1
        return keep

    def meta(self) -> dict[str, object]:
        return {"pct": self.pct, "seed": self.seed, "kept_flows": self.kept, "dropped_flows": self.dropped,
                "by_process": self.by_process, "by": "4-tuple"}
