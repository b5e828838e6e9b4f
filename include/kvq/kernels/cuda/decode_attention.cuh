#pragma once
/// \file decode_attention.cuh
/// Batched decode attention on the GPU straight from packed pages (flash-decoding).
///
/// One query per query head per sequence, out = softmax(q K^T / sqrt(D)) V over every token of
/// the sequence (the math of kernels/cpu/attention_cpu.hpp and reference/attention_ref.hpp,
/// in fp32 with a different summation order: results agree within 1e-3 relative).
///
/// Work split: a CTA of kWarps warps handles one (sequence, kv head, chunk of <= 8 query heads
/// of its GQA group, split of `split_tokens` tokens); every key/value element it dequantizes
/// serves all those query heads (each page byte is read once per GQA group). Each warp walks
/// tokens w, w + kWarps, ... of the split, lanes across head_dim (coordinate e * 32 + lane),
/// keeping an fp32 online softmax (running max m, sum l, accumulator) per query head; the CTA
/// merges its warps and writes (m, l, acc) of its split to the workspace. A merge kernel
/// combines the splits of every (sequence, query head) and normalizes. Lloyd-Max keys are
/// scored against the query rotated once per CTA (q.k = (Rq).(Rk)); Lloyd-Max values are
/// accumulated in the rotated domain and rotated back once in the merge kernel.
///
/// The batched form takes FlashInfer-style page tables: `page_indptr` [batch + 1] into one
/// device array of page pointers, `seq_tokens` [batch]. A sequence of 0 tokens gets a zero
/// output. DecodePlan fixes the split size from the longest sequence once; run() allocates
/// nothing.
#include <cmath>

#include "kvq/kernels/cuda/common.cuh"

namespace kvq {
namespace cuda {
namespace detail {

inline constexpr int kDecodeWarps = 4;
inline constexpr int kMaxGroupPerCta = 8;

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

/// Split kernel. grid = (splits, kv_heads * group_chunks, batch), block = kDecodeWarps * 32.
/// part_acc: [batch, q_heads, splits, D]; part_ml: [batch, q_heads, splits, 2].
__global__ void __launch_bounds__(kDecodeWarps * 32)
    decode_split_kernel(PagedDesc L, const float* q, const std::byte* const* pages,
                        const int32_t* page_indptr, const int32_t* seq_tokens, int q_heads,
                        int group, int split_tokens, int splits, float sm_scale, float* part_acc,
                        float* part_ml) {
  constexpr int kE = kMaxHeadDim / 32;
  __shared__ float q_s[kMaxGroupPerCta][kMaxHeadDim];
  __shared__ float m_s[kDecodeWarps][kMaxGroupPerCta];
  __shared__ float l_s[kDecodeWarps][kMaxGroupPerCta];
  __shared__ float acc_s[kDecodeWarps][kMaxHeadDim];

  const int D = static_cast<int>(L.D);
  const int H = static_cast<int>(L.H);
  const int s = blockIdx.x;
  const int chunks = (group + kMaxGroupPerCta - 1) / kMaxGroupPerCta;
  const int hk = blockIdx.y / chunks;
  const int g0 = (blockIdx.y % chunks) * kMaxGroupPerCta;
  const int G = min(kMaxGroupPerCta, group - g0);
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t T = seq_tokens[b];
  const int64_t t_begin = static_cast<int64_t>(s) * split_tokens;
  const int64_t t_end = (s == splits - 1) ? T : min(T, t_begin + split_tokens);
  const std::byte* const* seq_pages = pages + page_indptr[b];

  // Queries of this CTA's heads (rotated for Lloyd-Max keys).
  for (int g = 0; g < G; ++g) {
    const int hq = hk * group + g0 + g;
    for (int d = threadIdx.x; d < D; d += blockDim.x)
      q_s[g][d] = q[(static_cast<int64_t>(b) * q_heads + hq) * D + d];
  }
  __syncthreads();
  if (L.k.is_lm()) {
    for (int g = 0; g < G; ++g) block_rotate(q_s[g], D, L.k, false);
  }

  float m[kMaxGroupPerCta], l[kMaxGroupPerCta], acc[kMaxGroupPerCta][kE];
#pragma unroll
  for (int g = 0; g < kMaxGroupPerCta; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[g][e] = 0.f;
  }
  for (int64_t t = t_begin + warp; t < t_end; t += kDecodeWarps) {
    const auto* page = reinterpret_cast<const uint8_t*>(seq_pages[t / L.P]);
    const int64_t tp = t % L.P;
    float kv[kE], vv[kE];
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int d = e * 32 + lane;
      kv[e] = d < D ? load_element(L.k, page, H, D, tp, hk, d) : 0.f;
      vv[e] = d < D ? load_element(L.v, page, H, D, tp, hk, d) : 0.f;
    }
#pragma unroll
    for (int g = 0; g < kMaxGroupPerCta; ++g) {
      if (g < G) {
        float part = 0.f;
#pragma unroll
        for (int e = 0; e < kE; ++e) {
          const int d = e * 32 + lane;
          if (d < D) part = fmaf(q_s[g][d], kv[e], part);
        }
        const float score = warp_sum(part) * sm_scale;
        const float mn = fmaxf(m[g], score);
        const float corr = expf(m[g] - mn);  // 0 on the first token (m = -inf)
        const float p = expf(score - mn);
        l[g] = l[g] * corr + p;
#pragma unroll
        for (int e = 0; e < kE; ++e) acc[g][e] = acc[g][e] * corr + p * vv[e];
        m[g] = mn;
      }
    }
  }

  // Merge the warps of the CTA, one query head at a time, and write this split's partials
  // (unrolled over the fixed bound so m, l and acc stay in registers; G is uniform per CTA).
#pragma unroll
  for (int g = 0; g < kMaxGroupPerCta; ++g) {
    if (g >= G) break;
    if (lane == 0) {
      m_s[warp][g] = m[g];
      l_s[warp][g] = l[g];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < kDecodeWarps; ++w) M = fmaxf(M, m_s[w][g]);
    float f = (m[g] == -INFINITY) ? 0.f : expf(m[g] - M);
#pragma unroll
    for (int e = 0; e < kE; ++e) {
      const int d = e * 32 + lane;
      if (d < D) acc_s[warp][d] = acc[g][e] * f;
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
      for (int w = 0; w < kDecodeWarps; ++w)
        if (m_s[w][g] != -INFINITY) Lsum += l_s[w][g] * expf(m_s[w][g] - M);
      part_ml[base * 2] = M;
      part_ml[base * 2 + 1] = Lsum;
    }
    __syncthreads();
  }
}

/// Merge kernel. grid = (q_heads, batch), block = 128. out: [batch, q_heads, D] f32.
__global__ void decode_merge_kernel(PagedDesc L, int q_heads, int splits, const float* part_acc,
                                    const float* part_ml, float* out) {
  __shared__ float x[kMaxHeadDim];
  __shared__ float scale_s;
  const int D = static_cast<int>(L.D);
  const int64_t row = static_cast<int64_t>(blockIdx.y) * q_heads + blockIdx.x;
  const float* ml = part_ml + row * splits * 2;
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s)
    if (ml[2 * s + 1] > 0.f) M = fmaxf(M, ml[2 * s]);
  if (threadIdx.x == 0) {
    float Lsum = 0.f;
    for (int s = 0; s < splits; ++s)
      if (ml[2 * s + 1] > 0.f) Lsum += ml[2 * s + 1] * expf(ml[2 * s] - M);
    scale_s = Lsum > 0.f ? 1.0f / Lsum : 0.f;
  }
  __syncthreads();
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < splits; ++s)
      if (ml[2 * s + 1] > 0.f) a += part_acc[(row * splits + s) * D + d] * expf(ml[2 * s] - M);
    x[d] = a * scale_s;
  }
  __syncthreads();
  if (L.v.is_lm()) block_rotate(x, D, L.v, true);
  for (int d = threadIdx.x; d < D; d += blockDim.x) out[row * D + d] = x[d];
}

}  // namespace detail

/// Decode attention planned once for a layout, a batch shape and the longest sequence.
class DecodePlan {
 public:
  /// batch sequences, q_heads query heads (a multiple of the layout's kv_heads), sequences of
  /// at most max_seq_tokens tokens (longer ones are still correct: their last split is
  /// longer). split_tokens = 0 picks the split so that about 2 x `sm_count` CTAs run (sm_count
  /// 0: ask the current device, 132 without one). Throws kUnsupported for layouts the GPU
  /// cannot read (make_paged_desc) and head_dim > 256, kInvalidArgument for bad shapes.
  DecodePlan(const PageLayout& layout, int64_t batch, int64_t q_heads, int64_t max_seq_tokens,
             int64_t split_tokens = 0, int sm_count = 0)
      : L_(make_paged_desc(layout)), batch_(batch), q_heads_(q_heads) {
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
      int64_t want = (2 * static_cast<int64_t>(sm_count) + ctas - 1) / ctas;
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

  /// q: [batch, q_heads, head_dim] f32 (device); pages: device array of device page pointers,
  /// sequence b's pages at [page_indptr[b], page_indptr[b + 1]); seq_tokens[b] tokens each
  /// (every page full but the last); out: [batch, q_heads, head_dim] f32. sm_scale <= 0 means
  /// 1/sqrt(head_dim). Asynchronous on `stream`, no allocation.
  void run(void* workspace, const float* q, const std::byte* const* pages,
           const int32_t* page_indptr, const int32_t* seq_tokens, float* out,
           cudaStream_t stream = nullptr, float sm_scale = 0.f) const {
    KVQ_REQUIRE(workspace != nullptr && q != nullptr && pages != nullptr &&
                    page_indptr != nullptr && seq_tokens != nullptr && out != nullptr,
                kInvalidArgument, "cuda::DecodePlan::run: null device pointer");
    if (!(sm_scale > 0.f)) sm_scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(L_.D)));
    float* part_acc = static_cast<float*>(workspace);
    float* part_ml = part_acc + batch_ * q_heads_ * splits_ * L_.D;
    const int chunks = static_cast<int>((group_ + detail::kMaxGroupPerCta - 1) / detail::kMaxGroupPerCta);
    const dim3 grid(static_cast<unsigned>(splits_), static_cast<unsigned>(L_.H * chunks),
                    static_cast<unsigned>(batch_));
    detail::decode_split_kernel<<<grid, detail::kDecodeWarps * 32, 0, stream>>>(
        L_, q, pages, page_indptr, seq_tokens, static_cast<int>(q_heads_),
        static_cast<int>(group_), static_cast<int>(split_), static_cast<int>(splits_), sm_scale,
        part_acc, part_ml);
    detail::check_launch("kvq::cuda::decode_split_kernel");
    detail::decode_merge_kernel<<<dim3(static_cast<unsigned>(q_heads_), static_cast<unsigned>(batch_)),
                                  128, 0, stream>>>(L_, static_cast<int>(q_heads_),
                                                    static_cast<int>(splits_), part_acc, part_ml, out);
    detail::check_launch("kvq::cuda::decode_merge_kernel");
  }

 private:
  PagedDesc L_;
  int64_t batch_, q_heads_, group_ = 1, split_ = 0, splits_ = 1;
};

}  // namespace cuda
}  // namespace kvq
