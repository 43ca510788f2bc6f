#!/usr/bin/env bash
# The agent's CUDA path on a GPU machine, in under 5 minutes:
#   1. model-only p50/p99 latency and throughput at batch 1..256, both tiers (autocast fp16/bf16)
#   2. one CUDA stream per worker: 4 worker threads must use 4 distinct non-default streams
#   3. kept-fp32 ops: every layer norm output and every attention softmax is fp32 while the matmuls
#      run in half precision; outputs stay close to a pure-fp32 run
#   4. end to end: the agent served with --device cuda, batch-1 calls and open-loop load
# Usage (from the repo root, after `make setup`):  bash bench/gpu_check.sh
# On a machine without CUDA it prints "no CUDA device" and exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
if [ ! -x "$PY" ]; then echo "gpu_check: $PY missing; run \`make setup\` first" >&2; exit 1; fi

exec timeout 290 "$PY" - "$@" <<'EOF'
import statistics, sys, threading, time

import numpy as np
import torch

if not torch.cuda.is_available():
    print(f"gpu_check: no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda}); "
          "nothing to check on this machine. Run it on a host with an NVIDIA GPU and a CUDA build of torch.")
    sys.exit(1)

import random

from agent_under_test import model as M
from agent_under_test.engine import load_engine
from agent_under_test.features import build_features
from agent_under_test.market import MarketSim
from agent_under_test.snapshot import parse_snapshot

print(f"device: {torch.cuda.get_device_name(0)}  torch {torch.__version__}  CUDA {torch.version.cuda}")
sim = MarketSim(random.Random(1))
feats = [build_features(parse_snapshot(sim.next(i))) for i in range(256)]
engine = load_engine("cuda", None, seed=0, torch_threads=1)
engine.warm_up(256)
print(f"autocast dtype: {engine.autocast_dtype}")
failures = []

# 1. latency and throughput per batch size
print("\n== model forward on CUDA (p50/p99 ms, inferences/s)")
for tier in ("full", "light"):
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for _ in range(5):
            engine.run(feats[:b], tier)
        lat = []
        for _ in range(60):
            t = time.perf_counter(); engine.run(feats[:b], tier); lat.append((time.perf_counter() - t) * 1e3)
        p50, p99 = float(np.percentile(lat, 50)), float(np.percentile(lat, 99))
        print(f"{tier:5s} batch {b:3d}  p50 {p50:7.3f}  p99 {p99:7.3f}  {b / (p50 / 1e3):10.0f}/s")

# 2. one stream per worker
engine.streams_used.clear()
def work():
    for _ in range(20):
        engine.run(feats[:16], "full")
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]; [t.join() for t in threads]
default = torch.cuda.default_stream().cuda_stream
print(f"\n== streams: {len(engine.streams_used)} distinct worker streams {sorted(engine.streams_used)} (default {default})")
if len(engine.streams_used) != 4 or default in engine.streams_used:
    failures.append("per-worker CUDA streams")

# 3. kept-fp32 ops
eager = M.build_model("full").cuda()
norm_dtypes, linear_dtypes = set(), set()
for mod in eager.modules():
    if isinstance(mod, M.FP32LayerNorm):
        mod.register_forward_hook(lambda m, i, o: norm_dtypes.add(o.dtype))
    elif isinstance(mod, torch.nn.Linear):
        mod.register_forward_hook(lambda m, i, o: linear_dtypes.add(o.dtype))
from agent_under_test.engine import collate
c = collate(feats[:32])
args = [torch.from_numpy(a).cuda() for a in (c.x, c.t, c.w, c.valid)]
with torch.inference_mode():
    ref = eager(*args).float()
    norm_dtypes.clear(); linear_dtypes.clear()  # judge the autocast run only
    with torch.autocast("cuda", dtype=engine.autocast_dtype):
        out = eager(*args).float()
soft = {m.softmax_dtype for m in eager.modules() if isinstance(m, M.SparseWindowAttention)}
diff = (out - ref).abs().max().item()
print(f"\n== precision: layer norm out {norm_dtypes}, softmax {soft}, linear out {linear_dtypes}, "
      f"max |autocast - fp32| = {diff:.4f}")
if norm_dtypes != {torch.float32} or soft != {torch.float32}:
    failures.append("layer norm / softmax not kept in fp32")
if linear_dtypes != {engine.autocast_dtype}:
    failures.append("matmuls did not run in half precision")
if diff > 0.1:
    failures.append(f"autocast output differs from fp32 by {diff}")

# 4. end to end over gRPC
from agent_under_test.launch import AgentProcess
from agent_under_test.traffic import run_traffic
import grpc
from agent_under_test.proto import agent_pb2_grpc
for tier in ("full", "light"):
    with AgentProcess(device="cuda", tier=tier, metrics_port=None, workers=2) as agent:
        with grpc.insecure_channel(agent.grpc_address) as ch:
            stub = agent_pb2_grpc.TradingAgentStub(ch)
            msgs = [sim.next(i) for i in range(300)]
            lat = []
            for m in msgs:
                t = time.perf_counter(); d = stub.Decide(m, timeout=10); lat.append((time.perf_counter() - t) * 1e3)
            assert d.tier == tier
        print(f"\n== e2e {tier} on {agent.ready['device']}: batch-1 p50 {np.percentile(lat, 50):.3f} ms p99 {np.percentile(lat, 99):.3f} ms")
        for rate in (1000, 2000):
            r = run_traffic(agent.grpc_address, rate, 6, seed=2, stream_share=0.1)
            print(f"   open loop {rate}/s: achieved {r.achieved_rate}/s ok {r.ok}/{r.sent} p50 {r.p50_ms} p99 {r.p99_ms} ms errors {r.errors}")

print("\nRESULT:", "FAIL " + "; ".join(failures) if failures else "PASS")
sys.exit(1 if failures else 0)
EOF
