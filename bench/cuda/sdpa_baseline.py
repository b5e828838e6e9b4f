#!/usr/bin/env python3
"""Baseline for kvq_bench_cuda's decode rows: PyTorch's scaled_dot_product_attention over
contiguous f16 K/V, at the shapes kvq_bench_cuda decodes (one query per head, 32 query heads over
8 kv heads, head_dim 128; one sequence of 8k / 32k / 128k tokens and 32 sequences of 32k), timed
with CUDA events (median of --iters runs after 3 warm-ups) next to a device-to-device copy of
1 GiB measured in the same process. Bytes counted: the K and V read once (2 x batch x tokens x
8 x 128 x 2 bytes), as kvq counts its page bytes. Each SDPA backend that accepts the shape is
timed and printed. Output lines follow kvq_bench_cuda's
"name<TAB>key=value..." format (bench/cuda/run_device_checks.sh tabulates them).
Without torch or a GPU it prints why and exits 0."""
import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except Exception as e:  # noqa: BLE001 - any import failure means no baseline
        print(f"sdpa_baseline: torch not importable ({e}); skipped")
        return 0
    if not torch.cuda.is_available():
        print("sdpa_baseline: no CUDA device visible; skipped")
        return 0
    dev = torch.device("cuda")

    def median_ms(fn):
        for _ in range(3):
            fn()
        times = []
        for _ in range(args.iters):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=dev).fill_(1)
    dst = torch.empty_like(src)
    mc_ms = median_ms(lambda: dst.copy_(src))
    mc_gbs = 2.0 * n / (mc_ms * 1e6)
    print(f"torch_memcpy_d2d\tms={mc_ms:.4f}\tGB/s={mc_gbs:.1f}\tratio=1.000")
    del src, dst

    Hq, H, D = 32, 8, 128
    shapes = [(1, 8192), (1, 32768), (1, 131072), (32, 32768)]
    if args.quick:
        shapes = [(1, 8192), (1, 32768), (8, 32768)]
    backends = [("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)]
    g = torch.Generator(device=dev).manual_seed(1)
    for B, T in shapes:
        q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.float16, generator=g)
        k = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=g)
        v = torch.randn(B, H, T, D, device=dev, dtype=torch.float16, generator=g)
        nbytes = 2.0 * B * T * H * D * 2
        for name, be in backends:
            if name == "math" and B * T > 65536:
                continue  # materializes [B, Hq, 1, T] scores in f32 plus a repeated K/V: not a contender
            try:
                with sdpa_kernel([be]):
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                    ms = median_ms(fn)
            except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is skipped
                print(f"# sdpa backend {name} refused batch={B} tokens={T}: {str(e).splitlines()[0][:120]}",
                      file=sys.stderr)
                continue
            gbs = nbytes / (ms * 1e6)
            print(f"sdpa_f16/{name}\tbatch={B}\ttokens={T}\tms={ms:.4f}\tGB/s={gbs:.1f}\t"
                  f"ratio={gbs / mc_gbs:.3f}\tkv_tokens/s={B * T / (ms * 1e-3):.3g}")
        del q, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
