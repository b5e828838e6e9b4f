"""kvq.quantize of 64 MiB of float32 against the C++ BM_Quantize of the same config.

Runs kvq_bench (Google Benchmark, JSON) for BM_Quantize/<fmt>/<axis>/f32 and times the Python
call on the same shape ([16384, 8, 128] float32 = 64 MiB, Gaussian with channels 3 and 77 x12 as
in bench/bench_common.hpp), alternating C++ and Python rounds so both see the same machine
load; prints medians and the ratio Python / C++.

    python python/benchmarks/bench_quantize.py --kvq-bench build-E/bench/kvq_bench \
        --configs int4/token,int4/channel,int2/token,int8/token --rounds 3
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import numpy as np

import kvq


def bench_input() -> np.ndarray:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16384, 8, 128), dtype=np.float32)
    x[:, :, 3] *= 12.0
    x[:, :, 77] *= 12.0
    return x


def cpp_times(exe: str, name: str, reps: int) -> list[float]:
    r = subprocess.run(
        [exe, f"--benchmark_filter=^BM_Quantize/{name}/f32$", f"--benchmark_repetitions={reps}",
         "--benchmark_format=json"], capture_output=True, text=True, check=True)
    doc = json.loads(r.stdout)
    return [b["real_time"] * {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
            for b in doc["benchmarks"] if b.get("run_type") == "iteration"]


def py_times(x: np.ndarray, cfg: kvq.QuantConfig, reps: int, reuse: bool) -> list[float]:
    out = kvq.quantize(x, cfg) if reuse else None
    q = kvq.quantize(x, cfg)  # warm (and fill the recycler)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if reuse:
            kvq.quantize(x, cfg, out=out)
        else:
            q = kvq.quantize(x, cfg)
        ts.append(time.perf_counter() - t0)
    del q
    return ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvq-bench", required=True)
    ap.add_argument("--configs", default="int4/token,int4/channel")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    x = bench_input()
    print(f"kvq {kvq.__version__}, variant {kvq.variant} ({kvq.simd_level()}), input {x.shape} float32 "
          f"({x.nbytes >> 20} MiB)")
    print(f"{'config':<14} {'C++ ms':>9} {'py ms':>9} {'py out= ms':>11} {'ratio':>7} {'ratio out=':>11}")
    for name in a.configs.split(","):
        fmt, axis = name.split("/")
        cfg = kvq.QuantConfig(f"{fmt}/{axis}/g32")
        c, p, r = [], [], []
        for _ in range(a.rounds):
            c += cpp_times(a.kvq_bench, name, a.reps)
            p += py_times(x, cfg, a.reps, reuse=False)
            r += py_times(x, cfg, a.reps, reuse=True)
        mc, mp, mr = (statistics.median(v) * 1e3 for v in (c, p, r))
        print(f"{name:<14} {mc:9.2f} {mp:9.2f} {mr:11.2f} {mp / mc:7.3f} {mr / mc:11.3f}")


if __name__ == "__main__":
    main()
