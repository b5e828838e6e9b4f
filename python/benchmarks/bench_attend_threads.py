"""One decode step through KVCache.attend with threads=1, with threads=2 on the module's shared
worker pool, and with threads=2 starting its own threads per call (kvq.use_worker_pools(False)),
alternating the three in every round so all see the same machine load (a benchmark, not a test).

    python python/benchmarks/bench_attend_threads.py [--policy kivi4] [--lengths 256,2048]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import kvq


def per_call_us(c: kvq.KVCache, q: np.ndarray, threads: int, split: int, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        c.attend(0, q, threads=threads, split_tokens=split)
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="kivi4")
    ap.add_argument("--lengths", default="256,2048")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--split-tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    h, d = args.kv_heads, args.head_dim
    print(f"kvq {kvq.__version__} ({kvq.variant}), policy {args.policy}, {h} kv / {args.q_heads} "
          f"query heads, head_dim {d}, split_tokens {args.split_tokens}; us per call, median "
          f"of {args.rounds} rounds x {args.calls} calls")
    print(f"{'tokens':>7} {'threads=1':>10} {'2, pool':>9} {'2, own threads':>15}")
    for t in (int(x) for x in args.lengths.split(",")):
        c = kvq.KVCache(args.policy, 1, h, d)
        c.append(0, rng.standard_normal((t, h, d), dtype=np.float32),
                 rng.standard_normal((t, h, d), dtype=np.float32))
        q = rng.standard_normal((1, args.q_heads, d), dtype=np.float32)
        runs: dict[str, list[float]] = {"one": [], "pool": [], "own": []}
        for r in range(args.rounds + 1):  # round 0 warms up (and starts the pool)
            for name, threads, pools in (("one", 1, True), ("pool", 2, True), ("own", 2, False)):
                kvq.use_worker_pools(pools)
                us = per_call_us(c, q, threads, args.split_tokens, args.calls)
                if r > 0:
                    runs[name].append(us)
        kvq.use_worker_pools(True)
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"{t:>7} {med['one']:>10.1f} {med['pool']:>9.1f} {med['own']:>15.1f}")


if __name__ == "__main__":
    main()
