"""Per-step time of kvq.hf.KvqCache against the context length T (a benchmark, not a test).

A tiny randomly initialised Llama (built offline) is prefilled with T tokens, then decodes
`--steps` tokens one at a time; the time of every KvqLayer.update (append + the incremental
re-read of the device copy) and of the whole forward step are recorded, for kvq's cache and for
transformers' DynamicCache. With the incremental device copy, update time stays flat in T; the
forward step grows with T only through attention itself (as with DynamicCache).

    python python/benchmarks/bench_hf_step.py [--policy k8v4] [--lengths 256,1024,4096]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from kvq import hf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="k8v4")
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=1 << 16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()

    update_s: list[float] = []
    orig = hf.KvqLayer.update

    def timed(self, *a, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        r = orig(self, *a, **kw)
        update_s.append(time.perf_counter() - t0)
        return r

    hf.KvqLayer.update = timed
    kw = hf.generate_cache_kwarg()
    print(f"policy {args.policy}, {cfg.num_hidden_layers} layers, kv_heads {cfg.num_key_value_heads}, "
          f"head_dim {cfg.hidden_size // cfg.num_attention_heads}, {args.steps} decode steps, "
          f"torch threads {args.threads}")
    print(f"{'T':>6} {'kvq update/layer (us)':>22} {'kvq step (ms)':>14} {'DynamicCache step (ms)':>23}")
    for T in (int(x) for x in args.lengths.split(",")):
        ids = (torch.arange(T).reshape(1, -1) * 7) % cfg.vocab_size
        row = []
        for make in (lambda: hf.KvqCache(args.policy, cfg), transformers.DynamicCache):
            cache = make()
            with torch.no_grad():
                out = model(ids, use_cache=True, **{kw: cache})
                nxt = out.logits[:, -1:].argmax(-1)
                update_s.clear()
                steps = []
                for i in range(args.steps):
                    t0 = time.perf_counter()
                    out = model(nxt, use_cache=True, **{kw: cache},
                                cache_position=torch.tensor([T + i]))
                    nxt = out.logits[:, -1:].argmax(-1)
                    steps.append(time.perf_counter() - t0)
            row.append((statistics.median(update_s) if update_s else 0.0, statistics.median(steps)))
        (upd, kstep), (_, dstep) = row
        print(f"{T:>6} {upd * 1e6:>22.1f} {kstep * 1e3:>14.2f} {dstep * 1e3:>23.2f}")


if __name__ == "__main__":
    main()
