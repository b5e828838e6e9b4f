#!/usr/bin/env python3
"""Independent reference for kvq's Gemma 3 runner (include/kvq/eval/llama_gguf.hpp, arch gemma3).

A plain numpy fp32 forward pass of a Gemma 3 GGUF written from the model's published description
(not from kvq): the `gguf` package (pip) reads and dequantizes the tensors, and the `sentencepiece`
package (pip) tokenizes, from a SentencePiece model rebuilt from the GGUF vocabulary (pieces,
scores, types; BPE with byte fallback, no dummy prefix, whitespace escaped to U+2581, user-defined
pieces matched on the raw text). Nothing here imports or runs kvq.

  gemma3_reference.py logits MODEL.gguf ID ID ...   logits of every position (recorded for
                                                    tests/eval/test_gemma3.cpp)
  gemma3_reference.py tokens MODEL.gguf TEXT        token ids of TEXT (BOS first)
  gemma3_reference.py ppl MODEL.gguf TEXT_FILE      perplexity under shared/docs/reference.md's
                                                    Gemma protocol (lines, BOS, 512 tokens)

Requirements: pip install gguf numpy sentencepiece protobuf
"""
import math
import sys

import numpy as np
import gguf


def field(r, key, default=None):
    f = r.fields.get(key)
    if f is None:
        return default
    return f.contents()


class Gemma3:
    def __init__(self, path):
        r = gguf.GGUFReader(path)
        self.r = r
        assert field(r, "general.architecture") == "gemma3"
        a = "gemma3."
        self.n_layers = int(field(r, a + "block_count"))
        self.dim = int(field(r, a + "embedding_length"))
        self.n_heads = int(field(r, a + "attention.head_count"))
        self.n_kv = int(field(r, a + "attention.head_count_kv"))
        self.hd = int(field(r, a + "attention.key_length"))
        self.eps = float(field(r, a + "attention.layer_norm_rms_epsilon"))
        self.base_global = float(field(r, a + "rope.freq_base"))
        self.base_local = float(field(r, a + "rope.freq_base_swa", 10000.0))
        self.window = int(field(r, a + "attention.sliding_window"))
        scalar = field(r, a + "attention.query_pre_attn_scalar", None)
        self.q_scale = 1.0 / math.sqrt(float(scalar) if scalar is not None else self.hd)
        # Every 6th layer global (layers 5, 11, 17 of 18) unless the file says otherwise.
        self.sliding = [(l % 6) != 5 for l in range(self.n_layers)]
        self.t = {t.name: t for t in r.tensors}

    def w(self, name):
        t = self.t[name]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.asarray(a, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])

    def load(self):
        self.emb = self.w("token_embd.weight")  # [vocab, dim]
        self.out_norm = self.w("output_norm.weight")
        self.layers = []
        for l in range(self.n_layers):
            p = "blk.%d." % l
            self.layers.append({k: self.w(p + k + ".weight") for k in (
                "attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm",
                "attn_output", "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up",
                "ffn_down", "post_ffw_norm")})
        return self

    def rms(self, x, w):
        x64 = x.astype(np.float64)
        s = 1.0 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + self.eps)
        return (x * s.astype(np.float32)) * w  # the stored weights already hold Gemma's +1

    def rope(self, x, base):  # x [n, heads, hd]; NEOX pairs (i, i + hd/2)
        n, _, hd = x.shape
        half = hd // 2
        inv = base ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
        ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
        c = np.cos(ang).astype(np.float32)[:, None, :]
        s = np.sin(ang).astype(np.float32)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def forward(self, ids):
        n = len(ids)
        x = self.emb[ids] * np.float32(math.sqrt(self.dim))
        pos = np.arange(n)
        causal = pos[None, :] <= pos[:, None]
        local = causal & ((pos[:, None] - pos[None, :]) < self.window)
        group = self.n_heads // self.n_kv
        for l, L in enumerate(self.layers):
            h = self.rms(x, L["attn_norm"])
            q = (h @ L["attn_q"].T).reshape(n, self.n_heads, self.hd)
            k = (h @ L["attn_k"].T).reshape(n, self.n_kv, self.hd)
            v = (h @ L["attn_v"].T).reshape(n, self.n_kv, self.hd)
            q = self.rms(q, L["attn_q_norm"])
            k = self.rms(k, L["attn_k_norm"])
            base = self.base_local if self.sliding[l] else self.base_global
            q = self.rope(q, base) * np.float32(self.q_scale)
            k = self.rope(k, base)
            mask = local if self.sliding[l] else causal
            att = np.empty((n, self.n_heads, self.hd), dtype=np.float32)
            for hh in range(self.n_heads):
                kv = hh // group
                s = q[:, hh, :] @ k[:, kv, :].T
                s = np.where(mask, s, -np.inf)
                s = s - s.max(axis=1, keepdims=True)
                e = np.exp(s)
                att[:, hh, :] = (e / e.sum(axis=1, keepdims=True)) @ v[:, kv, :]
            o = att.reshape(n, -1) @ L["attn_output"].T
            x = x + self.rms(o, L["post_attention_norm"])
            h = self.rms(x, L["ffn_norm"])
            g = h @ L["ffn_gate"].T
            u = h @ L["ffn_up"].T
            g = 0.5 * g * (1.0 + np.tanh(np.float32(math.sqrt(2.0 / math.pi)) * (g + np.float32(0.044715) * g * g * g)))
            d = (g * u) @ L["ffn_down"].T
            x = x + self.rms(d, L["post_ffw_norm"])
        x = self.rms(x, self.out_norm)
        return x @ self.emb.T  # tied output


def spm_processor(r):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    toks = field(r, "tokenizer.ggml.tokens")
    scores = field(r, "tokenizer.ggml.scores")
    types = field(r, "tokenizer.ggml.token_type")
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(toks)
    m.trainer_spec.unk_id = int(field(r, "tokenizer.ggml.unknown_token_id"))
    m.trainer_spec.bos_id = int(field(r, "tokenizer.ggml.bos_token_id"))
    m.trainer_spec.eos_id = int(field(r, "tokenizer.ggml.eos_token_id"))
    m.trainer_spec.pad_id = int(field(r, "tokenizer.ggml.padding_token_id"))
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(field(r, "tokenizer.ggml.add_space_prefix", False))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    P = pb.ModelProto.SentencePiece
    tmap = {1: P.NORMAL, 2: P.UNKNOWN, 3: P.CONTROL, 4: P.USER_DEFINED, 5: P.UNUSED, 6: P.BYTE}
    for i, (t, s, ty) in enumerate(zip(toks, scores, types)):
        p = m.pieces.add()
        # GGUF stores user-defined pieces with raw spaces (matched on the raw text); the
        # SentencePiece model holds them escaped.
        p.piece = t.replace(" ", "\u2581") if ty == 4 else t
        p.score = float(s)
        p.type = P.UNKNOWN if i == m.trainer_spec.unk_id else tmap[int(ty)]
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "tokens":
        r = gguf.GGUFReader(path)
        sp = spm_processor(r)
        print(" ".join(str(i) for i in [int(field(r, "tokenizer.ggml.bos_token_id"))] + sp.encode(sys.argv[3])))
        return
    m = Gemma3(path).load()
    if mode == "logits":
        ids = [int(a) for a in sys.argv[3:]]
        lg = m.forward(ids)
        np.set_printoptions(precision=9, linewidth=200)
        for p in range(len(ids)):
            top = np.argsort(-lg[p])[:5]
            print("pos", p, "argmax", int(top[0]), "top5", [int(t) for t in top],
                  "values", [float("%.6f" % lg[p, t]) for t in top],
                  "logsumexp", float("%.6f" % (np.log(np.exp(lg[p].astype(np.float64) - lg[p].max()).sum()) + lg[p].max())))
        return
    if mode == "ppl":
        sp = spm_processor(m.r)
        bos = int(field(m.r, "tokenizer.ggml.bos_token_id"))
        nll, count = 0.0, 0
        for line in open(sys.argv[3], encoding="utf-8", newline=""):
            line = line.rstrip("\n").rstrip("\r")
            if not line:
                continue
            ids = ([bos] + sp.encode(line))[:512]
            if len(ids) < 2:
                continue
            lg = m.forward(ids[:-1]).astype(np.float64)
            mx = lg.max(axis=1, keepdims=True)
            lse = np.log(np.exp(lg - mx).sum(axis=1)) + mx[:, 0]
            tgt = np.array(ids[1:])
            nll += float((lse - lg[np.arange(len(tgt)), tgt]).sum())
            count += len(tgt)
            print("line tokens", len(ids), "running ppl", math.exp(nll / count), flush=True)
        print("predictions", count, "perplexity %.6f" % math.exp(nll / count))
        return
    raise SystemExit("unknown mode " + mode)


if __name__ == "__main__":
    main()
