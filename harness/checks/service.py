"""Service checks: slo, error_rate, no_loss (accounting), fault_effective (the fault really bit)."""

from __future__ import annotations

from harness.checks.base import Param, Verdict, phase_window, register, verdict
from harness.scenario import CheckSpec
from harness.timeline import Timeline, percentile


class Slo:
    name = "slo"
    params = {"phase": Param("phase"), "p99_ms": Param("number", help="default: the target's threshold"),
              "settle_s": Param("duration", help="ignored at the start of the phase (default 0s)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        start += spec.params.get("settle_s", 0.0)
        limit = spec.params.get("p99_ms", tl.threshold_ms)
        lat = sorted(c.latency_ms for c in tl.calls_between(start, end)
                     if c.outcome == "ok" and c.latency_ms is not None)
        if len(lat) < tl.min_samples:
            return verdict(spec, False, f"only {len(lat)} admitted calls in {start:.1f}-{end:.1f}s: too few "
                           "to judge a P99", admitted=len(lat))
        p99 = percentile(lat, 0.99)
        evidence = {"p99_ms": round(p99, 3), "limit_ms": limit, "admitted": len(lat),
                    "window_s": [round(start, 3), round(end, 3)]}
        ok = p99 <= limit
        return verdict(spec, ok, f"admitted P99 {p99:.1f} ms {'<=' if ok else '>'} {limit:g} ms over "
                       f"{len(lat)} calls ({start:.1f}-{end:.1f}s)", **evidence)


class ErrorRate:
    name = "error_rate"
    params = {"phase": Param("phase"), "max_pct": Param("number", help="default 1"),
              "include_rejected": Param("bool", help="count limiter rejections as errors (default false)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        start, end = phase_window(tl, spec)
        calls = tl.calls_between(start, end)
        bad_kinds = {"error", "timeout"} | ({"rejected"} if spec.params.get("include_rejected") else set())
        bad = sum(1 for c in calls if c.outcome in bad_kinds)
        total = sum(1 for c in calls if c.outcome != "not_sent")
        limit = spec.params.get("max_pct", 1.0)
        pct = bad / total * 100 if total else 0.0
        codes: dict[str, int] = {}
        for c in calls:
            if c.outcome in bad_kinds:
                codes[c.code or c.outcome] = codes.get(c.code or c.outcome, 0) + 1
        ok = total > 0 and pct <= limit
        summary = (f"{bad} of {total} calls failed ({pct:.2f}%, limit {limit:g}%)" if total
                   else "no calls completed in the window")
        return verdict(spec, ok, summary, errors=bad, total=total, pct=round(pct, 3), by_code=codes)


class NoLoss:
    name = "no_loss"
    params = {"tolerance_pct": Param("number", help="allowed client/agent disagreement (default 1)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        rep = tl.replay_report
        client = {o: sum(1 for c in tl.calls if c.outcome == o)
                  for o in ("ok", "rejected", "error", "timeout", "not_sent")}
        scheduled = int(rep.get("scheduled", len(tl.calls)))
        accounted = sum(client.values())
        evidence: dict[str, object] = {"scheduled": scheduled, "client": client}
        if accounted != scheduled:
            return verdict(spec, False, f"replay accounting broken: scheduled {scheduled} but "
                           f"{accounted} accounted for (ok+rejected+errors+timeouts+not_sent)", **evidence)
        server = _server_counts(tl)
        if server is None:
            return verdict(spec, True, f"all {scheduled} calls accounted for; the target exposes no "
                           "request counters to compare", **evidence)
        # Every call the client sent reached the agent and was counted once: ok, rejected, invalid or
        # error there. (A client timeout is still a call the agent answered, or will, so totals compare.)
        sent = scheduled - client["not_sent"]
        seen = sum(server.values())
        tol = max(1.0, spec.params.get("tolerance_pct", 1.0) / 100 * max(1, sent))
        evidence |= {"agent": server, "client_sent": sent, "agent_seen": seen,
                     "rejected_difference": client["rejected"] - server.get("rejected", 0)}
        streams = sum(1 for c in tl.calls if c.method.endswith("Stream") and c.outcome != "not_sent")
        if streams:
            # The agent counts each stream message, the client each call: only "nothing missing" holds.
            evidence["stream_calls"] = streams
            if seen + tol < sent:
                return verdict(spec, False, f"the agent counted {seen:.0f} requests for {sent} calls sent "
                               f"({streams} streams): calls were lost on the way", **evidence)
            return verdict(spec, True, f"all {scheduled} calls accounted for; the agent counted {seen:.0f} "
                           f"requests (stream messages each) for {sent} calls sent", **evidence)
        if abs(sent - seen) > tol or abs(client["rejected"] - server.get("rejected", 0)) > tol:
            return verdict(spec, False, f"client and agent disagree: client sent {sent} (rejected "
                           f"{client['rejected']}), agent counted {seen:.0f} (rejected "
                           f"{server.get('rejected', 0):.0f})", **evidence)
        return verdict(spec, True, f"all {scheduled} calls accounted for; the agent counted {seen:.0f} of "
                       f"{sent} sent (rejected {server.get('rejected', 0):.0f} = {client['rejected']})", **evidence)


def _server_counts(tl: Timeline) -> dict[str, float] | None:
    """The agent's requests_total by outcome over the run (last scrape minus first), or None."""
    name = tl.metric_names.get("requests_total", "agent_requests_total")
    if len(tl.samples) < 2:
        return None
    first, last = tl.samples[0].values, tl.samples[-1].values
    out: dict[str, float] = {}
    for key, value in last.items():
        if key.startswith(name + "{") and 'outcome="' in key:
            outcome = key.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = value - first.get(key, 0.0)
    return out or None


_SIGNALS = "choice:client_latency,server_latency,host_cpu,target_cpu"


class FaultEffective:
    name = "fault_effective"
    params = {"phase": Param("phase", required=True), "baseline": Param("phase"),
              "signal": Param(_SIGNALS, help="default: client_latency for network faults, else server_latency"),
              "quantile": Param("choice:p50,p95,p99", help="for latency signals (default p99)"),
              "min_increase_pct": Param("number", help="default 30"), "min_increase_ms": Param("number")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        phase = spec.params["phase"]
        windows = [f for f in tl.faults if f.phase == phase]
        broken = [f for f in windows if f.error or f.applied_s is None]
        if not windows:
            return verdict(spec, False, f"no fault was scheduled in phase {phase!r}")
        if broken:
            return verdict(spec, False, f"fault {broken[0].label} never took effect: {broken[0].error}",
                           faults=[f.label for f in windows])
        signal = spec.params.get("signal") or ("client_latency" if windows[0].family == "network"
                                               else "server_latency")
        base = spec.params.get("baseline", tl.phases[0][0])
        before = _signal(tl, signal, base, spec.params.get("quantile", "p99"))
        after = _signal(tl, signal, phase, spec.params.get("quantile", "p99"))
        evidence = {"signal": signal, "baseline_phase": base, "before": before, "during": after,
                    "faults": [f.label for f in windows]}
        if before is None or after is None:
            return verdict(spec, False, f"no {signal} data to compare ({base}: {before}, {phase}: {after})",
                           **evidence)
        return _judge(spec, signal, before, after, evidence)


def _judge(spec: CheckSpec, signal: str, before: float, after: float, evidence: dict) -> Verdict:
    moved = after - before if signal != "target_cpu" else before - after  # a quota lowers target CPU
    pct = moved / before * 100 if before > 0 else float("inf") if moved > 0 else 0.0
    if "min_increase_ms" in spec.params:
        ok, need = moved >= spec.params["min_increase_ms"], f"{spec.params['min_increase_ms']:g} (absolute)"
    else:
        want = spec.params.get("min_increase_pct", 30.0)
        ok, need = pct >= want, f"{want:g}%"
    evidence |= {"moved": round(moved, 3), "moved_pct": round(pct, 1) if pct != float("inf") else None}
    word = "moved" if ok else "moved only"
    return verdict(spec, ok, f"{signal} {word} {before:.1f} -> {after:.1f} ({pct:+.0f}%), needed {need}"
                   + ("" if ok else ": the fault did not reach the signal it targets"), **evidence)


def _signal(tl: Timeline, signal: str, phase: str, quantile: str) -> float | None:
    start, end = tl.phase_bounds(phase) or (0.0, 0.0)
    q = {"p50": 0.5, "p95": 0.95, "p99": 0.99}[quantile]
    if signal == "client_latency":
        lat = sorted(c.latency_ms for c in tl.calls_between(start, end)
                     if c.outcome == "ok" and c.latency_ms is not None)
        return round(percentile(lat, q), 3) if lat else None
    if signal == "server_latency":
        key = f"{quantile}_ms"
        vals = [float(e.data[key]) for e in tl.events_of("period")
                if start <= e.t <= end + tl.period_s and e.data.get(key) is not None]
        return round(sum(vals) / len(vals), 3) if vals else _signal(tl, "client_latency", phase, quantile)
    attr = "host_pct" if signal == "host_cpu" else "target_pct"
    vals = [getattr(c, attr) for c in tl.cpu if start <= c.t <= end and getattr(c, attr) is not None]
    return round(sum(vals) / len(vals), 2) if vals else None


for _check in (Slo(), ErrorRate(), NoLoss(), FaultEffective()):
    register(_check)
