"""Capture overhead: the agent under the same open-loop load with and without the eBPF recorder.

    agent (light tier) <-- run_traffic (open loop, fixed seed) --+-- baseline: no recorder
                                                                 +-- recorded: `shadowtest record` (subprocess)
    then: a burst at --burst-rate to count lost events, and a 100,000-packet pcap import timed.

Prints throughput ratio, p99 delta, recorder CPU per 1,000 calls/s, lost/truncated events, import
speed. Targets (issue 4): <= 3 % less throughput, <= 1 ms more p99, zero lost events at 3,000
calls/s, recorder CPU <= 5 % of a core per 1,000 calls/s. Needs root + bcc; run as
`.venv/bin/python bench/capture_overhead.py [--rate 800 --duration 8]`.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from agent_under_test.launch import AgentProcess  # noqa: E402
from agent_under_test.traffic import run_traffic  # noqa: E402
from capture.recording import Recording  # noqa: E402


def start_recorder(port: int, out: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "harness.cli", "record", "--port", str(port), "--max-bytes", "262144",
           "-o", str(out), "--json"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists():
            try:
                with Recording(out) as r:
                    if "backend_settings" in r.meta:
                        return proc
            except Exception:  # noqa: BLE001 - being created
                pass
        time.sleep(0.1)
    raise SystemExit("recorder did not start (root and bcc needed: see `shadowtest doctor`)")


def stop_recorder(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def load(address: str, rate: float, duration: float, seed: int) -> object:
    return run_traffic(address, rate, duration, seed=seed, stream_share=0.1)


def overhead(agent: AgentProcess, port: int, tmp: Path, rate: float, duration: float) -> dict[str, float]:
    base = [load(agent.grpc_address, rate, duration, 1)]
    proc = start_recorder(port, tmp / "bench.rec")
    ps = psutil.Process(proc.pid)
    c0 = cpu_s(ps)
    rec = [load(agent.grpc_address, rate, duration, 1)]
    c1 = cpu_s(ps)
    stop_recorder(proc)
    base.append(load(agent.grpc_address, rate, duration, 1))   # baseline again: drift shows up here
    with Recording(tmp / "bench.rec") as r:
        lost, trunc = r.meta.get("lost_events", 0), r.meta.get("truncated_events", 0)
        calls = r.count("calls")
        req_msgs = r._db.execute("SELECT count(*) FROM messages WHERE direction='c2s'").fetchone()[0]
    thr_base = sum(b.achieved_rate for b in base) / len(base)
    ok_base = sum(b.ok for b in base) / len(base) / duration
    p99_base = sum(b.p99_ms or 0 for b in base) / len(base)
    r0 = rec[0]
    return {"rate": rate, "sent_base": thr_base, "ok_per_s_base": ok_base, "ok_per_s_rec": r0.ok / duration,
            "throughput_ratio": (r0.ok / duration) / ok_base if ok_base else 0.0,
            "p99_base_ms": p99_base, "p99_rec_ms": r0.p99_ms or 0.0, "p99_base_runs": [b.p99_ms for b in base],
            "recorder_cpu_pct": (c1 - c0) / duration * 100, "lost": lost, "truncated": trunc,
            "calls_recorded": calls, "calls_sent": r0.sent, "request_messages": req_msgs}


def burst(agent: AgentProcess, port: int, tmp: Path, rate: float, duration: float) -> dict[str, float]:
    proc = start_recorder(port, tmp / "burst.rec")
    rep = load(agent.grpc_address, rate, duration, 2)
    stop_recorder(proc)
    with Recording(tmp / "burst.rec") as r:
        return {"burst_rate": rate, "achieved": rep.achieved_rate, "sent": rep.sent,
                "recorded_messages": r.count("messages"), "calls_recorded": r.count("calls"),
                "lost": r.meta.get("lost_events", 0), "truncated": r.meta.get("truncated_events", 0)}


def import_speed(tmp: Path, packets: int) -> dict[str, float]:
    """Write a `packets`-packet pcap of gRPC conversations, then time `import_capture` on it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_capture_pcap import _segments, _write_pcap  # the tests' own generator

    one = _segments(calls=50, mss=300)
    pkts, conn = [], 0
    while len(pkts) < packets:
        shift = conn * 10_000_000_000
        port_patch = (40001 + conn % 20000).to_bytes(2, "big")
        for ts, frame in one:
            # give each copy its own client port so they are separate connections
            f = bytearray(frame)
            if f[12:16] == bytes([10, 0, 0, 1]):
                f[20:22] = port_patch
            else:
                f[22:24] = port_patch
            pkts.append((ts + shift, bytes(f)))
        conn += 1
    pkts = pkts[:packets]
    _write_pcap(tmp / "big.pcap", pkts)
    from capture.pcap_import import import_capture

    t0 = time.perf_counter()
    res = import_capture(str(tmp / "big.pcap"), str(tmp / "big.rec"))
    return {"packets": res.packets, "seconds": time.perf_counter() - t0, "calls": res.sink.calls,
            "flows": res.sink.flows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=800)
    ap.add_argument("--duration", type=float, default=8)
    ap.add_argument("--burst-rate", type=float, default=3000)
    ap.add_argument("--burst-duration", type=float, default=4)
    ap.add_argument("--packets", type=int, default=100_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d, AgentProcess(tier="light") as agent:
        tmp, port = Path(d), int(agent.grpc_address.rsplit(":", 1)[1])
        o = overhead(agent, port, tmp, args.rate, args.duration)
        print(f"open loop at {o['rate']:.0f} calls/s for {args.duration:.0f} s, agent tier light:")
        print(f"  answered/s  baseline {o['ok_per_s_base']:.0f}  recorded {o['ok_per_s_rec']:.0f}  "
              f"ratio {o['throughput_ratio']:.3f}   (target >= 0.97)")
        print(f"  p99         baseline {o['p99_base_ms']:.2f} ms (runs {o['p99_base_runs']})  "
              f"recorded {o['p99_rec_ms']:.2f} ms  delta {o['p99_rec_ms'] - o['p99_base_ms']:+.2f} ms"
              "   (target <= +1 ms)")
        per_k = o["recorder_cpu_pct"] / (o["rate"] / 1000)
        print(f"  recorder CPU {o['recorder_cpu_pct']:.1f} % of a core = {per_k:.1f} % per 1,000 calls/s"
              "   (target <= 5 %; GoReplay ~23 %)")
        print(f"  recorded {o['request_messages']} request messages ({o['calls_recorded']} calls: unary + streams) "
              f"of {o['calls_sent']} sent; lost {o['lost']}, "
              f"truncated {o['truncated']}")
        b = burst(agent, port, tmp, args.burst_rate, args.burst_duration)
        print(f"burst at {b['burst_rate']:.0f} calls/s (achieved {b['achieved']:.0f}): sent {b['sent']}, "
              f"recorded {b['recorded_messages']} request+response messages in {b['calls_recorded']} calls, "
              f"lost {b['lost']}, truncated {b['truncated']}   (target: 0 lost)")
    with tempfile.TemporaryDirectory() as d:
        i = import_speed(Path(d), args.packets)
        print(f"pcap import: {i['packets']} packets in {i['seconds']:.1f} s = {i['packets'] / i['seconds']:.0f} "
              f"packets/s, {i['flows']} flows, {i['calls']} calls   (target: well under 60 s)")


if __name__ == "__main__":
    main()
