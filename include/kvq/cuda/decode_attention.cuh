#pragma once
/// \file decode_attention.cuh
/// Batched decode attention on the GPU straight from packed pages (flash-decoding).
///
/// One query per query head per sequence, out = softmax(logits) V over the tokens the query
/// sees, logits = scale * q.k (default 1/sqrt(D)), optionally soft-capped; causal at the
/// query's position (default the last token), optionally a sliding window, a custom bit mask
/// and per-head attention sinks; q and out f32, f16 or bf16 (DecodeOptions). The math and
/// masking semantics of attention/cpu/ (AttentionOptions, mask.hpp) and
/// reference/attention_ref.hpp, in fp32 with a different summation order: results agree within
/// 1e-3 relative.
///
/// Work split: a CTA of kDecodeWarps warps handles one (sequence, kv head, chunk of <= 8 query
/// heads of its GQA group, split of `split_tokens` tokens); every key/value element it
/// dequantizes serves all those query heads (each page byte is read once per GQA group). The
/// warps take chunks of tokens in turn (decode_tile_kernel below: a few lanes per token, vector
/// loads issued a chunk ahead, one online-softmax update per chunk), keeping an fp32 running
/// max m, sum l and accumulator per query head; the CTA merges its warps and writes (m, l, acc)
/// of its split to the workspace. A merge kernel combines the splits of every (sequence, query
/// head) and normalizes. Lloyd-Max keys are
/// scored against the query rotated once per CTA (q.k = (Rq).(Rk)); Lloyd-Max values are
/// accumulated in the rotated domain and rotated back once in the merge kernel.
///
/// The batched form takes FlashInfer-style page tables: `page_indptr` [batch + 1] into one
/// device array of page pointers, `seq_tokens` [batch]. A sequence of 0 tokens (or whose query
/// sees none) gets a zero output. DecodePlan fixes the split size from the longest sequence
/// once; run() allocates nothing. Splits wholly outside a query's [pos - window + 1, pos] read
/// no page (a windowed layer costs its window, not its length).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kvq/core/softmax.hpp"
#include "kvq/cuda/common.cuh"

namespace kvq {
namespace cuda {

/// Element type of the decode query and output.
enum class IoType : int32_t {
  kF32 = 0,
  kF16 = 1,   ///< __half
  kBF16 = 2,  ///< __nv_bfloat16
};

/// Logit, masking and I/O options of DecodePlan::run, the decode counterparts of
/// AttentionOptions (attention/cpu/problem.hpp, attention/cpu/mask.hpp) with the same semantics.
/// Plain data; the pointers are device pointers (null: off) and are only read by the kernels,
/// so DecodePlan::check cannot validate their contents.
struct DecodeOptions {
  /// Logits are sm_scale * q.k (0 = 1/sqrt(head_dim)). Finite and >= 0.
  float sm_scale = 0.f;
  /// Logit soft-capping: logit = softcap * tanh(logit / softcap) after the scale (0 = off).
  /// Finite and >= 0.
  float softcap = 0.f;
  /// Sliding window (0 = none): the query at position p sees only positions (p - window, p].
  int32_t window = 0;
  /// Device, [batch]: the kv position of sequence b's query (nullptr: seq_tokens[b] - 1). The
  /// query sees positions <= its position (causal). Not checked: a position outside
  /// [0, seq_tokens[b]) applies the same rule to the tokens that exist (the CPU refuses it).
  const int32_t* positions = nullptr;
  /// Device, [batch, mask_words] (optional): sequence b's query sees position t only when bit
  /// t % 64 of mask_bits[b * mask_words + t / 64] is set (combined with causal and window).
  /// mask_words * 64 must cover max_seq_tokens; positions past mask_words * 64 (a sequence
  /// longer than the plan's max_seq_tokens) are not seen.
  const uint64_t* mask_bits = nullptr;
  int32_t mask_words = 0;
  /// Device, [q_heads] (optional): attention-sink logits; each adds exp(sink - max) to its
  /// query head's softmax denominator only (no value). A non-finite sink counts as none (-inf:
  /// as on the CPU; the CPU refuses NaN and +inf, which the device data cannot be checked for).
  const float* sinks = nullptr;
  /// Device, [batch, q_heads] f32 (optional): each row's log-sum-exp over the logits it sees
  /// (after scale, soft-cap and masks; sink included), natural log; -inf when nothing weighs.
  float* lse = nullptr;
  IoType q_type = IoType::kF32;    ///< element type of q
  IoType out_type = IoType::kF32;  ///< element type of out
};

namespace detail {

/// What one sequence's decode query sees and how its scores become logits (DecodeOptions,
/// resolved per sequence): the kernel's per-score rule, host-callable so it is tested without
/// a GPU against AttentionOptions' semantics.
struct ScoreRule {
  float softcap = 0.f;                 ///< 0 = off
  int64_t pos = 0;                     ///< the query's kv position
  int64_t window = 0;                  ///< 0 = none
  const uint64_t* mask_row = nullptr;  ///< the sequence's mask words (null: none)
  int64_t mask_words = 0;

  /// Clips the positions [a, e) to those causal and window allow, (pos - window, pos] (or
  /// [0, pos] without a window); a >= e after when none is left. The kernel clips each split
  /// with it, so a split wholly outside reads no page.
  KVQ_HOST_DEVICE void clip(int64_t& a, int64_t& e) const {
    if (e > pos + 1) e = pos + 1;
    if (window > 0 && a < pos - window + 1) a = pos - window + 1;
    if (a > e) a = e;
  }
  /// The custom mask's verdict for position t >= 0: its bit (positions past the mask's words:
  /// not seen); true without a mask. The kernel asks it per token of the clipped range.
  KVQ_HOST_DEVICE bool mask_allows(int64_t t) const {
    if (mask_row == nullptr) return true;
    return (t >> 6) < mask_words && ((mask_row[t >> 6] >> (t & 63)) & 1u) != 0;
  }
  /// Whether the query sees kv position t >= 0: t <= pos, t > pos - window (window > 0), and
  /// the mask bit set.
  KVQ_HOST_DEVICE bool sees(int64_t t) const {
    int64_t a = t, e = t + 1;
    clip(a, e);
    return a < e && mask_allows(t);
  }
  /// The logit of a scaled score s: softcap * tanh(s / softcap), or s without a cap.
  KVQ_HOST_DEVICE float logit(float s) const { return softcap > 0.f ? softcap * tanhf(s / softcap) : s; }
  /// logit(s) for a position the query sees, -inf (weight 0) otherwise.
  KVQ_HOST_DEVICE float score(int64_t t, float s) const {
    return sees(t) ? logit(s) : -INFINITY;
  }
};

/// Kernel arguments of the options (DecodeOptions less the merge kernel's).
struct DecodeRules {
  float softcap = 0.f;
  int32_t window = 0;
  const int32_t* positions = nullptr;
  const uint64_t* mask_bits = nullptr;
  int32_t mask_words = 0;
  int32_t q_type = 0;  ///< IoType
};

__device__ __forceinline__ float load_io(const void* p, int32_t type, int64_t i) {
  if (type == static_cast<int32_t>(IoType::kF16)) return __half2float(static_cast<const __half*>(p)[i]);
  if (type == static_cast<int32_t>(IoType::kBF16))
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void store_io(void* p, int32_t type, int64_t i, float x) {
  if (type == static_cast<int32_t>(IoType::kF16)) {
    static_cast<__half*>(p)[i] = __float2half_rn(x);
  } else if (type == static_cast<int32_t>(IoType::kBF16)) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  } else {
    static_cast<float*>(p)[i] = x;
  }
}

inline constexpr int kDecodeWarps = 4;
inline constexpr int kMaxGroupPerCta = 8;  ///< query heads per CTA at most (GM of the tiled kernel)

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

/// Block-wide randomized Hadamard of x[0..D) in shared memory (D a power of two): forward
/// x <- scale * H * (sign .* x), inverse x <- sign .* (scale * H * x) (Rotation's R and R^T).
/// All threads of the block must call it.
__device__ inline void block_rotate(float* x, int D, const TensorDesc& X, bool inverse) {
  if (!inverse) {
    for (int i = threadIdx.x; i < D; i += blockDim.x) x[i] *= elem::sign_of(X.sign_mask, i);
  }
  __syncthreads();
  for (int h = 1; h < D; h *= 2) {
    for (int p = threadIdx.x; p < D / 2; p += blockDim.x) {
      const int j = (p / h) * 2 * h + p % h;
      const float a = x[j], b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
    }
    __syncthreads();
  }
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    x[i] *= inverse ? elem::sign_of(X.sign_mask, i) * X.lm_scale : X.lm_scale;
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------
// Tiled decode kernel (the one DecodePlan runs).
//
// A CTA of kDecodeWarps warps handles one (sequence, kv head, chunk of <= GM query heads, split
// of tokens), in tiles of TT tokens. The packed key and value rows of a tile are copied into
// shared memory with asynchronous copies (cp.async, no registers held), double-buffered: tile
// i + 1 is in flight while tile i is computed; the tile's metadata lines are prefetched into
// L1 at the same time. Inside a warp, LPT lanes share a token (lane i of the group owns
// channels [8i, 8i + 8)), so a warp step covers 32 / LPT tokens; a warp scores NS steps of its
// quarter of the tile for its GM query heads (a butterfly over the LPT lanes of a token),
// updates the online softmax once per NS steps (one rescale of the accumulators) and
// accumulates the values. Query heads share every dequantized element (each page byte is read
// once per GQA group).
//
// Formats with a vector path (VecKind, staged in shared memory): f16, bf16, e4m3/e5m2 and
// int2/4/8 whose scale groups either hold whole runs of 8 channels (gc % 8 == 0: one scale per
// lane and token) or are one channel wide (gc == 1: 8 consecutive scales). Everything else
// (f32, nuq, Lloyd-Max, dense-and-sparse outliers, other groups, head_dim % 8 != 0) reads
// element by element from global memory through load_element (kVecGeneric), in the same kernel.
// ---------------------------------------------------------------------------------------------

enum VecKind : int32_t { kVecGeneric = 0, kVecF16, kVecBF16, kVecFp8, kVecInt2, kVecInt4, kVecInt8 };

/// How the tiled kernel reads one tensor of a page (from its TensorDesc, at plan time).
struct VecInfo {
  int32_t kind = kVecGeneric;
  int32_t consecutive_meta = 0;  ///< 1: one scale per channel (gc == 1); 0: one per 8 channels
  int32_t words = 0;             ///< 32-bit words of a lane's 8 codes (0: generic, not staged)
  int32_t row_bytes = 0;         ///< packed bytes of one (token, head) row (staged kinds)
  int32_t copy_bytes = 16;       ///< cp.async size for the row: 16, 8 or 4 (divides row_bytes)
  // The group box of (t, h, d) in 32-bit arithmetic: ((t / gt) * nh + h / gh) * nc + d / gc.
  int32_t gt = 1, gt_shift = 0;  ///< gt_shift = log2(gt) when gt is a power of two, else -1
  int32_t gh = 1, gc = 1, nc = 1, nhnc = 1;
};

inline VecInfo vec_info(const TensorDesc& T, int64_t D) {
  VecInfo v;
  if (D % 8 != 0 || T.outliers > 0) return v;
  const auto f = static_cast<Format>(T.format);
  if (f == Format::kF16 || f == Format::kBF16) {
    v.kind = f == Format::kF16 ? kVecF16 : kVecBF16;
    v.words = 4;
  } else if (f == Format::kE4M3 || f == Format::kE5M2) {
    v.kind = kVecFp8;
    v.words = 2;
  } else if (f == Format::kInt && (T.bits == 2 || T.bits == 4 || T.bits == 8)) {
    v.kind = T.bits == 2 ? kVecInt2 : (T.bits == 4 ? kVecInt4 : kVecInt8);
    v.words = T.bits == 8 ? 2 : 1;
  } else {
    return v;
  }
  const int64_t row = D * (v.kind == kVecF16 || v.kind == kVecBF16 ? 16 : T.bits) / 8;
  if (row % 4 != 0) return VecInfo{};  // (int2 at head_dim 8: below cp.async's 4 bytes)
  v.row_bytes = static_cast<int32_t>(row);
  v.copy_bytes = row % 16 == 0 ? 16 : (row % 8 == 0 ? 8 : 4);
  if (v.kind == kVecF16 || v.kind == kVecBF16) return v;
  if (T.gc % 8 == 0) {
    v.consecutive_meta = 0;
  } else if (T.gc == 1) {
    v.consecutive_meta = 1;
  } else {
    return VecInfo{};
  }
  v.gt = static_cast<int32_t>(T.gt);
  v.gt_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((int64_t{1} << sh) == T.gt) v.gt_shift = sh;
  v.gh = static_cast<int32_t>(T.gh);
  v.gc = static_cast<int32_t>(T.gc);
  v.nc = static_cast<int32_t>(T.nc);
  v.nhnc = static_cast<int32_t>(T.nh * T.nc);
  return v;
}

/// Asynchronous global -> shared copy of n = 16, 8 or 4 bytes (both addresses n-aligned).
__device__ __forceinline__ void copy_async(void* smem, const void* gmem, int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if (n == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
  } else if (n == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(s), "l"(gmem));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(gmem));
  }
#else
  if (n == 16) {
    *static_cast<uint4*>(smem) = *static_cast<const uint4*>(gmem);
  } else if (n == 8) {
    *static_cast<uint2*>(smem) = *static_cast<const uint2*>(gmem);
  } else {
    *static_cast<uint32_t*>(smem) = *static_cast<const uint32_t*>(gmem);
  }
#endif
}
__device__ __forceinline__ void copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
/// Waits until at most one committed group (the newest) is still in flight.
__device__ __forceinline__ void copy_wait_all_but_one() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group 1;\n" ::);
#endif
}
__device__ __forceinline__ void prefetch_l1(const void* p) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p));
}

__device__ __forceinline__ float meta_at(const uint8_t* base, bool f16, int i) {
  return f16 ? __half2float(__ldg(reinterpret_cast<const __half*>(base) + i))
             : __ldg(reinterpret_cast<const float*>(base) + i);
}

/// 8 consecutive metadata slots from i (i % 8 == 0: 16- or 32-byte aligned).
__device__ __forceinline__ void meta8(const uint8_t* base, bool f16, int i, float (&m)[8]) {
  if (f16) {
    const uint4 u = __ldg(reinterpret_cast<const uint4*>(base + 2 * i));
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[j]));
      m[2 * j] = f.x;
      m[2 * j + 1] = f.y;
    }
  } else {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(base + 4 * i));
    const uint4 b = __ldg(reinterpret_cast<const uint4*>(base + 4 * i + 16));
    m[0] = __uint_as_float(a.x);
    m[1] = __uint_as_float(a.y);
    m[2] = __uint_as_float(a.z);
    m[3] = __uint_as_float(a.w);
    m[4] = __uint_as_float(b.x);
    m[5] = __uint_as_float(b.y);
    m[6] = __uint_as_float(b.z);
    m[7] = __uint_as_float(b.w);
  }
}

/// Global address of the first metadata slot of (page-local token tp, head h) for a staged
/// scaled kind (the lines the stage prefetches).
__device__ __forceinline__ const uint8_t* meta_row(const VecInfo& vi, const TensorDesc& T,
                                                   const uint8_t* page, int tp, int h) {
  const int box = ((vi.gt_shift >= 0 ? tp >> vi.gt_shift : tp / vi.gt) * vi.nhnc) +
                  (h / vi.gh) * vi.nc;
  return page + T.scales + box * (T.f16meta ? 2 : 4);
}

/// load_element over channels [d0, d0 + 8) (0 at and past D). Out of line: inlined into every
/// unrolled step of the tiled kernel, load_element's switch over all formats and its outlier
/// scan would multiply the kernel's code size (ptxas time and instruction cache).
__device__ __noinline__ void generic_decode8(const TensorDesc& T, const uint8_t* page, int tp,
                                             int h, int H, int D, int d0, float* x) {
  for (int j = 0; j < 8; ++j) {
    const int d = d0 + j;
    x[j] = d < D ? load_element(T, page, H, D, tp, h, d) : 0.f;
  }
}

/// Dequantizes lane channels [d0, d0 + 8) of page-local token tp, head h (the values of
/// load_element: same formulas, same roundings). Staged kinds read the lane's codes from the
/// shared-memory copy of the row (`row`) and their scales from global memory (prefetched);
/// generic kinds read through load_element (channels >= D give 0). mb: the lane's part of the
/// box index, (h / gh) * nc + d0 / gc.
__device__ __forceinline__ void vec_decode(const VecInfo& vi, const TensorDesc& T,
                                           const uint8_t* row, const uint8_t* page, int tp,
                                           int h, int H, int D, int d0, int mb, float (&x)[8]) {
  if (vi.kind == kVecGeneric) {
    generic_decode8(T, page, tp, h, H, D, d0, x);
    return;
  }
  uint32_t raw[4];
  if (vi.words == 4) {
    const uint4 u = *reinterpret_cast<const uint4*>(row + 2 * d0);
    raw[0] = u.x;
    raw[1] = u.y;
    raw[2] = u.z;
    raw[3] = u.w;
  } else if (vi.words == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + d0);
    raw[0] = u.x;
    raw[1] = u.y;
    raw[2] = raw[3] = 0u;
  } else {
    raw[0] = vi.kind == kVecInt4 ? *reinterpret_cast<const uint32_t*>(row + d0 / 2)
                                 : *reinterpret_cast<const unsigned short*>(row + d0 / 4);
    raw[1] = raw[2] = raw[3] = 0u;
  }
  if (vi.kind == kVecF16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw[j]));
      x[2 * j] = f.x;
      x[2 * j + 1] = f.y;
    }
    return;
  }
  if (vi.kind == kVecBF16) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      x[2 * j] = __uint_as_float(raw[j] << 16);
      x[2 * j + 1] = __uint_as_float(raw[j] & 0xffff0000u);
    }
    return;
  }
  // Scaled formats: the group box of channel d0 (and, for one-channel groups, the next 7).
  const int box = (vi.gt_shift >= 0 ? tp >> vi.gt_shift : tp / vi.gt) * vi.nhnc + mb;
  const bool f16 = T.f16meta != 0;
  float s[8], z[8];
  if (vi.consecutive_meta) {
    meta8(page + T.scales, f16, box, s);
    if (T.has_zeros) {
      meta8(page + T.zeros, f16, box, z);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) z[j] = 0.f;
    }
  } else {
    const float s0 = meta_at(page + T.scales, f16, box);
    const float z0 = T.has_zeros ? meta_at(page + T.zeros, f16, box) : 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j] = s0;
      z[j] = z0;
    }
  }
  if (vi.kind == kVecFp8) {
    const __nv_fp8_interpretation_t fi = T.e5m2 ? __NV_E5M2 : __NV_E4M3;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const auto pair = static_cast<__nv_fp8x2_storage_t>((raw[j / 2] >> (16 * (j % 2))) & 0xffffu);
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2(pair, fi);
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&hr));
      // decode(code) * scale, one rounding (elem::fp8_decode_scaled)
      x[2 * j] = __fmul_rn(f.x, s[2 * j]);
      x[2 * j + 1] = __fmul_rn(f.y, s[2 * j + 1]);
    }
    return;
  }
  // int: fma(code - off, scale, zero) (uniform_decode); code - off exactly, as
  // float(2^23 + code) - (2^23 + off).
  const float bias = 8388608.0f + T.off;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    uint32_t c;
    if (vi.kind == kVecInt4) {
      c = (raw[0] >> (4 * j)) & 0xfu;
    } else if (vi.kind == kVecInt2) {
      c = (raw[0] >> (2 * j)) & 0x3u;
    } else {
      c = (raw[j / 4] >> (8 * (j % 4))) & 0xffu;
    }
    x[j] = fmaf(__fsub_rn(__uint_as_float(0x4b000000u | c), bias), s[j], z[j]);
  }
}

/// The tiled split kernel. grid = (splits, kv_heads * group_chunks, batch), block =
/// kDecodeWarps * 32, dynamic shared memory 2 * TT * (k row + v row bytes of staged kinds).
/// LPT: lanes per token (a power of two, 8 * LPT >= head_dim); GM: query heads per CTA (>= this
/// launch's per-CTA group). TT: tokens per tile, a multiple of kDecodeWarps * kDecodeNs * 32 /
/// LPT. Writes the split's (m, l, acc) as decode_merge_kernel reads them. The split's tokens
/// are clipped to the query's causal window [pos - window + 1, pos] first (a split wholly
/// outside reads no page and writes an empty partial: m = -inf, l = 0); inside, each token goes
/// through ScoreRule (causal, window, mask bits, soft-cap).
inline constexpr int kDecodeNs = 4;  ///< warp steps per online-softmax update

template <int LPT, int GM>
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_tile_kernel(const __grid_constant__ PagedDesc L, VecInfo kvi, VecInfo vvi, int TT,
                       const void* q, const std::byte* const* pages, const int32_t* page_indptr,
                       const int32_t* seq_tokens, int q_heads, int group, int gm_per_cta,
                       int split_tokens, int splits, int p_shift, float sm_scale,
                       DecodeRules rules, float* part_acc, float* part_ml) {
  constexpr int TPW = 32 / LPT;  // tokens per warp step
  constexpr int NS = kDecodeNs;
  extern __shared__ __align__(16) uint8_t tile_s[];
  __shared__ float q_s[GM][8 * LPT];  // this CTA's queries (rotated for Lloyd-Max keys)
  __shared__ float m_s[kDecodeWarps][GM];
  __shared__ float l_s[kDecodeWarps][GM];
  __shared__ float acc_s[kDecodeWarps][8 * LPT];

  const int D = static_cast<int>(L.D);
  const int H = static_cast<int>(L.H);
  const int P = static_cast<int>(L.P);
  const int s = blockIdx.x;
  const int chunks = (group + gm_per_cta - 1) / gm_per_cta;
  const int hk = blockIdx.y / chunks;
  const int g0 = (blockIdx.y % chunks) * gm_per_cta;
  const int G = min(gm_per_cta, group - g0);
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int sub = lane % LPT;   // lane within its token group
  const int slot = lane / LPT;  // token group within the warp step
  const int d0 = sub * 8;
  const int T = seq_tokens[b];
  ScoreRule rule;
  rule.softcap = rules.softcap;
  rule.pos = rules.positions != nullptr ? rules.positions[b] : T - 1;
  rule.window = rules.window;
  rule.mask_words = rules.mask_words;
  if (rules.mask_bits != nullptr)
    rule.mask_row = rules.mask_bits + static_cast<int64_t>(b) * rules.mask_words;
  // This split's tokens, clipped to what causal and window allow (64-bit: positions are
  // unchecked); inside, only the mask is asked per token.
  int64_t a = static_cast<int64_t>(s) * split_tokens;
  int64_t e = (s == splits - 1 || a + split_tokens > T) ? T : a + split_tokens;
  rule.clip(a, e);
  const int t_begin = static_cast<int>(a), t_end = static_cast<int>(e);
  if (t_begin >= t_end) {  // nothing to see here: an empty partial, no page read
    for (int g = threadIdx.x; g < G; g += blockDim.x) {
      const int64_t base = (static_cast<int64_t>(b) * q_heads + hk * group + g0 + g) * splits + s;
      part_ml[base * 2] = -INFINITY;
      part_ml[base * 2 + 1] = 0.f;
    }
    return;
  }
  const std::byte* const* seq_pages = pages + page_indptr[b];
  const int kmb = (hk / kvi.gh) * kvi.nc + d0 / kvi.gc;
  const int vmb = (hk / vvi.gh) * vvi.nc + d0 / vvi.gc;
  const int krow = kvi.row_bytes, vrow = vvi.row_bytes;  // 0 for generic (not staged)
  const int stage_bytes = TT * (krow + vrow);

  for (int g = 0; g < GM; ++g) {
    const int hq = hk * group + g0 + g;
    for (int d = threadIdx.x; d < 8 * LPT; d += blockDim.x)
      q_s[g][d] = (g < G && d < D)
                      ? load_io(q, rules.q_type, (static_cast<int64_t>(b) * q_heads + hq) * D + d)
                      : 0.f;
  }
  __syncthreads();
  if (L.k.is_lm()) {
    for (int g = 0; g < G; ++g) block_rotate(q_s[g], D, L.k, false);
  }
  float qr[GM][8];
#pragma unroll
  for (int g = 0; g < GM; ++g)
#pragma unroll
    for (int j = 0; j < 8; ++j) qr[g][j] = q_s[g][d0 + j] * sm_scale;

  float m[GM], l[GM], acc[GM][8];
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
  }

  auto page_of = [&](int t, int* tp) {
    const int pi = p_shift >= 0 ? t >> p_shift : t / P;
    *tp = t - pi * P;
    return reinterpret_cast<const uint8_t*>(seq_pages[pi]);
  };
  // Issues the copies of tile `tile` (tokens t0 .. t0 + TT) into buffer `buf` (one commit
  // group; empty when the tile is past the split) and prefetches its metadata lines.
  auto stage = [&](int tile, int buf) {
    const int t0 = t_begin + tile * TT;
    if (stage_bytes > 0 && t0 < t_end) {
      uint8_t* kb = tile_s + buf * stage_bytes;
      uint8_t* vb = kb + TT * krow;
      const int n = min(TT, t_end - t0);
      if (krow > 0) {
        const int per = krow / kvi.copy_bytes;
        for (int i = threadIdx.x; i < n * per; i += blockDim.x) {
          const int tt = i / per, c = (i - tt * per) * kvi.copy_bytes;
          int tp;
          const uint8_t* pg = page_of(t0 + tt, &tp);
          copy_async(kb + tt * krow + c, pg + L.k.codes + (tp * H + hk) * krow + c, kvi.copy_bytes);
        }
      }
      if (vrow > 0) {
        const int per = vrow / vvi.copy_bytes;
        for (int i = threadIdx.x; i < n * per; i += blockDim.x) {
          const int tt = i / per, c = (i - tt * per) * vvi.copy_bytes;
          int tp;
          const uint8_t* pg = page_of(t0 + tt, &tp);
          copy_async(vb + tt * vrow + c, pg + L.v.codes + (tp * H + hk) * vrow + c, vvi.copy_bytes);
        }
      }
      // Metadata: the first line of each token's scales (and zeros) for this head; one-channel
      // groups span D slots: every line of them.
      for (int tt = threadIdx.x; tt < n; tt += blockDim.x) {
        int tp;
        const uint8_t* pg = page_of(t0 + tt, &tp);
        for (int w = 0; w < 2; ++w) {
          const VecInfo& vi = w == 0 ? kvi : vvi;
          const TensorDesc& X = w == 0 ? L.k : L.v;
          if (vi.row_bytes == 0 || vi.kind == kVecF16 || vi.kind == kVecBF16) continue;
          const uint8_t* ms = meta_row(vi, X, pg, tp, hk);
          const int span = vi.consecutive_meta ? D * (X.f16meta ? 2 : 4) : 1;
          for (int o = 0; o < span; o += 128) {
            prefetch_l1(ms + o);
            if (X.has_zeros) prefetch_l1(ms + (X.zeros - X.scales) + o);
          }
        }
      }
    }
    copy_commit();
  };

  const int tiles = t_end > t_begin ? (t_end - t_begin + TT - 1) / TT : 0;
  stage(0, 0);
  for (int tile = 0; tile < tiles; ++tile) {
    stage(tile + 1, (tile + 1) & 1);
    copy_wait_all_but_one();
    __syncthreads();
    const uint8_t* kb = tile_s + (tile & 1) * stage_bytes;
    const uint8_t* vb = kb + TT * krow;
    const int t0 = t_begin + tile * TT;
    // This warp's quarter of the tile, NS steps (NS * TPW tokens) per softmax update.
    const int per_warp = TT / kDecodeWarps;
    for (int c = 0; c < per_warp; c += NS * TPW) {
      const int tt0 = warp * per_warp + c;
      if (t0 + tt0 >= t_end) break;
      float sc[NS][GM];
      float cmax[GM];
#pragma unroll
      for (int g = 0; g < GM; ++g) cmax[g] = -INFINITY;
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        const int tt = tt0 + i * TPW + slot;
        const bool valid = t0 + tt < t_end && rule.mask_allows(t0 + tt);
        float kx[8];
        if (valid && d0 < D) {
          int tp;
          const uint8_t* pg = page_of(t0 + tt, &tp);
          vec_decode(kvi, L.k, kb + tt * krow, pg, tp, hk, H, D, d0, kmb, kx);
        } else {
#pragma unroll
          for (int j = 0; j < 8; ++j) kx[j] = 0.f;
        }
#pragma unroll
        for (int g = 0; g < GM; ++g) {
          float part = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) part = fmaf(qr[g][j], kx[j], part);
#pragma unroll
          for (int o = LPT / 2; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
          sc[i][g] = valid ? rule.logit(part) : -INFINITY;
          cmax[g] = fmaxf(cmax[g], sc[i][g]);
        }
      }
      // Online softmax, once per NS steps: the max over the warp's token groups.
#pragma unroll
      for (int g = 0; g < GM; ++g) {
#pragma unroll
        for (int o = 16; o >= LPT; o >>= 1)
          cmax[g] = fmaxf(cmax[g], __shfl_xor_sync(0xffffffffu, cmax[g], o));
        const float mn = fmaxf(m[g], cmax[g]);
        if (mn == -INFINITY) {  // nothing seen yet (masked): exp(-inf - -inf) would be NaN
#pragma unroll
          for (int i = 0; i < NS; ++i) sc[i][g] = 0.f;
          continue;
        }
        const float corr = __expf(m[g] - mn);  // 0 on the first update (m = -inf)
        m[g] = mn;
        l[g] *= corr;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] *= corr;
#pragma unroll
        for (int i = 0; i < NS; ++i) {
          sc[i][g] = __expf(sc[i][g] - mn);  // 0 for tokens past the split or not seen
          l[g] += sc[i][g];
        }
      }
#pragma unroll
      for (int i = 0; i < NS; ++i) {
        const int tt = tt0 + i * TPW + slot;
        if (t0 + tt >= t_end || d0 >= D || !rule.mask_allows(t0 + tt)) continue;
        int tp;
        const uint8_t* pg = page_of(t0 + tt, &tp);
        float vx[8];
        vec_decode(vvi, L.v, vb + tt * vrow, pg, tp, hk, H, D, d0, vmb, vx);
#pragma unroll
        for (int g = 0; g < GM; ++g)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[g][j] = fmaf(sc[i][g], vx[j], acc[g][j]);
      }
    }
    __syncthreads();  // the buffer is refilled by the next iteration's stage
  }

  // Sum the warp's token groups (m is uniform across the warp), then merge the warps and
  // write this split's partials, one query head at a time.
#pragma unroll
  for (int g = 0; g < GM; ++g) {
#pragma unroll
    for (int o = 16; o >= LPT; o >>= 1) {
      l[g] += __shfl_xor_sync(0xffffffffu, l[g], o);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
    }
  }
#pragma unroll
  for (int g = 0; g < GM; ++g) {
    if (g >= G) break;
    if (lane == 0) {
      m_s[warp][g] = m[g];
      l_s[warp][g] = l[g];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < kDecodeWarps; ++w) M = fmaxf(M, m_s[w][g]);
    // A warp that saw no token of the split has m = -inf and l = 0: weight 0.
    const auto fast_exp = [](float x) { return __expf(x); };
    const float f = SoftmaxState<float>{m[g], l[g]}.weight(M, fast_exp);
    if (slot == 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) acc_s[warp][d0 + j] = acc[g][j] * f;
    }
    __syncthreads();
    const int hq = hk * group + g0 + g;
    const int64_t base = (static_cast<int64_t>(b) * q_heads + hq) * splits + s;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
      float a = 0.f;
      for (int w = 0; w < kDecodeWarps; ++w) a += acc_s[w][d];
      part_acc[base * D + d] = a;
    }
    if (threadIdx.x == 0) {
      float Lsum = 0.f;
      for (int w = 0; w < kDecodeWarps; ++w) {
        const SoftmaxState<float> st{m_s[w][g], l_s[w][g]};
        if (st.l > 0.f) Lsum += st.l * st.weight(M, fast_exp);
      }
      part_ml[base * 2] = M;
      part_ml[base * 2 + 1] = Lsum;
    }
    __syncthreads();
  }
}

/// Merge kernel. grid = (q_heads, batch), block = 128. out: [batch, q_heads, D] of out_type;
/// sinks ([q_heads], optional) join the denominator as on the CPU (attention/cpu/merge.hpp): the
/// common maximum M includes the sink, and a row that sees no token but has a sink is zeros
/// with lse = sink.
__global__ void decode_merge_kernel(PagedDesc L, int q_heads, int splits, const float* part_acc,
                                    const float* part_ml, const float* sinks, void* out,
                                    int32_t out_type, float* lse) {
  __shared__ float x[kMaxHeadDim];
  __shared__ float scale_s;
  const int D = static_cast<int>(L.D);
  const int64_t row = static_cast<int64_t>(blockIdx.y) * q_heads + blockIdx.x;
  const float* ml = part_ml + row * splits * 2;
  // Each split's partial (m, l) is a SoftmaxState; the common maximum M is the largest m of
  // the non-empty ones and each contributes with its weight() (the CPU merge does the same).
  const auto split_state = [ml](int s) { return SoftmaxState<float>{ml[2 * s], ml[2 * s + 1]}; };
  const auto exact_exp = [](float x) { return expf(x); };
  const float sink = sinks != nullptr ? sinks[blockIdx.x] : -INFINITY;
  const bool has_sink = isfinite(sink);
  float M = has_sink ? sink : -INFINITY;
  for (int s = 0; s < splits; ++s)
    if (split_state(s).l > 0.f) M = fmaxf(M, split_state(s).m);
  if (threadIdx.x == 0) {
    float Lsum = 0.f;
    for (int s = 0; s < splits; ++s) {
      const SoftmaxState<float> st = split_state(s);
      if (st.l > 0.f) Lsum += st.l * st.weight(M, exact_exp);
    }
    if (has_sink) Lsum += expf(sink - M);  // denominator only: no value
    scale_s = Lsum > 0.f ? 1.0f / Lsum : 0.f;
    if (lse != nullptr) lse[row] = Lsum > 0.f ? M + logf(Lsum) : -INFINITY;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < splits; ++s) {
      const SoftmaxState<float> st = split_state(s);
      if (st.l > 0.f) a += part_acc[(row * splits + s) * D + d] * st.weight(M, exact_exp);
    }
    x[d] = a * scale_s;
  }
  __syncthreads();
  if (L.v.is_lm()) block_rotate(x, D, L.v, true);
  for (int d = threadIdx.x; d < D; d += blockDim.x) store_io(out, out_type, row * D + d, x[d]);
}

}  // namespace detail

/// Decode attention planned once for a layout, a batch shape and the longest sequence.
class DecodePlan {
 public:
  /// batch sequences, q_heads query heads (a multiple of the layout's kv_heads), sequences of
  /// at most max_seq_tokens tokens (longer ones are still correct: their last split is
  /// longer). split_tokens = 0 picks the split so that about 4 x `sm_count` CTAs run (sm_count
  /// 0: ask the current device, 132 without one). Throws kUnsupported for layouts the GPU
  /// cannot read (make_paged_desc) and head_dim > 256, kInvalidArgument for bad shapes.
  DecodePlan(const PageLayout& layout, int64_t batch, int64_t q_heads, int64_t max_seq_tokens,
             int64_t split_tokens = 0, int sm_count = 0)
      : L_(make_paged_desc(layout)), batch_(batch), q_heads_(q_heads), max_tokens_(max_seq_tokens) {
    KVQ_REQUIRE(L_.D <= kMaxHeadDim, kUnsupported, "cuda::DecodePlan: head_dim ", L_.D,
                " exceeds the kernel's ", kMaxHeadDim);
    KVQ_REQUIRE(batch >= 1 && batch <= 65535, kInvalidArgument,
                "cuda::DecodePlan: batch must be in [1, 65535], got ", batch);
    KVQ_REQUIRE(q_heads >= 1 && q_heads % L_.H == 0, kInvalidArgument, "cuda::DecodePlan: ",
                q_heads, " query heads are not a positive multiple of ", L_.H, " kv heads");
    KVQ_REQUIRE(max_seq_tokens >= 1 && max_seq_tokens <= (int64_t{1} << 30), kInvalidArgument,
                "cuda::DecodePlan: max_seq_tokens must be in [1, 2^30], got ", max_seq_tokens);
    KVQ_REQUIRE(split_tokens >= 0, kInvalidArgument, "cuda::DecodePlan: negative split_tokens");
    group_ = q_heads / L_.H;
    const int64_t chunks = (group_ + detail::kMaxGroupPerCta - 1) / detail::kMaxGroupPerCta;
    if (split_tokens == 0) {
      if (sm_count <= 0) {
        int dev = 0;
        if (visible_devices() > 0 && cudaGetDevice(&dev) == cudaSuccess)
          cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, dev);
        if (sm_count <= 0) sm_count = 132;
      }
      const int64_t ctas = batch * L_.H * chunks;
      int64_t want = (4 * static_cast<int64_t>(sm_count) + ctas - 1) / ctas;
      const int64_t most = (max_seq_tokens + 255) / 256;  // keep >= 256 tokens per split
      want = want < 1 ? 1 : (want > most ? most : want);
      split_tokens = (max_seq_tokens + want - 1) / want;
      split_tokens = (split_tokens + 63) / 64 * 64;
    }
    split_ = split_tokens;
    splits_ = (max_seq_tokens + split_ - 1) / split_;
    KVQ_REQUIRE(splits_ <= 65535 && L_.H * chunks <= 65535, kInvalidArgument,
                "cuda::DecodePlan: grid too large (", splits_, " splits)");
  }

  const PagedDesc& desc() const { return L_; }
  int64_t splits() const { return splits_; }
  int64_t split_tokens() const { return split_; }

  /// Device workspace bytes: per (sequence, query head, split) D accumulators + (max, sum).
  std::size_t workspace_bytes() const {
    return static_cast<std::size_t>(batch_ * q_heads_ * splits_ * (L_.D + 2)) * sizeof(float);
  }

  /// Throws kInvalidArgument, naming the field, for options run() cannot take: a scale or
  /// soft-cap that is not finite and >= 0, a negative window, mask_bits without mask_words >= 1
  /// (or mask_words without mask_bits), mask words that do not cover max_seq_tokens, an unknown
  /// IoType. Host only, no device call (the device arrays' contents are not read).
  void check(const DecodeOptions& opt) const {
    KVQ_REQUIRE(std::isfinite(opt.sm_scale) && opt.sm_scale >= 0.f, kInvalidArgument,
                "cuda::DecodePlan::run: sm_scale must be finite and >= 0 (0 = 1/sqrt(head_dim)), "
                "got ", opt.sm_scale);
    KVQ_REQUIRE(std::isfinite(opt.softcap) && opt.softcap >= 0.f, kInvalidArgument,
                "cuda::DecodePlan::run: softcap must be finite and >= 0 (0 = off), got ",
                opt.softcap);
    KVQ_REQUIRE(opt.window >= 0, kInvalidArgument,
                "cuda::DecodePlan::run: window must be >= 0 (0 = none), got ", opt.window);
    if (opt.mask_bits != nullptr) {
      KVQ_REQUIRE(opt.mask_words >= 1, kInvalidArgument,
                  "cuda::DecodePlan::run: mask_bits is set but mask_words=", opt.mask_words,
                  " (must be >= 1)");
      KVQ_REQUIRE(int64_t{opt.mask_words} * 64 >= max_tokens_, kInvalidArgument,
                  "cuda::DecodePlan::run: mask_words=", opt.mask_words, " covers ",
                  int64_t{opt.mask_words} * 64, " positions, but the plan's max_seq_tokens is ",
                  max_tokens_, " (needs >= ", (max_tokens_ + 63) / 64, ")");
    } else {
      KVQ_REQUIRE(opt.mask_words == 0, kInvalidArgument, "cuda::DecodePlan::run: mask_words=",
                  opt.mask_words, " is set but mask_bits is null");
    }
    const auto known = [](IoType t) {
      return t == IoType::kF32 || t == IoType::kF16 || t == IoType::kBF16;
    };
    KVQ_REQUIRE(known(opt.q_type), kInvalidArgument, "cuda::DecodePlan::run: q_type ",
                static_cast<int>(opt.q_type), " is not an IoType");
    KVQ_REQUIRE(known(opt.out_type), kInvalidArgument, "cuda::DecodePlan::run: out_type ",
                static_cast<int>(opt.out_type), " is not an IoType");
  }

  /// q: [batch, q_heads, head_dim] of opt.q_type (device); pages: device array of device page
  /// pointers, sequence b's pages at [page_indptr[b], page_indptr[b + 1]); seq_tokens[b] tokens
  /// each (every page full but the last); out: [batch, q_heads, head_dim] of opt.out_type.
  /// Logits, masks, sinks and lse as DecodeOptions describes (check() first). opt.lse lets a
  /// caller merge this output exactly with attention over rows kept elsewhere (f32 sinks, the
  /// residual window): out = sum_i exp(lse_i - lse) out_i. A sequence whose query sees no token
  /// (0 tokens, or masks excluding all) gives zeros and lse -inf, or lse = its sink logit
  /// (attend_batch on the CPU does the same). Asynchronous on `stream`, no allocation.
  void run(void* workspace, const void* q, const std::byte* const* pages,
           const int32_t* page_indptr, const int32_t* seq_tokens, void* out,
           const DecodeOptions& opt, cudaStream_t stream = nullptr) const {
    KVQ_REQUIRE(workspace != nullptr && q != nullptr && pages != nullptr &&
                    page_indptr != nullptr && seq_tokens != nullptr && out != nullptr,
                kInvalidArgument, "cuda::DecodePlan::run: null device pointer");
    check(opt);
    const float sm_scale = opt.sm_scale > 0.f
                               ? opt.sm_scale
                               : static_cast<float>(1.0 / std::sqrt(static_cast<double>(L_.D)));
    detail::DecodeRules rules;
    rules.softcap = opt.softcap;
    rules.window = opt.window;
    rules.positions = opt.positions;
    rules.mask_bits = opt.mask_bits;
    rules.mask_words = opt.mask_words;
    rules.q_type = static_cast<int32_t>(opt.q_type);
    float* part_acc = static_cast<float*>(workspace);
    float* part_ml = part_acc + batch_ * q_heads_ * splits_ * L_.D;
    const int gm = group_ <= 4 ? static_cast<int>(group_) : detail::kMaxGroupPerCta;
    const int chunks = static_cast<int>((group_ + gm - 1) / gm);
    const dim3 grid(static_cast<unsigned>(splits_), static_cast<unsigned>(L_.H * chunks),
                    static_cast<unsigned>(batch_));
    const detail::VecInfo kvi = detail::vec_info(L_.k, L_.D), vvi = detail::vec_info(L_.v, L_.D);
    int p_shift = -1;
    for (int sh = 0; sh < 31; ++sh)
      if ((int64_t{1} << sh) == L_.P) p_shift = sh;
    const int lpt = L_.D <= 32 ? 4 : (L_.D <= 64 ? 8 : (L_.D <= 128 ? 16 : 32));
    // Tile: ~16 KiB of staged rows per buffer, a whole number of NS-step rounds of every warp.
    const int unit = detail::kDecodeWarps * detail::kDecodeNs * (32 / lpt);
    const int row = kvi.row_bytes + vvi.row_bytes;
    int tt = unit;
    while (row > 0 && tt * 2 * row <= 16384 && tt < 256) tt *= 2;
    if (row == 0) tt = 4 * unit;
    const std::size_t smem = static_cast<std::size_t>(2 * tt * row);
    auto launch = [&](auto kernel) {
      if (smem > 48 * 1024)
        detail::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(smem)),
                           "kvq::cuda::decode_tile_kernel (shared memory)");
      kernel<<<grid, detail::kDecodeWarps * 32, smem, stream>>>(
          L_, kvi, vvi, tt, q, pages, page_indptr, seq_tokens, static_cast<int>(q_heads_),
          static_cast<int>(group_), gm, static_cast<int>(split_), static_cast<int>(splits_),
          p_shift, sm_scale, rules, part_acc, part_ml);
    };
    auto by_shape = [&](auto lpt_tag) {
      constexpr int LPT = decltype(lpt_tag)::value;
      if (gm > 4) {
        launch(detail::decode_tile_kernel<LPT, 8>);
      } else {
        launch(detail::decode_tile_kernel<LPT, 4>);
      }
    };
    switch (lpt) {
      case 4: by_shape(std::integral_constant<int, 4>{}); break;
      case 8: by_shape(std::integral_constant<int, 8>{}); break;
      case 16: by_shape(std::integral_constant<int, 16>{}); break;
      default: by_shape(std::integral_constant<int, 32>{}); break;
    }
    detail::check_launch("kvq::cuda::decode_tile_kernel");
    detail::decode_merge_kernel<<<dim3(static_cast<unsigned>(q_heads_), static_cast<unsigned>(batch_)),
                                  128, 0, stream>>>(L_, static_cast<int>(q_heads_),
                                                    static_cast<int>(splits_), part_acc, part_ml,
                                                    opt.sinks, out,
                                                    static_cast<int32_t>(opt.out_type), opt.lse);
    detail::check_launch("kvq::cuda::decode_merge_kernel");
  }

  /// The f32 form (no masks): run(..., DecodeOptions{sm_scale, lse}). sm_scale <= 0 means
  /// 1/sqrt(head_dim); lse optional ([batch, q_heads] f32, device).
  void run(void* workspace, const float* q, const std::byte* const* pages,
           const int32_t* page_indptr, const int32_t* seq_tokens, float* out,
           cudaStream_t stream = nullptr, float sm_scale = 0.f, float* lse = nullptr) const {
    DecodeOptions opt;
    opt.sm_scale = sm_scale > 0.f ? sm_scale : 0.f;
    opt.lse = lse;
    run(workspace, static_cast<const void*>(q), pages, page_indptr, seq_tokens,
        static_cast<void*>(out), opt, stream);
  }

 private:
  PagedDesc L_;
  int64_t batch_, q_heads_, max_tokens_, group_ = 1, split_ = 0, splits_ = 1;
};

}  // namespace cuda
}  // namespace kvq
