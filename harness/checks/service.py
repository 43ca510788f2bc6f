"""Service checks: slo, error_rate, no_loss (accounting), fault_effective (the fault really bit)."""

from __future__ import annotations

from typing import Any

from harness.checks.base import CHECKS, Param, Verdict, nothing_to_judge, phase_window, verdict
from harness.checks.truth import leg_values, proxy_legs, sched_rates
from harness.scenario import CheckSpec
from harness.timeline import FaultWindow, Timeline
from wire.stats import percentile


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
    """Exact: every call the client sent is counted by the service, rejections equal; any difference
    fails (a call lost on the way, or counted twice, is what this check is for). A target without
    request counters has nothing to compare: skipped, never passed."""

    name = "no_loss"
    params: dict[str, Param] = {}

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
            # The client's own books balance, but nothing was compared with the service: not a pass.
            name = tl.metric_names.get("requests_total", "agent_requests_total")
            return nothing_to_judge(spec, f"the target exposes no request counters to compare ({name} by "
                                    f"outcome, scraped before and after the run); the client accounted for all "
                                    f"{scheduled} calls", **evidence)
        # Every call the client sent reached the agent and was counted once: ok, rejected, invalid or
        # error there. (A client timeout is still a call the agent answered, or will, so totals compare.)
        sent = scheduled - client["not_sent"]
        seen = sum(server.values())
        evidence |= {"agent": server, "client_sent": sent, "agent_seen": seen, "difference": seen - sent,
                     "rejected_difference": client["rejected"] - server.get("rejected", 0)}
        streams = sum(1 for c in tl.calls if c.method.endswith("Stream") and c.outcome != "not_sent")
        if streams:
            # The agent counts each stream message, the client each call: only "nothing missing" holds.
            evidence["stream_calls"] = streams
            if seen < sent:
                return verdict(spec, False, f"the agent counted {seen:.0f} requests for {sent} calls sent "
                               f"({streams} streams): calls were lost on the way", **evidence)
            return verdict(spec, True, f"all {scheduled} calls accounted for; the agent counted {seen:.0f} "
                           f"requests (stream messages each) for {sent} calls sent", **evidence)
        if sent != seen or client["rejected"] != server.get("rejected", 0):
            missing = sent - seen
            what = (f"{missing:.0f} sent but never counted" if missing > 0 else
                    f"{-missing:.0f} more counted than sent" if missing < 0 else "totals equal")
            return verdict(spec, False, f"client and agent disagree: client sent {sent} (rejected "
                           f"{client['rejected']}), agent counted {seen:.0f} (rejected "
                           f"{server.get('rejected', 0):.0f}): {what}", **evidence)
        return verdict(spec, True, f"all {scheduled} calls accounted for; the agent counted {seen:.0f} of "
                       f"{sent} sent (rejected {server.get('rejected', 0):.0f} = {client['rejected']})", **evidence)


def _counter_delta(tl: Timeline, name: str, label: str) -> dict[str, float] | None:
    """A labelled counter's growth over the run (last scrape minus first), by that label; None when
    the target does not export it."""
    if len(tl.samples) < 2:
        return None
    first, last = tl.samples[0].values, tl.samples[-1].values
    out: dict[str, float] = {}
    for key, value in last.items():
        if key.startswith(name + "{") and f'{label}="' in key:
            out[key.split(f'{label}="', 1)[1].split('"', 1)[0]] = value - first.get(key, 0.0)
    return out or None


def _server_counts(tl: Timeline) -> dict[str, float] | None:
    """The agent's requests_total by outcome over the run (last scrape minus first), or None."""
    return _counter_delta(tl, tl.metric_names.get("requests_total", "agent_requests_total"), "outcome")


_SIGNALS = "choice:client_latency,server_latency,host_cpu,target_cpu,proxy_added,target_runqueue,client_failures"
# The signal each fault alone moves, when the check names none (each fault judged on its own):
#   network latency-like toxics -> proxy_added: client latency (from the actual send) minus the proxy's
#       upstream leg, over the calls that finished in the window, as the mean of each one's P5-P95 (what
#       the proxy added on the client's side; CPU trouble in the target moves both and cancels out)
#   other network toxics        -> client_failures: errors + timeouts per call the client sent
#   cpu:contention              -> target_runqueue: ms per s the target's threads waited for a CPU
#   cpu:quota                   -> target_cpu: the target's CPU use held at the quota
#   process:pause               -> target_cpu: no CPU at all while stopped
_LATENCY_TOXICS = {"latency", "bandwidth", "slicer", "grpc_delay", "http_delay"}
# proxy_added's noise without any toxic: a service that stalls (a CPU quota) answers in bursts, and the
# client stamps a burst's calls one after another; measured up to +1 ms (mean of P5-P95) on a 2-core
# host. A latency toxic that adds less than the floor cannot be told from that.
PROXY_ADDED_FLOOR_MS = 2.0


class FaultEffective:
    name = "fault_effective"
    params = {"phase": Param("phase", required=True), "baseline": Param("phase"),
              "signal": Param(_SIGNALS, help="one signal for the whole phase; default: each fault on its own"),
              "quantile": Param("choice:p50,p95,p99", help="for latency signals (default p99; proxy_added: "
                                "the mean of its P5-P95)"),
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
        base = spec.params.get("baseline", tl.phases[0][0])
        if spec.params.get("signal"):
            return self._phase(tl, spec, phase, base, windows)
        results = [_one_fault(tl, spec, w, base) for w in windows]
        failed = [r for r in results if not r["ok"]]
        evidence = {"baseline_phase": base, "faults": results}
        if failed:
            f = failed[0]
            tail = ("the fault did not do what was asked" if f.get("measured") else
                    "the fault did not reach the signal it alone moves")
            return verdict(spec, False, f"{f['fault']}: {f['summary']}: {tail}"
                           + (f" ({len(failed)} of {len(results)} faults)" if len(results) > 1 else ""),
                           **evidence)
        said = "; ".join(f"{r['fault']}: {r['summary']}" for r in results)
        if all(r.get("skipped") for r in results):     # nothing moved because nothing was there to move
            return nothing_to_judge(spec, said, **evidence)
        return verdict(spec, True, said, **evidence)

    def _phase(self, tl: Timeline, spec: CheckSpec, phase: str, base: str, windows: list[FaultWindow]) -> Verdict:
        signal = spec.params["signal"]
        q = spec.params.get("quantile", "mid" if signal == "proxy_added" else "p99")
        start, end = tl.phase_bounds(phase) or (0.0, 0.0)
        b0, b1 = tl.phase_bounds(base) or (0.0, 0.0)
        before = _signal(tl, signal, b0, b1, q)
        after = _signal(tl, signal, start, end, q)
        evidence = {"signal": signal, "baseline_phase": base, "before": before, "during": after,
                    "faults": [f.label for f in windows]}
        if before is None or after is None:
            if signal == "proxy_added" and proxy_legs(tl) is None:
                return nothing_to_judge(spec, f"{signal} cannot be measured: {_no_legs(tl)}", **evidence)
            return verdict(spec, False, f"no {signal} data to compare ({base}: {before}, {phase}: {after})",
                           **evidence)
        return _judge(spec, signal, before, after, evidence)


def _one_fault(tl: Timeline, spec: CheckSpec, w: FaultWindow, base: str) -> dict[str, Any]:
    """Judge one fault on what it was measured to do (`w.effect`: the proxy's counts for a toxic, the
    workers' CPU time, the cgroup's throttling) against what was asked. The signal it alone moves on
    the client's or the target's side stays as evidence; it decides only when nothing was measured
    (toxiproxy-server, a fault with no measure of its own), and the result says so."""
    seen = _by_signal(tl, spec, w, base)
    missing = _NOT_MEASURED.get(w.family if w.family == "network" else f"{w.family}:{w.kind}")
    if missing is None:
        return seen
    if w.effect is None or w.effect.get("unreadable"):
        why = str(w.effect["unreadable"]) if w.effect else missing
        return seen | {"measured": None, "summary": f"{seen['summary']} ({why})"}
    client = {k: seen[k] for k in ("signal", "before", "during", "summary", "skipped") if k in seen}
    if w.family == "network":
        judged = _judge_toxic(w.effect)
    elif w.kind == "contention":
        judged = _judge_contention(w.effect, seen)
    else:
        judged = _judge_quota(w.effect, seen)
    out = {k: v for k, v in seen.items() if k in ("fault", "window_s")}
    said = judged.pop("summary")
    if w.family == "network" and not judged.get("skipped"):
        said += f"; client saw {_short(seen)}"
    return out | judged | {"measured": w.effect, "client": client, "summary": said}


# What is said when a fault that has a measure of its own came without one.
_NOT_MEASURED = {"network": "judged on the client's signal: the proxy's own measure was not available",
                 "cpu:contention": "judged on the target's signal: the workers' CPU time was not measured",
                 "cpu:quota": "judged on the target's signal: the cgroup's throttling was not measured"}


def _short(seen: dict[str, Any]) -> str:
    """The client-side signal in a few words: `signal before -> during`, or why it has none."""
    if seen.get("before") is not None and seen.get("during") is not None:
        unit = _UNITS.get(seen["signal"], "")
        return f"{seen['signal']} {seen['before']:.1f} -> {seen['during']:.1f}{unit}"
    return f"no {seen.get('signal', 'signal')} (not measured)"


_UNITS = {"proxy_added": " ms", "target_runqueue": " ms/s", "client_failures": "%"}


def _by_signal(tl: Timeline, spec: CheckSpec, w: FaultWindow, base: str) -> dict[str, Any]:
    """Judge one fault on its own signal between when it took effect and when it was removed."""
    start = float(w.applied_s or 0.0)
    end = w.removed_s if w.removed_s is not None else (tl.phase_bounds(w.phase) or (0.0, tl.duration_s))[1]
    b0, b1 = tl.phase_bounds(base) or (0.0, 0.0)
    out: dict[str, Any] = {"fault": w.label, "window_s": [round(start, 3), round(end, 3)]}
    if w.family == "network" and w.kind in _LATENCY_TOXICS:
        signal, q = "proxy_added", spec.params.get("quantile", "mid")
    elif w.family == "network":
        signal, q = "client_failures", "p99"
    elif w.family == "cpu" and w.kind == "contention":
        signal, q = "target_runqueue", "p99"
    elif w.family == "cpu" and w.kind == "quota" or w.family == "process":
        signal, q = "target_cpu", "p99"
    else:
        signal, q = "server_latency", spec.params.get("quantile", "p99")
    if signal == "proxy_added" and proxy_legs(tl) is None:
        return out | {"signal": signal, "ok": True, "skipped": True,
                      "summary": f"{signal} cannot be measured: {_no_legs(tl)}"}
    before, during = _signal(tl, signal, b0, b1, q), _signal(tl, signal, start, end, q)
    out |= {"signal": signal, "before": before, "during": during}
    if before is None or during is None:
        return out | {"ok": False, "summary": f"no {signal} data ({base}: {before}, fault: {during})"}
    if signal == "target_cpu":
        cap = _quota_pct(w)
        if w.family == "process":
            if before <= 2.0:
                return out | {"ok": True, "skipped": True,
                              "summary": f"target CPU only {before:.1f}% before the pause (not more than 2%): a "
                                         "stopped process cannot be told from an idle one, nothing to judge"}
            ok = during <= 2.0
            why = f"target CPU {before:.1f}% -> {during:.1f}% while paused (needed <= 2%)"
        else:
            limit = cap * 1.25 + 2.0
            ok = during <= limit and before > cap
            why = (f"target CPU {before:.1f}% -> {during:.1f}% under a {cap:g}% quota (needed <= {limit:.1f}%, "
                   f"and more than {cap:g}% before, or the quota never bound)")
        return out | {"ok": ok, "summary": why}
    moved = during - before
    floor = {"proxy_added": PROXY_ADDED_FLOOR_MS, "target_runqueue": 5.0, "client_failures": 1.0}.get(signal, 0.0)
    if "min_increase_ms" in spec.params and signal in ("proxy_added", "server_latency"):
        need, ok = f"{spec.params['min_increase_ms']:g} ms", moved >= spec.params["min_increase_ms"]
    else:
        pct = spec.params.get("min_increase_pct", 30.0)
        need_abs = max(floor, abs(before) * pct / 100)
        need, ok = f"+{need_abs:.1f} ({pct:g}%, at least {floor:g})", moved >= need_abs
    unit = _UNITS.get(signal, "")
    return out | {"ok": ok, "moved": round(moved, 3),
                  "summary": f"{signal} {before:.1f} -> {during:.1f}{unit}, needed {need}"}


# ---- judging a fault on what it was measured to do -------------------------------------------------
# A toxic's effect is the proxy's count (faults.proxy.toxics.ToxicEffect.to_json): only connections
# the toxicity draw made active count chunks and holds, so toxicity < 1 needs no scaling. Tolerance:
# a held-time measure must reach half of what was asked (timers, a chunk that had aged in a queue);
# a count (bytes cut, closes, resets, calls failed) must be at least one.
MIN_EXPECTED_CALLS = 3.0     # a call toxic that changed no call is only judged when 3+ were expected


def _nothing_flowed(e: dict[str, Any]) -> str | None:
    """Why there is nothing to judge: no traffic at all through the toxic while it was on."""
    keys = ("chunks", "bypassed_chunks", "ends", "closed", "reset", "calls")
    if any(e.get(k, 0) for k in keys):
        return None
    what = "no call matched it" if e.get("type", "") in _CALL_TYPES else "no chunk and no connection end"
    return f"{e.get('type', 'toxic')} toxic: nothing flowed through it while it was on ({what})"


_CALL_TYPES = {"grpc_delay", "grpc_error", "http_delay", "http_error"}


def asked_mean_ms(latency_ms: float, jitter_ms: float) -> float:
    """The mean delay asked: latency +/- jitter drawn uniformly, a negative draw counting as 0."""
    lo, hi = latency_ms - jitter_ms, latency_ms + jitter_ms
    if jitter_ms <= 0 or lo >= 0:
        return max(0.0, latency_ms)
    return hi * hi / (4.0 * jitter_ms) if hi > 0 else 0.0


def _judge_toxic(e: dict[str, Any]) -> dict[str, Any]:
    """A toxic judged on the proxy's count of what it did (ok, skipped, summary)."""
    why = _nothing_flowed(e)
    if why is not None:
        return {"ok": True, "skipped": True, "summary": why}
    if not e.get("active_connections") and e.get("bypassed_chunks"):
        # Traffic flowed, and the toxic touched none of it: it did nothing, whatever the reason.
        return {"ok": False, "summary": f"{e.get('type')} toxic: the toxicity draw ({e.get('toxicity', 1.0):g}) "
                                        f"spared all {e.get('connections', 0)} connections ({e['bypassed_chunks']} "
                                        "chunks passed untouched)"}
    judge = _TOXIC_JUDGES.get(str(e.get("type")), _judge_passing)
    return judge(e, e.get("attributes") or {})


def _judge_latency(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    asked = asked_mean_ms(float(a.get("latency", 0)), float(a.get("jitter", 0)))
    n, total, top = e.get("held_chunks", 0), float(e.get("held_ms_total", 0.0)), float(e.get("held_ms_max", 0.0))
    what = f"asked {a.get('latency', 0)} ms +/- {a.get('jitter', 0)} ms"
    if asked <= 0:
        return {"ok": True, "skipped": True, "summary": f"latency toxic: {what}, nothing to hold"}
    mean = total / n if n else 0.0
    need = asked / 2
    ok = n > 0 and mean >= need
    return {"ok": ok, "held_ms_mean": round(mean, 3), "asked_ms": round(asked, 3),
            "summary": f"latency toxic held {n} chunks {mean:.1f} ms on average (max {top:.1f} ms), {what} "
                       f"(needed >= {need:.1f} ms){'' if ok else ', whatever the client saw'}"}


def _judge_bandwidth(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    rate = float(a.get("rate", 0))
    if rate <= 0:
        return {"ok": True, "skipped": True, "summary": "bandwidth toxic: asked no limit (rate 0)"}
    sent, busy_ms = int(e.get("bytes_out", 0)), float(e.get("busy_ms", 0.0))
    kbps = sent / busy_ms if busy_ms > 0 else float("inf")    # bytes per ms = KB/s
    ok = sent > 0 and kbps <= 2 * rate
    shown = f"{kbps:.0f}" if kbps != float("inf") else "unbounded"
    return {"ok": ok, "measured_kbps": round(kbps, 1) if kbps != float("inf") else None,
            "summary": f"bandwidth toxic passed {sent} bytes in {busy_ms:.1f} ms of holding: {shown} KB/s, asked "
                       f"{rate:g} KB/s (needed <= {2 * rate:g})"}


def _judge_slicer(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    chunks, pieces, size = int(e.get("chunks", 0)), int(e.get("pieces", 0)), int(e.get("bytes", 0))
    avg, var = int(a.get("average_size", 0)), int(a.get("size_variation", 0))
    said = f"slicer toxic cut {chunks} chunks ({size} bytes) into {pieces} pieces, asked ~{avg} bytes each"
    if avg <= 0 or size <= chunks * (avg + var):
        return {"ok": True, "skipped": True, "summary": f"{said}: no chunk needed cutting on average"}
    ok = pieces > chunks
    return {"ok": ok, "summary": said + ("" if ok else " (needed more pieces than chunks)")}


def _judge_cut(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    """timeout, limit_data: bytes actually dropped or connections actually closed."""
    kind, dropped, closed = e.get("type"), int(e.get("bytes_dropped", 0)), int(e.get("closed", 0))
    limit = int(a.get("bytes", 0))
    if kind == "limit_data" and int(e.get("bytes", 0)) <= limit:
        return {"ok": True, "skipped": True, "summary": f"limit_data toxic: only {e.get('bytes', 0)} bytes passed, "
                                                        f"not more than the {limit}-byte limit"}
    ok = dropped > 0 or closed > 0
    return {"ok": ok, "summary": f"{kind} toxic dropped {dropped} of {e.get('bytes', 0)} bytes and closed {closed} "
                                 f"of {e.get('active_connections', 0)} connections (needed a byte dropped or a "
                                 "connection closed)"}


def _judge_reset(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    resets = int(e.get("reset", 0))
    return {"ok": resets > 0, "summary": f"reset_peer toxic reset {resets} of {e.get('active_connections', 0)} "
                                         f"connections after {e.get('chunks', 0)} chunks (needed at least 1)"}


def _judge_slow_close(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    ends, held = int(e.get("ends", 0)), float(e.get("end_held_ms_total", 0.0))
    asked = float(a.get("delay", 0))
    if ends == 0 or asked <= 0:
        return {"ok": True, "skipped": True, "summary": f"slow_close toxic: {ends} connections ended while it was "
                                                        f"on, asked {asked:g} ms: nothing to judge"}
    mean = held / ends
    ok = mean >= asked / 2
    return {"ok": ok, "summary": f"slow_close toxic held {ends} connection ends {mean:.1f} ms on average, asked "
                                 f"{asked:g} ms (needed >= {asked / 2:.1f} ms)"}


def _judge_call_delay(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    calls, delayed, total = int(e.get("calls", 0)), int(e.get("calls_delayed", 0)), float(e.get("delay_ms_total", 0))
    asked = asked_mean_ms(float(a.get("delay", 0)), float(a.get("jitter", 0)))
    expected = calls * float(a.get("share", 1.0))
    what = f"{e.get('type')} toxic delayed {delayed} of {calls} calls"
    if asked <= 0 or (delayed == 0 and expected < MIN_EXPECTED_CALLS):
        return {"ok": True, "skipped": True, "summary": f"{what}, {expected:.1f} expected at share "
                                                        f"{a.get('share', 1.0):g}: too few to judge"}
    mean = total / delayed if delayed else 0.0
    ok = delayed > 0 and mean >= asked / 2
    return {"ok": ok, "summary": f"{what} {mean:.1f} ms on average ({e.get('calls_cut', 0)} cut short), asked "
                                 f"{a.get('delay', 0)} ms +/- {a.get('jitter', 0)} ms (needed >= {asked / 2:.1f} ms)"}


def _judge_call_error(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    calls, failed = int(e.get("calls", 0)), int(e.get("calls_failed", 0))
    expected = calls * float(a.get("share", 1.0))
    what = f"{e.get('type')} toxic failed {failed} of {calls} calls"
    if failed == 0 and expected < MIN_EXPECTED_CALLS:
        return {"ok": True, "skipped": True, "summary": f"{what}, {expected:.1f} expected at share "
                                                        f"{a.get('share', 1.0):g}: too few to judge"}
    return {"ok": failed > 0, "summary": f"{what} ({expected:.1f} expected at share {a.get('share', 1.0):g}; "
                                         "needed at least 1)"}


def _judge_passing(e: dict[str, Any], a: dict[str, Any]) -> dict[str, Any]:
    """A toxic with no measure of its own (noop): it passed traffic on."""
    return {"ok": True, "summary": f"{e.get('type')} toxic passed {e.get('chunks', 0)} chunks"}


_TOXIC_JUDGES = {"latency": _judge_latency, "bandwidth": _judge_bandwidth, "slicer": _judge_slicer,
                 "timeout": _judge_cut, "limit_data": _judge_cut, "reset_peer": _judge_reset,
                 "slow_close": _judge_slow_close, "grpc_delay": _judge_call_delay, "http_delay": _judge_call_delay,
                 "grpc_error": _judge_call_error, "http_error": _judge_call_error}


# Contention workers share their CPUs with everything else runnable there (the target, other load on
# a small host): a quarter of the cores asked tells workers that burn from workers that do not (0).
MIN_BURN_SHARE = 0.25


def _judge_contention(e: dict[str, Any], seen: dict[str, Any]) -> dict[str, Any]:
    """Contention judged on what the workers burned (at least MIN_BURN_SHARE of the cores asked) AND on
    the target's run-queue wait (today's signal), when that was measured."""
    burned, asked = float(e.get("burned_cores", 0.0)), float(e.get("asked_cores", 0.0))
    need = asked * MIN_BURN_SHARE
    burn_ok = burned >= need and burned > 0
    said = (f"workers burned {burned:.2f} of {asked:.2f} cores asked ({e.get('cpu_s', 0):.1f} CPU s in "
            f"{e.get('window_s', 0):.1f} s, needed >= {need:.2f})")
    if seen.get("before") is None or seen.get("during") is None:
        return {"ok": burn_ok, "summary": f"{said}; run-queue not measured ({seen['summary']})"}
    return {"ok": burn_ok and bool(seen["ok"]), "summary": f"{said}; {seen['summary']}"}


def _judge_quota(e: dict[str, Any], seen: dict[str, Any]) -> dict[str, Any]:
    """A quota judged on the cgroup's throttling: one that never throttled did not bind. The target's
    CPU use stays beside it as evidence."""
    periods, throttled, ms = int(e.get("nr_periods", 0)), int(e.get("nr_throttled", 0)), e.get("throttled_us", 0) / 1000
    pct = e["quota_us"] / e["period_us"] * 100 if e.get("period_us") else 0.0
    ok = throttled > 0
    said = (f"throttled in {throttled} of {periods} periods ({ms:.0f} ms) under a {pct:g}% quota"
            + ("" if ok else ": the quota never bound"))
    return {"ok": ok, "summary": f"{said}; {seen['summary']}"}


def _no_legs(tl: Timeline) -> str:
    """Why the run has no upstream-leg timings."""
    return str(tl.outside.get("legs_unreadable") or "the proxy timed no call's upstream leg (no proxy, a proxy "
               "other than shadowtest's, or traffic other than HTTP/1.x and HTTP/2 in the clear)")


def mid_mean(values: list[float]) -> float:
    """Mean of the sorted `values` between their P5 and P95 (a 10 % trimmed mean)."""
    n = len(values)
    cut = int(n * 0.05)
    middle = values[cut:n - cut] or values
    return sum(middle) / len(middle)


def _quota_pct(w: FaultWindow) -> float:
    """The quota in force, % of one core: from what the applier reported it set ("limited to Qus per
    Pus"), else the label's pct (a pct_of_use quota is known only once applied)."""
    import re

    m = re.search(r"limited to (\d+)us per (\d+)us", w.detail)
    if m and int(m.group(2)) > 0:
        return round(int(m.group(1)) / int(m.group(2)) * 100.0, 2)
    m = re.search(r"\bpct=([0-9.]+)", w.label)
    return float(m.group(1)) if m else 100.0


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


def _signal(tl: Timeline, signal: str, start: float, end: float, quantile: str) -> float | None:
    q = {"p50": 0.5, "p95": 0.95, "p99": 0.99, "mid": 0.5}[quantile]
    if signal == "client_latency":
        lat = sorted(c.latency_ms for c in tl.calls_between(start, end)
                     if c.outcome == "ok" and c.latency_ms is not None)
        return round(percentile(lat, q), 3) if lat else None
    if signal == "proxy_added":
        # The client's latency from the call's actual send (the replayer's own lag is not the proxy's)
        # against the leg's, both over the calls that finished in the window.
        client = sorted((c.done_s - c.sent_s) * 1000.0 for c in tl.calls_between(start, end)
                        if c.outcome == "ok" and c.done_s is not None and c.sent_s is not None)
        legs = leg_values(tl, start, end)
        if not client or not legs:
            return None
        if quantile == "mid":
            return round(mid_mean(client) - mid_mean(legs), 3)
        return round(percentile(client, q) - percentile(legs, q), 3)
    if signal == "client_failures":
        calls = [c for c in tl.calls_between(start, end) if c.outcome != "not_sent"]
        bad = sum(1 for c in calls if c.outcome in ("error", "timeout"))
        return round(bad / len(calls) * 100, 3) if calls else None
    if signal in ("target_runqueue", "target_cpu") and tl.outside.get("sched"):
        rates = sched_rates(tl, start, end)
        if rates is None:
            return None
        return rates[1] if signal == "target_runqueue" else rates[0]
    if signal == "target_runqueue":
        return None
    if signal == "server_latency":
        key = f"{quantile}_ms"
        vals = [float(e.data[key]) for e in tl.events_of("period")
                if start <= e.t <= end + tl.period_s and e.data.get(key) is not None]
        return round(sum(vals) / len(vals), 3) if vals else _signal(tl, "client_latency", start, end, quantile)
    attr = "host_pct" if signal == "host_cpu" else "target_pct"
    vals = [getattr(c, attr) for c in tl.cpu if start <= c.t <= end and getattr(c, attr) is not None]
    return round(sum(vals) / len(vals), 2) if vals else None


class DeadlinesHonored:
    """Calls whose deadline passed while they waited are not computed. The target counts, at each batch,
    the calls whose caller was already gone (its server cancelled them at the deadline): `dropped`
    before the forward pass, or `computed` for nobody. The client's own count of calls that ran out of
    time is the evidence beside it."""

    name = "deadlines_honored"
    params = {"max_computed_pct": Param("number", help="expired calls computed all the same, % of the "
                                                       "expired ones (default 5; 2 calls always allowed: a "
                                                       "call may expire as its pass starts)")}

    def evaluate(self, tl: Timeline, spec: CheckSpec) -> Verdict:
        name = tl.metric_names.get("expired_calls", "agent_expired_calls_total")
        counts = _counter_delta(tl, name, "fate")
        timed_out = sum(1 for c in tl.calls if c.outcome == "timeout")
        if counts is None:
            return nothing_to_judge(spec, f"the target exports no {name} (by fate: dropped, computed): what it "
                                    f"did with the {timed_out} calls the client gave up on cannot be seen")
        dropped, computed = counts.get("dropped", 0.0), counts.get("computed", 0.0)
        expired = dropped + computed
        evidence = {"dropped": dropped, "computed": computed, "client_timeouts": timed_out}
        if expired == 0:
            return nothing_to_judge(spec, f"no call was past its deadline when its batch formed (the client "
                                    f"timed out {timed_out})", **evidence)
        allowed = max(2.0, expired * spec.params.get("max_computed_pct", 5.0) / 100)
        said = (f"{expired:.0f} calls were past their deadline when their batch formed: {dropped:.0f} dropped, "
                f"{computed:.0f} computed (the client timed out {timed_out})")
        if computed > allowed:
            return verdict(spec, False, f"{said}: it computes answers nobody will read (at most {allowed:.0f} "
                           "allowed)", **evidence)
        return verdict(spec, True, f"{said}; at most {allowed:.0f} computed allowed", **evidence)


for _check in (Slo(), ErrorRate(), NoLoss(), FaultEffective(), DeadlinesHonored()):
    CHECKS.add(_check.name, _check)
