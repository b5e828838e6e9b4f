#pragma once
/// \file outliers.hpp
/// Outlier isolation (KVQuant's dense-and-sparse split): which k entries of every
/// (token, head) vector are kept exactly, and what the dense quantizer sees in their place.
///
/// Selection. Every entry is scored by its distance from its group's centre in units of the
/// group's spread, after the normalization the axis uses:
///   score = |x - mean_g| * (1 / sd_g)        (0 when sd_g == 0)
/// where g is the entry's group box (quant axis + group size: per channel, the G tokens of one
/// channel; per token, G channels of one vector; per head / tensor, the whole box), mean_g and
/// sd_g its mean and population standard deviation (two passes, double, in [token, head,
/// channel] order: four partial sums per box, channel d feeding partial d % 4, combined as
/// (p0 + p1) + (p2 + p3); the squares accumulate with an explicit fma, so no compiler
/// contraction setting changes a bit). The score is rounded to float. Each vector keeps exactly
/// its k highest scores; ties, including all-equal vectors, go to the lower channel index (the
/// order (score descending, channel ascending) is total, so the chosen set is unique).
/// Positions are stored ascending.
///
/// Dense part. The dense ranges are computed without the outliers: every selected entry is
/// replaced by its value clamped to [min, max] of the non-selected entries of its group box (the
/// group mean when a box has no non-selected entry), so the dense quantizer's min/max (int,
/// nuq) and absmax (fp8) are exactly those of the remaining entries. (min, max) are the first
/// minimal / maximal entries in channel order (std::min / std::max), which fixes the sign of a
/// zero bound.
///
/// Token-axis boxes lie inside one vector, so the token axis is isolated row by row
/// (isolate_row: an AVX2 path when KVQ_HAS_AVX2, the group is a multiple of 8 channels and
/// head_dim <= 512, a portable scalar path otherwise, identical results; for k <= 4 the AVX2
/// path selects with a float filter of proven error bounds and computes exact scores only near
/// ties, see row_select_avx2); quant/outlier_quant.hpp fuses it with the dense quantizer, through
/// isolate_rows_lean where the group is 32, 64 or 128 and k <= 4 (float statistics whose error
/// the filter's threshold bounds, see lean_filter_threshold; the same selection and ranges).
/// reference/outlier_ref.hpp is the scalar oracle.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kvq/config.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/geometry/grouping.hpp"

namespace kvq {

/// Scratch of isolate_outliers / isolate_row (only grows).
struct OutlierScratch {
  std::vector<double> mean, sd;   // [boxes]
  std::vector<double> part;       // [boxes, 4] partial sums
  std::vector<float> lo, hi;      // [boxes]
  std::vector<float> fmean, fisd; // float mean and 1 / sd (row paths)
  std::vector<float> score;       // [head_dim]
  std::vector<int32_t> idx;       // [head_dim]
  std::vector<uint8_t> mark;      // [head_dim]
  std::vector<float> dense;       // [head_dim] (isolate_rows_lean's rare exact path)
};

namespace detail {
template <class V>
typename V::value_type* grow(V& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

/// The k best channels of score[0..D) in (score descending, channel ascending) order, written
/// to out[0..k) ascending. idx: [D] scratch (k > 8 only).
inline void select_top_k(const float* score, int64_t D, int64_t k, int32_t* out, int32_t* idx) {
  if (k <= 8) {  // one pass keeping the k best in (score desc, channel asc) order
    int64_t n = 0;
    for (int32_t d = 0; d < static_cast<int32_t>(D); ++d) {
      const float sd_ = score[d];
      if (n == k && !(sd_ > score[out[k - 1]])) continue;  // ties: the earlier channel stays
      int64_t j = n < k ? n++ : k - 1;
      while (j > 0 && sd_ > score[out[j - 1]]) {
        out[j] = out[j - 1];
        --j;
      }
      out[j] = d;
    }
  } else {
    std::iota(idx, idx + D, 0);
    std::nth_element(idx, idx + (k - 1), idx + D, [&](int32_t a, int32_t b) {
      return score[a] > score[b] || (score[a] == score[b] && a < b);
    });
    std::copy(idx, idx + k, out);
  }
  std::sort(out, out + k);
}

/// Replacement of a selected entry: clamped to the box's non-selected range [lo, hi], or the
/// box mean when the box has no non-selected entry (lo > hi). Written as std::min/std::max.
inline float dense_value(float v, float lo, float hi, double mean) {
  return lo <= hi ? std::min(std::max(v, lo), hi) : static_cast<float>(mean);
}

/// Portable scalar isolate_row (see there).
inline bool isolate_row_scalar(const float* r, int64_t D, int64_t gc, int64_t k, float* dense,
                               int32_t* sel, float* vals, float* lo, float* hi,
                               OutlierScratch& sc) {
  for (int64_t d = 0; d < D; ++d)
    if (!std::isfinite(r[d])) return false;
  const int64_t nc = D / gc;
  double* mean = grow(sc.mean, static_cast<std::size_t>(nc));
  double* isd = grow(sc.sd, static_cast<std::size_t>(nc));
  float* score = grow(sc.score, static_cast<std::size_t>(D));
  int32_t* idx = grow(sc.idx, static_cast<std::size_t>(D));
  const double inv_n = 1.0 / static_cast<double>(gc);
  for (int64_t b = 0; b < nc; ++b) {
    double p[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t d = b * gc; d < (b + 1) * gc; ++d) p[d & 3] += static_cast<double>(r[d]);
    mean[b] = ((p[0] + p[1]) + (p[2] + p[3])) * inv_n;
    double q[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t d = b * gc; d < (b + 1) * gc; ++d) {
      const double dv = static_cast<double>(r[d]) - mean[b];
      q[d & 3] = std::fma(dv, dv, q[d & 3]);
    }
    const double v = std::sqrt(((q[0] + q[1]) + (q[2] + q[3])) * inv_n);
    isd[b] = v > 0.0 ? 1.0 / v : 0.0;
    for (int64_t d = b * gc; d < (b + 1) * gc; ++d)
      score[d] = static_cast<float>(std::fabs(static_cast<double>(r[d]) - mean[b]) * isd[b]);
  }
  if (k > 0) select_top_k(score, D, k, sel, idx);
  for (int64_t j = 0; j < k; ++j) vals[j] = r[sel[j]];
  if (dense != r) std::memcpy(dense, r, static_cast<std::size_t>(D) * sizeof(float));
  for (int64_t b = 0, j = 0; b < nc; ++b) {
    float l = std::numeric_limits<float>::infinity(), h = -l;
    for (int64_t d = b * gc; d < (b + 1) * gc; ++d) {
      if (j < k && sel[j] == d) {
        ++j;
        continue;
      }
      l = std::min(l, dense[d]);
      h = std::max(h, dense[d]);
    }
    lo[b] = l;
    hi[b] = h;
  }
  for (int64_t j = 0; j < k; ++j) {
    const int64_t b = sel[j] / gc;
    dense[sel[j]] = dense_value(vals[j], lo[b], hi[b], mean[b]);
  }
  for (int64_t b = 0; b < nc; ++b)
    if (!(lo[b] <= hi[b])) lo[b] = hi[b] = static_cast<float>(mean[b]);
  return true;
}

/// Rows the fused token-axis quantizer has in flight, and the most isolate_rows_lean_rt takes
/// at a time (AVX2).
inline constexpr int kLeanRows = 4;

#if KVQ_HAS_AVX2
/// Largest k the AVX2 row path selects (one vectorized argmax per outlier beyond 4).
inline constexpr int64_t kRowTopKAvx2 = 16;
/// Largest head_dim of the AVX2 row path, in 64-channel words of selection bits.
inline constexpr int64_t kRowMaskWords = 8;

inline __m256 hmax8(__m256 m) {
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
}
inline __m256 hmin8(__m256 m) {
  m = _mm256_min_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm256_min_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
}

/// Inserts the 8 scores v into each lane's descending top-K list.
template <int K>
inline void top_k_insert(__m256* top, __m256 v) {
  for (int t = 0; t < K; ++t) {
    const __m256 hi_ = _mm256_max_ps(top[t], v);
    v = _mm256_min_ps(top[t], v);
    top[t] = hi_;
  }
}

/// Per group j of four: (p0 + p1) + (p2 + p3) of s[j]'s lanes, as lane j of the result.
inline __m256d combine4x4(const __m256d* s) {
  const __m256d t01 = _mm256_hadd_pd(s[0], s[1]);  // [a01, b01, a23, b23]
  const __m256d t23 = _mm256_hadd_pd(s[2], s[3]);  // [c01, d01, c23, d23]
  return _mm256_add_pd(_mm256_permute2f128_pd(t01, t23, 0x20),
                       _mm256_permute2f128_pd(t01, t23, 0x31));
}
inline __m256d lane_pd(__m256d v, int j) {
  switch (j) {
    case 0: return _mm256_permute4x64_pd(v, 0x00);
    case 1: return _mm256_permute4x64_pd(v, 0x55);
    case 2: return _mm256_permute4x64_pd(v, 0xaa);
    default: return _mm256_permute4x64_pd(v, 0xff);
  }
}

inline __m256d hmax4d(__m256d v) {
  v = _mm256_max_pd(v, _mm256_permute2f128_pd(v, v, 1));
  return _mm256_max_pd(v, _mm256_permute_pd(v, 5));
}

/// Bit d % 64 of m[d / 64].
inline bool marked(const uint64_t* m, int64_t d) { return (m[d >> 6] >> (d & 63)) & 1; }

/// The k marked channels of m[0..(D + 63) / 64) (exactly k bits set), ascending, into sel:
/// a fixed k steps, each taking the lowest bit of the first non-empty word without a branch.
__attribute__((always_inline)) inline void marked_channels(const uint64_t* m, int64_t D,
                                                          int64_t k, int32_t* sel) {
  uint64_t w[kRowMaskWords];
  const int64_t nw = (D + 63) / 64;
  for (int64_t i = 0; i < kRowMaskWords; ++i) w[i] = i < nw ? m[i] : 0;
  for (int64_t j = 0; j < k; ++j) {
    int64_t pos = 0;
    bool found = false;
    for (int64_t i = 0; i < nw; ++i) {
      const bool here = !found && w[i] != 0;
      pos = here ? 64 * i + static_cast<int64_t>(__builtin_ctzll(w[i] | (uint64_t{1} << 63))) : pos;
      found = found || here;
    }
    sel[j] = static_cast<int32_t>(pos);
    w[pos >> 6] &= w[pos >> 6] - 1;
  }
}

/// The tail of the row paths, given the selection as channels (sel, ascending) and as bits (m):
/// vals, dense = r with the non-selected range of every group computed on the way (selected
/// lanes masked out), the zero-sign rule, then the replacement of the selected entries.
inline void finish_row_avx2(const float* r, int64_t D, int64_t gc, int64_t k, const uint64_t* m,
                            const int32_t* sel, const double* mean, float* dense, float* vals,
                            float* lo, float* hi) {
  const int64_t nc = D / gc;
  for (int64_t j = 0; j < k; ++j) vals[j] = r[sel[j]];
  const __m256 inf8 = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 ninf8 = _mm256_sub_ps(_mm256_setzero_ps(), inf8);
#if !KVQ_HAS_AVX512
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
#endif
  for (int64_t b = 0; b < nc; ++b) {
    __m256 l8 = inf8, h8 = ninf8;
    int64_t d = b * gc;
#if KVQ_HAS_AVX512
    if (gc % 16 == 0) {  // 16 lanes, the selected ones masked out
      __m512 l16 = _mm512_set1_ps(std::numeric_limits<float>::infinity());
      __m512 h16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (; d < (b + 1) * gc; d += 16) {
        const __m512 v = _mm512_loadu_ps(r + d);
        if (dense != r) _mm512_storeu_ps(dense + d, v);
        const auto keep = static_cast<__mmask16>(~(m[d >> 6] >> (d & 63)));
        l16 = _mm512_mask_min_ps(l16, keep, v, l16);
        h16 = _mm512_mask_max_ps(h16, keep, v, h16);
      }
      l8 = _mm256_min_ps(_mm512_castps512_ps256(l16), _mm512_extractf32x8_ps(l16, 1));
      h8 = _mm256_max_ps(_mm512_castps512_ps256(h16), _mm512_extractf32x8_ps(h16, 1));
    }
#endif
    for (; d < (b + 1) * gc; d += 8) {
      const __m256 v = _mm256_loadu_ps(r + d);
      if (dense != r) _mm256_storeu_ps(dense + d, v);
      const auto bits = static_cast<unsigned>(m[d >> 6] >> (d & 63)) & 0xffu;
#if KVQ_HAS_AVX512
      const auto keep = static_cast<__mmask8>(~bits);
      l8 = _mm256_mask_min_ps(l8, keep, v, l8);
      h8 = _mm256_mask_max_ps(h8, keep, v, h8);
#else
      const __m256 sel8 = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
          _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits)), lane_bit), lane_bit));
      l8 = _mm256_min_ps(l8, _mm256_blendv_ps(v, inf8, sel8));
      h8 = _mm256_max_ps(h8, _mm256_blendv_ps(v, ninf8, sel8));
#endif
    }
    float l = _mm256_cvtss_f32(hmin8(l8)), h = _mm256_cvtss_f32(hmax8(h8));
    // A zero bound takes the sign of the first zero in channel order (what std::min/max keep).
    if (l == 0.f)
      for (int64_t e = b * gc; e < (b + 1) * gc; ++e)
        if (!marked(m, e) && r[e] == 0.f) {
          l = r[e];
          break;
        }
    if (h == 0.f)
      for (int64_t e = b * gc; e < (b + 1) * gc; ++e)
        if (!marked(m, e) && r[e] == 0.f) {
          h = r[e];
          break;
        }
    lo[b] = l;
    hi[b] = h;
  }
  // Box of a channel by multiply-shift (exact for channels below 2^16).
  const uint64_t magic = (uint64_t{1} << 32) / static_cast<uint64_t>(gc) + 1;
  for (int64_t j = 0; j < k; ++j) {
    const auto b = static_cast<int64_t>((static_cast<uint64_t>(sel[j]) * magic) >> 32);
    dense[sel[j]] = dense_value(vals[j], lo[b], hi[b], mean[b]);
  }
  for (int64_t b = 0; b < nc; ++b)
    if (!(lo[b] <= hi[b])) lo[b] = hi[b] = static_cast<float>(mean[b]);
}

/// T', the k-th largest entry (with multiplicity) of the lanes' descending top-K lists: k
/// fixed steps, each taking the largest entry and removing one instance of it (the lowest lane
/// holding it shifts its list up).
template <int K>
inline float kth_of_lists(__m256* top, int64_t k) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256 t8 = hmax8(top[0]);
  for (int64_t j = 1; j < k; ++j) {
    const auto eq =
        static_cast<unsigned>(_mm256_movemask_ps(_mm256_cmp_ps(top[0], t8, _CMP_EQ_OQ)));
    const __m256 one = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
        _mm256_and_si256(_mm256_set1_epi32(static_cast<int>(eq & (0u - eq))), lane_bit), lane_bit));
    for (int t = 0; t + 1 < K; ++t) top[t] = _mm256_blendv_ps(top[t], top[t + 1], one);
    top[K - 1] = _mm256_blendv_ps(top[K - 1], _mm256_set1_ps(-2.f), one);
    t8 = hmax8(top[0]);
  }
  return _mm256_cvtss_f32(t8);
}

/// The largest float <= theta (theta not NaN): theta rounded to nearest, stepped one float down
/// when that rounded up (std::nextafter towards -inf, without the library call).
inline float float_at_most(double theta) {
  auto th = static_cast<float>(theta);
  if (static_cast<double>(th) > theta) {
    uint32_t b;
    std::memcpy(&b, &th, 4);
    b = th > 0.f ? b - 1 : th < 0.f ? b + 1 : 0x80000001u;  // +-0 -> -denorm_min
    std::memcpy(&th, &b, 4);
  }
  return th;
}

/// The float filter's threshold (row_select_avx2): theta = (T' - E)(1 - 2^-16) - E with
/// E = 2^-23 max(emax, 1), rounded down to float so no channel at or above theta is missed.
inline float filter_threshold(float tk, double emax) {
  const double E = 0x1p-23 * std::max(emax, 1.0);
  const double theta = (static_cast<double>(tk) - E) * (1.0 - 0x1p-16) - E;
  return float_at_most(theta);
}

/// Marks in m[0..(D + 63) / 64) the channels with score >= th; returns how many. The scores
/// were stored 8 lanes wide, the width they are loaded at here (the loads take their data from
/// the store queue).
inline int64_t mark_at_least(const float* score, int64_t D, float th, uint64_t* m) {
  const __m256 th8 = _mm256_set1_ps(th);
  int64_t cnt = 0;
  for (int64_t w = 0; w < (D + 63) / 64; ++w) {
    uint64_t g = 0;
    for (int64_t i = 0; i < std::min<int64_t>(64, D - 64 * w); i += 8)
      g |= static_cast<uint64_t>(static_cast<unsigned>(_mm256_movemask_ps(
               _mm256_cmp_ps(_mm256_loadu_ps(score + 64 * w + i), th8, _CMP_GE_OQ))))
           << i;
    m[w] = g;
    cnt += __builtin_popcountll(g);
  }
  return cnt;
}

/// The selection bits m (exactly k set) of the float filter that row_select_avx2 describes:
/// score[0..D) the float scores s', tk their k-th largest T', emax the largest |mean| / sd of
/// the boxes involved, guard set when some 1 / sd is outside [1e-30, 1e30] (0 excepted).
/// The channels with s' >= theta when there are exactly k of them; otherwise the k best exact
/// scores exact(d) in (score descending, channel ascending) order among them, or among every
/// channel when guard is set or fewer than k passed (the bounds exclude it; this keeps the
/// result whole anyway).
template <int K, class Exact>
inline void filter_select(const float* score, int64_t D, int64_t k, float tk, double emax,
                          bool guard, uint64_t* m, Exact&& exact) {
  const int64_t cnt = mark_at_least(score, D, filter_threshold(tk, emax), m);
  if (cnt == k && !guard) return;
  const bool every = guard || cnt < k;
  int32_t best[K];
  float bs[K];
  int64_t n = 0;
  for (int64_t d = 0; d < D; ++d) {
    if (!every && !marked(m, d)) continue;
    const float sd_ = exact(d);
    if (n == k && !(sd_ > bs[k - 1])) continue;  // ties: the earlier channel stays
    int64_t j = n < k ? n++ : k - 1;
    while (j > 0 && sd_ > bs[j - 1]) {
      bs[j] = bs[j - 1];
      best[j] = best[j - 1];
      --j;
    }
    bs[j] = sd_;
    best[j] = static_cast<int32_t>(d);
  }
  std::fill(m, m + (D + 63) / 64, uint64_t{0});
  for (int64_t j = 0; j < k; ++j) m[best[j] >> 6] |= uint64_t{1} << (best[j] & 63);
}

/// For four boxes (means m4, 1 / sd i4): their float roundings into fm[0..4), fi[0..4) (the
/// float filter's mean and 1 / sd), and the filter's running bounds (filter_select): emax, the
/// largest |mean| / sd, and guard, set where a 1 / sd lies outside [1e-30, 1e30] (0 excepted).
inline void filter_stats4(__m256d m4, __m256d i4, float* fm, float* fi, __m256d& emax,
                          __m256d& guard) {
  const __m256d zero_d = _mm256_setzero_pd();
  _mm_storeu_ps(fm, _mm256_cvtpd_ps(m4));
  _mm_storeu_ps(fi, _mm256_cvtpd_ps(i4));
  emax = _mm256_max_pd(emax, _mm256_mul_pd(_mm256_andnot_pd(_mm256_set1_pd(-0.0), m4), i4));
  guard = _mm256_or_pd(
      guard, _mm256_and_pd(_mm256_cmp_pd(i4, zero_d, _CMP_NEQ_OQ),
                           _mm256_or_pd(_mm256_cmp_pd(i4, _mm256_set1_pd(1e-30), _CMP_LT_OQ),
                                        _mm256_cmp_pd(i4, _mm256_set1_pd(1e30), _CMP_GT_OQ))));
}

/// The statistics of one row for the AVX2 row paths (arrays of nc + 3 entries): the box mean
/// and 1 / sd of the definition (double sums four lanes wide, lane j holding partial j, i.e.
/// channels d = j mod 4, so the sums are the scalar path's; four groups side by side, their
/// sqrt and reciprocal in one vector), their float roundings, and for the float filter the
/// largest |mean| / sd and whether some 1 / sd lies outside [1e-30, 1e30] (0 excepted).
struct RowStats {
  double* mean;
  double* isd;
  float* fmean;
  float* fisd;
  double emax = 0.0;
  bool guard = false;
};

/// Fills st for row r[0..D) (gc % 8 == 0); false when r holds NaN or inf.
inline bool row_stats_avx2(const float* r, int64_t D, int64_t gc, RowStats& st) {
  const int64_t nc = D / gc;
  const __m256d inv_n = _mm256_set1_pd(1.0 / static_cast<double>(gc));
  const __m256d sign_d = _mm256_set1_pd(-0.0), zero_d = _mm256_setzero_pd();
  __m256d emax = zero_d, guard = zero_d;
  for (int64_t b0 = 0; b0 < nc; b0 += 4) {
    const float* rb[4];  // groups past the end repeat the last one (results unused)
    for (int j = 0; j < 4; ++j) rb[j] = r + std::min<int64_t>(b0 + j, nc - 1) * gc;
    __m256d s[4] = {zero_d, zero_d, zero_d, zero_d};
    for (int64_t i = 0; i < gc; i += 4)
      for (int j = 0; j < 4; ++j) s[j] = _mm256_add_pd(s[j], _mm256_cvtps_pd(_mm_loadu_ps(rb[j] + i)));
    const __m256d m4 = _mm256_mul_pd(combine4x4(s), inv_n);
    // A NaN or inf element makes its group's sum (hence mean) non-finite, and only then.
    const __m256d fin = _mm256_cmp_pd(_mm256_andnot_pd(sign_d, m4),
                                      _mm256_set1_pd(std::numeric_limits<double>::infinity()),
                                      _CMP_LT_OQ);
    if (_mm256_movemask_pd(fin) != 0xf) return false;
    __m256d mj[4], q[4] = {zero_d, zero_d, zero_d, zero_d};
    for (int j = 0; j < 4; ++j) mj[j] = lane_pd(m4, j);
    for (int64_t i = 0; i < gc; i += 4)
      for (int j = 0; j < 4; ++j) {
        const __m256d dv = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(rb[j] + i)), mj[j]);
        q[j] = _mm256_fmadd_pd(dv, dv, q[j]);
      }
    const __m256d sd4 = _mm256_sqrt_pd(_mm256_mul_pd(combine4x4(q), inv_n));
    const __m256d isd4 = _mm256_and_pd(_mm256_cmp_pd(sd4, zero_d, _CMP_GT_OQ),
                                       _mm256_div_pd(_mm256_set1_pd(1.0), sd4));
    _mm256_storeu_pd(st.mean + b0, m4);
    _mm256_storeu_pd(st.isd + b0, isd4);
    filter_stats4(m4, isd4, st.fmean + b0, st.fisd + b0, emax, guard);
  }
  st.emax = _mm256_cvtsd_f64(hmax4d(emax));  // lanes past nc repeat the last group
  st.guard = _mm256_movemask_pd(guard) != 0;
  return true;
}

/// RowStats over the scratch arrays.
inline RowStats row_stats_scratch(OutlierScratch& sc, int64_t nc) {
  const auto n = static_cast<std::size_t>(nc + 3);
  return RowStats{grow(sc.mean, n), grow(sc.sd, n), grow(sc.fmean, n), grow(sc.fisd, n)};
}

/// The selection of AVX2 isolate_row for k = K <= 4, given the row's statistics (row_stats_avx2),
/// and the outputs (finish_row_avx2). score: [D] scratch.
///
/// A float filter, then the exact scores only where it cannot decide. Every channel gets the
/// float score s' = |x - float(mean)| * float(1 / sd), 3 float operations per 8 channels
/// instead of the exact score's double conversion, subtraction, product and rounding. With
/// u = 2^-24, s' and the exact score s of any channel satisfy
/// s (1 - 5u) - E <= s' <= s (1 + 5u) + E, E = 2u max(max_g |mean_g| / sd_g, 1) (the float
/// mean, reciprocal, difference and product each round once; the exact path rounds in double
/// and once to float). Each lane keeps its K largest s' in registers (a max/min insertion
/// network); T', the k-th largest s' (with multiplicity), is taken off those lists in k fixed
/// steps. Then the exact k-th largest score T >= (T' - E) / (1 + 5u), so every channel with
/// s >= T has s' >= theta = (T' - E)(1 - 2^-16) - E: the channels with s' >= theta hold the
/// exact selection. When there are exactly k of them they are the selection (the common case,
/// no exact score computed); otherwise (near ties, constant groups) their exact scores are
/// computed and the k best taken in (score descending, channel ascending) order. A group whose
/// 1 / sd is outside [1e-30, 1e30] (float cannot hold it, or x - mean could overflow) scores the
/// whole row exactly. The selection is therefore the exact definition's, bit for bit.
template <int K>
inline void row_select_avx2(const float* r, int64_t D, int64_t gc, int64_t k, const RowStats& st,
                            float* score, float* dense, int32_t* sel, float* vals, float* lo,
                            float* hi) {
  const int64_t nc = D / gc;
  __m256 top[K];  // per lane, its K largest s' (descending); -1 = none yet
  for (auto& t : top) t = _mm256_set1_ps(-1.f);
  const __m256 sign_f = _mm256_set1_ps(-0.f);
  for (int64_t b = 0; b < nc; ++b) {
    const __m256 mf = _mm256_broadcast_ss(st.fmean + b), fi = _mm256_broadcast_ss(st.fisd + b);
    for (int64_t d = b * gc; d < (b + 1) * gc; d += 8) {
      const __m256 a = _mm256_sub_ps(_mm256_loadu_ps(r + d), mf);
      const __m256 s8 = _mm256_mul_ps(_mm256_andnot_ps(sign_f, a), fi);
      _mm256_storeu_ps(score + d, s8);
      top_k_insert<K>(top, s8);
    }
  }
  uint64_t m[kRowMaskWords];
  filter_select<K>(score, D, k, kth_of_lists<K>(top, k), st.emax, st.guard, m, [&](int64_t d) {
    const int64_t b = d / gc;
    return static_cast<float>(std::fabs(static_cast<double>(r[d]) - st.mean[b]) * st.isd[b]);
  });
  marked_channels(m, D, k, sel);
  finish_row_avx2(r, D, gc, k, m, sel, st.mean, dense, vals, lo, hi);
}

/// AVX2 isolate_row: gc % 8 == 0, 1 <= k <= kRowTopKAvx2, D <= 64 * kRowMaskWords:
/// row_stats_avx2, then for k <= 4 row_select_avx2; for k > 4 exact scores and k vectorized
/// argmax passes (lowest channel among equal scores), then finish_row_avx2.
inline bool isolate_row_avx2(const float* r, int64_t D, int64_t gc, int64_t k, float* dense,
                             int32_t* sel, float* vals, float* lo, float* hi,
                             OutlierScratch& sc) {
  const int64_t nc = D / gc;
  RowStats st = row_stats_scratch(sc, nc);
  if (!row_stats_avx2(r, D, gc, st)) return false;
  float* score = grow(sc.score, static_cast<std::size_t>(D));
  switch (k) {
    case 1: row_select_avx2<1>(r, D, gc, k, st, score, dense, sel, vals, lo, hi); return true;
    case 2: row_select_avx2<2>(r, D, gc, k, st, score, dense, sel, vals, lo, hi); return true;
    case 3: row_select_avx2<3>(r, D, gc, k, st, score, dense, sel, vals, lo, hi); return true;
    case 4: row_select_avx2<4>(r, D, gc, k, st, score, dense, sel, vals, lo, hi); return true;
    default: break;
  }
  const __m256d sign_d = _mm256_set1_pd(-0.0);
  for (int64_t b = 0; b < nc; ++b) {
    const __m256d mb = _mm256_set1_pd(st.mean[b]), ib = _mm256_set1_pd(st.isd[b]);
    for (int64_t d = b * gc; d < (b + 1) * gc; d += 8) {
      const __m256d d0 = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(r + d)), mb);
      const __m256d d1 = _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(r + d + 4)), mb);
      _mm256_storeu_ps(score + d, _mm256_set_m128(
          _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_andnot_pd(sign_d, d1), ib)),
          _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_andnot_pd(sign_d, d0), ib))));
    }
  }
  uint64_t m[kRowMaskWords] = {};
  // Top k: scores are finite and >= 0, so a taken channel is marked -1.
  for (int64_t j = 0; j < k; ++j) {
    __m256 a = _mm256_loadu_ps(score), c = a;
    int64_t d = 8;
    for (; d + 8 <= D; d += 16) {
      a = _mm256_max_ps(a, _mm256_loadu_ps(score + d));
      if (d + 16 <= D) c = _mm256_max_ps(c, _mm256_loadu_ps(score + d + 8));
    }
    const __m256 mx = hmax8(_mm256_max_ps(a, c));
    int32_t at = 0;
    for (d = 0; d < D; d += 8) {
      const int mk = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(score + d), mx, _CMP_EQ_OQ));
      if (mk != 0) {
        at = static_cast<int32_t>(d) + __builtin_ctz(static_cast<unsigned>(mk));
        break;
      }
    }
    score[at] = -1.f;
    m[at >> 6] |= uint64_t{1} << (at & 63);
  }
  marked_channels(m, D, k, sel);
  finish_row_avx2(r, D, gc, k, m, sel, st.mean, dense, vals, lo, hi);
  return true;
}

/// isolate_rows_lean's exact path (isolate_row_avx2, its dense row into scratch), out of line.
__attribute__((noinline)) inline bool isolate_row_lean_exact(const float* r, int64_t D, int64_t gc,
                                                             int64_t k, int32_t* sel, float* vals,
                                                             float* lo, float* hi,
                                                             OutlierScratch& sc) {
  float* dense = grow(sc.dense, static_cast<std::size_t>(D));
  return isolate_row_avx2(r, D, gc, k, dense, sel, vals, lo, hi, sc);
}

/// op over the 8 lanes of each of v[0..n) (n >= 1), as lane j of the result for v[j]: a fixed
/// tree of 3 levels (pairs of neighbouring lanes, pairs of those, the two 128-bit halves).
/// Lanes >= n: n <= 4, copies of lanes 0-3; else op over pad.
template <class Op>
__attribute__((always_inline)) inline __m256 reduce8(const __m256* v, int64_t n, __m256 pad, Op op) {
  auto pairs = [&](__m256 a, __m256 c) __attribute__((always_inline)) {
    return op(_mm256_shuffle_ps(a, c, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, c, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  auto at = [&](int j) __attribute__((always_inline)) { return j < n ? v[j] : pad; };
  // [a01 a23 c01 c23 | a45 a67 c45 c67], then [v0 v1 v2 v3 quarter sums | ...]
  const __m256 u = pairs(pairs(at(0), at(1)), pairs(at(2), at(3)));
  if (n <= 4) return op(u, _mm256_permute2f128_ps(u, u, 0x01));
  const __m256 w = pairs(pairs(at(4), at(5)), pairs(at(6), at(7)));
  return op(_mm256_permute2f128_ps(u, w, 0x20), _mm256_permute2f128_ps(u, w, 0x31));
}

/// The threshold of isolate_rows_lean's filter, whose statistics are float: per group of
/// n = 8 NV channels the mean c = fl(sum) / n (two lanes of 8 partial sums, reduce8) and
/// f = fl(1 / sqrt(fl(sum (x - c)^2) / n)) (the same shape, fma), where the exact definition has
/// the double mean m and 1 / sd (isd). Let u = 2^-24, L = NV + 4 (at least the depth of both
/// sums), e >= max_g |m| isd, and the group's variance in [2^-100, 2^100] (the caller checks;
/// no underflow or overflow matters then).
///  - Mean: |c - m| <= d = (1.01 L u + 2^-45) sum |x| / n + 2^-149, and sum |x| / n <= |m| + sd
///    (Cauchy-Schwarz), so in score units Em = d isd <= 1.01 (1.01 L u + 2^-45)(e + 1) + 2^-90.
///  - Spread: sum (x - c)^2 = sum (x - m)^2 + n (c - m)^2, all terms >= 0, so the float sum is
///    the exact variance times (1 + Em^2)(1 +- eQ), eQ = 1.01 (NV + 6) u; the square root,
///    division and their roundings leave |f / isd - 1| <= rho = 0.51 (eQ + Em^2) + 3.1 u + 2^-40.
///  - Scores: s' = fl(|fl(x - c)| f) and the exact score s (rounded in double, then float)
///    satisfy s (1 - rr) - E <= s' <= s (1 + rr) + E, rr = 3.1 u + 1.01 rho, E = 1.01 Em.
/// As in row_select_avx2, T' (the k-th largest s') gives the exact k-th score T >=
/// (T' - E) / (1 + rr), and every channel with s >= T has s' >= (T' - E)(1 - 2.01 rr) - E,
/// returned rounded down to float. emax_f: max_g |c| f; the caller takes the exact path when it
/// exceeds 2^12 (then e = 1.01 emax_f + 0.01 bounds max |m| isd, as Em, rho << 1).
inline float lean_filter_threshold(float tk, float emax_f, int NV) {
  const double u = 0x1p-24;
  const double e = 1.01 * static_cast<double>(emax_f) + 0.01;
  const double Lu = 1.01 * (NV + 4) * u + 0x1p-45;
  const double Em = 1.01 * Lu * (e + 1.0) + 0x1p-90;
  const double eQ = 1.01 * (NV + 6) * u;
  const double rho = 0.51 * (eQ + Em * Em) + 3.1 * u + 0x1p-40;
  const double rr = 3.1 * u + 1.01 * rho;
  const double E = 1.01 * Em;
  const double theta = (static_cast<double>(tk) - E) * (1.0 - 2.01 * rr) - E;
  return float_at_most(theta);
}

/// Lean AVX2 row isolation for the fused quantizer (quant/outlier_quant.hpp): the group size
/// GC = 8 NV and k = K <= 4 fixed at compile time, D % GC == 0, D <= 64 * kRowMaskWords. The
/// selection sel, vals and the dense ranges lo, hi of isolate_row_avx2, bit for bit, without
/// writing the dense row: it is r with every entry clamped to its group's [lo, hi] (the
/// non-selected entries lie inside it, and lo <= hi as GC > K), which the caller folds into its
/// encoding. Statistics and float scores as row_select_avx2; then one pass marks the channels
/// with s' >= theta and takes every group's min / max without them. When exactly K are marked
/// they are the selection (row_select_avx2's common case) and those min / max are the dense
/// ranges (a zero bound then takes the sign of the first non-selected zero); otherwise (near
/// ties, a 1 / sd float cannot hold) it reruns isolate_row_avx2. False when r holds NaN or inf.
template <int NV, int K, int R, int NC = 0>
inline void isolate_rows_lean(const float* const* rs, int64_t D, int32_t* sel_, float* vals_,
                              float* lo_, float* hi_, int64_t gstride, OutlierScratch& sc, bool* ok) {
  constexpr int nr = R;
  static_assert(K >= 1 && K <= 4, "isolate_rows_lean: 1 <= K <= 4");
  static_assert(NV == 4 || NV % 8 == 0, "isolate_rows_lean: group of 32 or a multiple of 64");
  constexpr int64_t GC = 8 * NV;
  // NC > 0: the row holds NC groups, known at compile time (the loops over groups unroll and the
  // per-group arrays stay in registers); the caller passes D = NC * GC.
  if constexpr (NC > 0) D = NC * GC;
  const int64_t nc = D / GC;
  // Float statistics (see lean_filter_threshold): per group two lanes of partial sums, the
  // groups' 8-lane vectors reduced 8 groups at a time (reduce8); a group outside the proven
  // range takes the exact path. Every phase runs for each of the nr rows before the next, so
  // the rows' latency chains (reductions, square roots, the threshold) overlap.
  constexpr int kMaxGroups = 64 * kRowMaskWords / 32;
  alignas(32) float fm[R][kMaxGroups], fi[R][kMaxGroups];
  __m256 part[R][kMaxGroups];
  bool exact[R];
  float emax[R];
  const __m256 inv_gc = _mm256_set1_ps(1.f / static_cast<float>(GC));
  const __m256 zero8 = _mm256_setzero_ps();
  auto add = [](__m256 a, __m256 c) __attribute__((always_inline)) { return _mm256_add_ps(a, c); };
  for (int i = 0; i < nr; ++i) {
    for (int64_t b = 0; b < nc; ++b) {
      const float* x = rs[i] + b * GC;
      __m256 a0 = _mm256_loadu_ps(x), a1 = _mm256_loadu_ps(x + 8);
      for (int j = 2; j < NV; j += 2) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x + 8 * j));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x + 8 * j + 8));
      }
      part[i][b] = _mm256_add_ps(a0, a1);
    }
    for (int64_t b = 0; b < nc; b += 8)
      _mm256_store_ps(fm[i] + b, _mm256_mul_ps(reduce8(part[i] + b, nc - b, zero8, add), inv_gc));
  }
  for (int i = 0; i < nr; ++i)
    for (int64_t b = 0; b < nc; ++b) {
      const float* x = rs[i] + b * GC;
      const __m256 mv = _mm256_set1_ps(fm[i][b]);
      __m256 q0 = zero8, q1 = zero8;
      for (int j = 0; j < NV; j += 2) {  // c - x (= -(x - c) exactly): the load folds in
        const __m256 d0 = _mm256_sub_ps(mv, _mm256_loadu_ps(x + 8 * j));
        const __m256 d1 = _mm256_sub_ps(mv, _mm256_loadu_ps(x + 8 * j + 8));
        q0 = _mm256_fmadd_ps(d0, d0, q0);
        q1 = _mm256_fmadd_ps(d1, d1, q1);
      }
      part[i][b] = _mm256_add_ps(q0, q1);
    }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < nr; ++i) {
    __m256 emax8 = zero8;
    int bad = 0;
    for (int64_t b = 0; b < nc; b += 8) {
      const __m256 var = _mm256_mul_ps(reduce8(part[i] + b, nc - b, zero8, add), inv_gc);
      const __m256 m8 = _mm256_load_ps(fm[i] + b);
      const __m256 in = _mm256_and_ps(
          _mm256_and_ps(_mm256_cmp_ps(var, _mm256_set1_ps(0x1p-100f), _CMP_GE_OQ),
                        _mm256_cmp_ps(var, _mm256_set1_ps(0x1p100f), _CMP_LE_OQ)),
          _mm256_cmp_ps(_mm256_and_ps(m8, abs_mask), _mm256_set1_ps(0x1p120f), _CMP_LE_OQ));
      const int lanes = nc - b >= 8 ? 0xff : (1 << (nc - b)) - 1;
      bad |= ~_mm256_movemask_ps(in) & lanes;
      const __m256 f8 = _mm256_div_ps(_mm256_set1_ps(1.f), _mm256_sqrt_ps(var));
      _mm256_store_ps(fi[i] + b, f8);
      // lanes past nc: copies of lanes 0-3 (nc <= 4) or 0 * inf = NaN, which
      // max_ps(NaN, emax8) drops (the second operand stays)
      emax8 = _mm256_max_ps(_mm256_mul_ps(_mm256_and_ps(m8, abs_mask), f8), emax8);
    }
    emax[i] = _mm256_cvtss_f32(hmax8(emax8));
    exact[i] = bad != 0 || !(emax[i] <= 0x1p12f);
  }
  float* score_ = grow(sc.score, static_cast<std::size_t>(R * D));
  const __m256 sign_f = _mm256_set1_ps(-0.f);
  __m256 th8[R];
  for (int i = 0; i < nr; ++i) {
    const float* r = rs[i];
    float* score = score_ + i * D;
    __m256 top[K];  // per lane, its K largest s' (descending); -1 = none yet
    for (auto& t : top) t = _mm256_set1_ps(-1.f);
    for (int64_t b = 0; b < nc; ++b) {
      const __m256 mf = _mm256_set1_ps(fm[i][b]), fiv = _mm256_set1_ps(fi[i][b]);
      for (int j = 0; j < NV; ++j) {
        const int64_t d = b * GC + 8 * j;
        const __m256 a = _mm256_sub_ps(mf, _mm256_loadu_ps(r + d));  // |c - x| = |x - c|
        const __m256 s8 = _mm256_mul_ps(_mm256_andnot_ps(sign_f, a), fiv);
        _mm256_storeu_ps(score + d, s8);
        top_k_insert<K>(top, s8);
      }
    }
    th8[i] = _mm256_set1_ps(lean_filter_threshold(kth_of_lists<K>(top, K), emax[i], NV));
  }
  const __m256 inf8 = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 ninf8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  // A marked lane becomes a NaN, which vminps / vmaxps skip when it is their first operand
  // (they return the second when either is NaN). The compares give the unmarked lanes (th > s',
  // the complement of s' >= th as scores are not NaN) so that both loads fold in.
  const __m256 nan8 = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // The unmarked lanes of 32 channels (four compare masks) as 32 bits in channel order: two
  // signed packs to bytes (dwords a0-3 b0-3 c0-3 d0-3 a4-7 b4-7 c4-7 d4-7), reordered, one byte
  // movemask; the marks are their complement.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  uint64_t m[R][kRowMaskWords];  // the words a row uses (each written by its even chunk first)
  for (int i = 0; i < nr; ++i) {
    const float* r = rs[i];
    const float* score = score_ + i * D;
    float* lo = lo_ + i * gstride;
    float* hi = hi_ + i * gstride;
    __m256 lpart[kMaxGroups], hpart[kMaxGroups];
    for (int64_t b = 0; b < nc; ++b) {
      __m256 l8 = inf8, h8 = ninf8;
      for (int c = 0; c < NV / 4; ++c) {  // 32-channel chunks (GC is a multiple of 32)
        const int64_t d0 = b * GC + 32 * c;
        __m256i mk[4];
        for (int j = 0; j < 4; ++j) {
          const __m256 keep = _mm256_cmp_ps(th8[i], _mm256_loadu_ps(score + d0 + 8 * j), _CMP_GT_OQ);
          mk[j] = _mm256_castps_si256(keep);
          const __m256 v = _mm256_blendv_ps(nan8, _mm256_loadu_ps(r + d0 + 8 * j), keep);
          l8 = _mm256_min_ps(v, l8);
          h8 = _mm256_max_ps(v, h8);
        }
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(mk[0], mk[1]), _mm256_packs_epi32(mk[2], mk[3]));
        const auto bits = static_cast<uint64_t>(
            ~static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_permutevar8x32_epi32(p, order))));
        const int64_t ch = d0 / 32;
        if (ch & 1)
          m[i][ch >> 1] |= bits << 32;
        else
          m[i][ch >> 1] = bits;
      }
      lpart[b] = l8;
      hpart[b] = h8;
    }
    bool zero_bound = false;
    for (int64_t b = 0; b < nc; b += 8) {
      // min / max in any order: a zero bound's sign is fixed below
      const __m256 l = reduce8(lpart + b, nc - b, inf8, [](__m256 a, __m256 c) { return _mm256_min_ps(a, c); });
      const __m256 h = reduce8(hpart + b, nc - b, ninf8, [](__m256 a, __m256 c) { return _mm256_max_ps(a, c); });
      const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(nc - b)),
                                               _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      if (b + 8 <= gstride) {  // room for 8 lanes (lanes past nc are junk): a plain store,
        _mm256_storeu_ps(lo + b, l);  // which a later load of the 8 lanes is forwarded from
        _mm256_storeu_ps(hi + b, h);
      } else {
        _mm256_maskstore_ps(lo + b, lanes, l);
        _mm256_maskstore_ps(hi + b, lanes, h);
      }
      zero_bound |= (_mm256_movemask_ps(_mm256_and_ps(
                         _mm256_or_ps(_mm256_cmp_ps(l, zero8, _CMP_EQ_OQ), _mm256_cmp_ps(h, zero8, _CMP_EQ_OQ)),
                         _mm256_castsi256_ps(lanes)))) != 0;
    }
    int64_t cnt = 0;
    for (int64_t w = 0; w < (D + 63) / 64; ++w) cnt += __builtin_popcountll(m[i][w]);
    int32_t* sel = sel_ + i * K;
    float* vals = vals_ + i * K;
    if (exact[i] || cnt != K) {
      ok[i] = isolate_row_lean_exact(r, D, GC, K, sel, vals, lo, hi, sc);
      continue;
    }
    for (int64_t b = 0; zero_bound && b < nc; ++b) {
      // A zero bound takes the sign of the first zero in channel order (what std::min/max keep).
      if (lo[b] == 0.f)
        for (int64_t e = b * GC; e < (b + 1) * GC; ++e)
          if (!marked(m[i], e) && r[e] == 0.f) {
            lo[b] = r[e];
            break;
          }
      if (hi[b] == 0.f)
        for (int64_t e = b * GC; e < (b + 1) * GC; ++e)
          if (!marked(m[i], e) && r[e] == 0.f) {
            hi[b] = r[e];
            break;
          }
    }
    marked_channels(m[i], D, K, sel);
    for (int j = 0; j < K; ++j) vals[j] = r[sel[j]];
    ok[i] = true;
  }
}

/// Calls f(std::integral_constant<int, NV>, std::integral_constant<int, K>) for the lean
/// instantiation of (gc, k) (gc 32, 64 or 128; k 1..4; D <= 64 * kRowMaskWords) and returns
/// true, or returns false (f not called) when there is none.
template <class F>
inline bool with_lean_instance(int64_t D, int64_t gc, int64_t k, F&& f) {
  if (D > 64 * kRowMaskWords || k < 1 || k > 4) return false;
  auto by_k = [&](auto nv) {
    switch (k) {
      case 1: f(nv, std::integral_constant<int, 1>{}); break;
      case 2: f(nv, std::integral_constant<int, 2>{}); break;
      case 3: f(nv, std::integral_constant<int, 3>{}); break;
      default: f(nv, std::integral_constant<int, 4>{}); break;
    }
    return true;
  };
  switch (gc) {
    case 32: return by_k(std::integral_constant<int, 4>{});
    case 64: return by_k(std::integral_constant<int, 8>{});
    case 128: return by_k(std::integral_constant<int, 16>{});
    default: return false;
  }
}

/// For group size 8 NV: calls f(std::integral_constant<int, NC>) with D = NC * 8 NV when D is
/// one of the head_dims with a fixed-group-count instance (64, 128, 256) and returns true, or
/// returns false (f not called).
template <int NV, class F>
inline bool with_fixed_groups(int64_t D, F&& f) {
  bool done = false;
  auto one = [&](auto ncc) {
    constexpr int NC = decltype(ncc)::value;
    constexpr int64_t Dc = int64_t{NC} * 8 * NV;
    if constexpr (Dc == 64 || Dc == 128 || Dc == 256)
      if (!done && D == Dc) {
        f(ncc);
        done = true;
      }
  };
  one(std::integral_constant<int, 1>{});
  one(std::integral_constant<int, 2>{});
  one(std::integral_constant<int, 4>{});
  one(std::integral_constant<int, 8>{});
  return done;
}

/// isolate_rows_lean for nr = 1 .. kLeanRows rows (row i's outputs at sel + i k, vals + i k,
/// lo + i gstride, hi + i gstride) and a group size and k known at run time (D % gc == 0):
/// false (nothing done) when with_lean_instance has none, else true with ok[i] = false where
/// row i holds NaN or inf. The common head_dims 64, 128 and 256 run four rows at a time with
/// the group count fixed at compile time (the four rows' latency chains overlap; the loops over
/// groups unroll): two or three rows go through the same instance with the last row repeated,
/// into local outputs. A single row, and other head_dims (as pairs), run with the group count
/// at run time.
inline bool isolate_rows_lean_rt(int nr, const float* const* rs, int64_t D, int64_t gc, int64_t k,
                                 int32_t* sel, float* vals, float* lo, float* hi, int64_t gstride,
                                 OutlierScratch& sc, bool* ok) {
  if (nr < 1 || nr > kLeanRows) return false;
  return with_lean_instance(D, gc, k, [&](auto nv, auto kk) {
    constexpr int NV = decltype(nv)::value, K = decltype(kk)::value;
    if (nr == 1) return isolate_rows_lean<NV, K, 1>(rs, D, sel, vals, lo, hi, gstride, sc, ok);
    const bool fixed = with_fixed_groups<NV>(D, [&](auto ncc) {
      constexpr int NC = decltype(ncc)::value;
      if (nr == kLeanRows) {
        isolate_rows_lean<NV, K, kLeanRows, NC>(rs, D, sel, vals, lo, hi, gstride, sc, ok);
        return;
      }
      const float* r4[kLeanRows];
      for (int i = 0; i < kLeanRows; ++i) r4[i] = rs[i < nr ? i : nr - 1];
      int32_t s4[kLeanRows * K];
      float v4[kLeanRows * K], l4[kLeanRows * NC], h4[kLeanRows * NC];
      bool ok4[kLeanRows];
      isolate_rows_lean<NV, K, kLeanRows, NC>(r4, D, s4, v4, l4, h4, NC, sc, ok4);
      for (int i = 0; i < nr; ++i) {
        std::memcpy(sel + i * K, s4 + i * K, K * sizeof(int32_t));
        std::memcpy(vals + i * K, v4 + i * K, K * sizeof(float));
        std::memcpy(lo + i * gstride, l4 + i * NC, NC * sizeof(float));
        std::memcpy(hi + i * gstride, h4 + i * NC, NC * sizeof(float));
        ok[i] = ok4[i];
      }
    });
    if (fixed) return;
    for (int i = 0; i < nr; i += 2) {
      if (nr - i >= 2)
        isolate_rows_lean<NV, K, 2>(rs + i, D, sel + i * K, vals + i * K, lo + i * gstride,
                                    hi + i * gstride, gstride, sc, ok + i);
      else
        isolate_rows_lean<NV, K, 1>(rs + i, D, sel + i * K, vals + i * K, lo + i * gstride,
                                    hi + i * gstride, gstride, sc, ok + i);
    }
  });
}

/// AVX2 isolate_outliers for the channel axis (boxes of G tokens of one channel), K = k <= 4,
/// head_dim % 8 == 0 and <= 64 * kRowMaskWords, finite x: per (token block, head) the channel
/// sums run four channels per vector down the block's tokens (each box's single partial, in
/// token order, as the scalar path); per token the selection by row_select_avx2's float filter
/// (float scores against the channels' float mean and 1 / sd, exact scores near ties); the
/// non-selected range per channel with the selected lanes blended to +-inf, then the dense
/// replacement.
template <int K>
inline void isolate_channel_avx2(const Shape& s, const GroupBox& box, float* x, int32_t* sel,
                                 float* vals, OutlierScratch& sc) {
  const int64_t H = s.heads, D = s.head_dim, G = box.gt, k = K;
  const auto uD = static_cast<std::size_t>(D);
  double* mean = grow(sc.mean, uD);
  double* isd = grow(sc.sd, uD);
  double* acc = grow(sc.part, uD);
  float* lo = grow(sc.lo, uD);
  float* hi = grow(sc.hi, uD);
  float* score = grow(sc.score, uD);
  float* fmean = grow(sc.fmean, uD);
  float* fisd = grow(sc.fisd, uD);
  uint8_t* bits = grow(sc.mark, static_cast<std::size_t>(G) * uD / 8);
  const __m256d inv_n = _mm256_set1_pd(1.0 / static_cast<double>(G));
  const __m256d zero_d = _mm256_setzero_pd();
  const __m256 sign_f = _mm256_set1_ps(-0.f);
  const __m256 inf8 = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  const __m256 ninf8 = _mm256_sub_ps(_mm256_setzero_ps(), inf8);
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int64_t t0 = 0; t0 < s.tokens; t0 += G)
    for (int64_t h = 0; h < H; ++h) {
      auto row = [&](int64_t t) { return x + ((t0 + t) * H + h) * D; };
      for (int64_t d = 0; d < D; d += 4) _mm256_storeu_pd(acc + d, zero_d);
      for (int64_t t = 0; t < G; ++t) {
        const float* r = row(t);
        for (int64_t d = 0; d < D; d += 4)
          _mm256_storeu_pd(acc + d, _mm256_add_pd(_mm256_loadu_pd(acc + d),
                                                  _mm256_cvtps_pd(_mm_loadu_ps(r + d))));
      }
      for (int64_t d = 0; d < D; d += 4) {
        _mm256_storeu_pd(mean + d, _mm256_mul_pd(_mm256_loadu_pd(acc + d), inv_n));
        _mm256_storeu_pd(acc + d, zero_d);
      }
      for (int64_t t = 0; t < G; ++t) {
        const float* r = row(t);
        for (int64_t d = 0; d < D; d += 4) {
          const __m256d dv =
              _mm256_sub_pd(_mm256_cvtps_pd(_mm_loadu_ps(r + d)), _mm256_loadu_pd(mean + d));
          _mm256_storeu_pd(acc + d, _mm256_fmadd_pd(dv, dv, _mm256_loadu_pd(acc + d)));
        }
      }
      __m256d emax4 = zero_d, guard4 = zero_d;  // filter_stats4's bounds over the channels
      for (int64_t d = 0; d < D; d += 4) {
        const __m256d sd = _mm256_sqrt_pd(_mm256_mul_pd(_mm256_loadu_pd(acc + d), inv_n));
        const __m256d i4 = _mm256_and_pd(_mm256_cmp_pd(sd, zero_d, _CMP_GT_OQ),
                                         _mm256_div_pd(_mm256_set1_pd(1.0), sd));
        const __m256d m4 = _mm256_loadu_pd(mean + d);
        _mm256_storeu_pd(isd + d, i4);
        filter_stats4(m4, i4, fmean + d, fisd + d, emax4, guard4);
      }
      const double emax = _mm256_cvtsd_f64(hmax4d(emax4));
      const bool guard = _mm256_movemask_pd(guard4) != 0;
      // Selection per token (vector v = (t0 + t) * H + h): row_select_avx2's float filter with
      // the channels' statistics (the same bounds; E and the guard over the block's channels).
      for (int64_t t = 0; t < G; ++t) {
        const float* r = row(t);
        __m256 top[K];
        for (auto& q : top) q = _mm256_set1_ps(-1.f);
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 a = _mm256_sub_ps(_mm256_loadu_ps(r + d), _mm256_loadu_ps(fmean + d));
          const __m256 s8 = _mm256_mul_ps(_mm256_andnot_ps(sign_f, a), _mm256_loadu_ps(fisd + d));
          _mm256_storeu_ps(score + d, s8);
          top_k_insert<K>(top, s8);
        }
        uint64_t m[kRowMaskWords];
        filter_select<K>(score, D, k, kth_of_lists<K>(top, k), emax, guard, m, [&](int64_t d) {
          return static_cast<float>(std::fabs(static_cast<double>(r[d]) - mean[d]) * isd[d]);
        });
        const int64_t v = (t0 + t) * H + h;
        int32_t* sl = sel + v * k;
        marked_channels(m, D, k, sl);
        for (int64_t j = 0; j < k; ++j) vals[v * k + j] = r[sl[j]];
        std::memcpy(bits + t * D / 8, m, static_cast<std::size_t>(D / 8));  // little-endian words
      }
      // Non-selected range per channel.
      for (int64_t d = 0; d < D; d += 8) {
        _mm256_storeu_ps(lo + d, inf8);
        _mm256_storeu_ps(hi + d, ninf8);
      }
      for (int64_t t = 0; t < G; ++t) {
        const float* r = row(t);
        const uint8_t* bt = bits + t * D / 8;
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 v = _mm256_loadu_ps(r + d);
          const __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(
              _mm256_and_si256(_mm256_set1_epi32(bt[d >> 3]), lane_bit), lane_bit));
          _mm256_storeu_ps(lo + d, _mm256_min_ps(_mm256_loadu_ps(lo + d), _mm256_blendv_ps(v, inf8, m)));
          _mm256_storeu_ps(hi + d, _mm256_max_ps(_mm256_loadu_ps(hi + d), _mm256_blendv_ps(v, ninf8, m)));
        }
      }
      auto selected = [&](int64_t t, int64_t d) { return (bits[t * D / 8 + (d >> 3)] >> (d & 7)) & 1; };
      for (int64_t d = 0; d < D; ++d) {  // a zero bound: the sign of the first zero in token order
        for (float* b : {lo + d, hi + d}) {
          if (*b != 0.f) continue;
          for (int64_t t = 0; t < G; ++t)
            if (!selected(t, d) && row(t)[d] == 0.f) {
              *b = row(t)[d];
              break;
            }
        }
      }
      for (int64_t t = 0; t < G; ++t) {
        const int64_t v = (t0 + t) * H + h;
        float* r = row(t);
        for (int64_t j = 0; j < k; ++j) {
          const int32_t d = sel[v * k + j];
          r[d] = dense_value(vals[v * k + j], lo[d], hi[d], mean[d]);
        }
      }
    }
}

#endif

}  // namespace detail

/// Token-axis isolation of one vector r[0..D) whose boxes are the D / gc runs of gc channels
/// (gc divides D; 0 <= k <= D): sel[0..k) gets the selected channels (ascending), vals their
/// values, dense[0..D) the dense part (dense may be r), and lo[b], hi[b] the range of the dense
/// part of box b (its non-selected range, or the box mean twice when every entry of the box is
/// selected): the dense quantizer's group statistics. Returns false, outputs unspecified, when r
/// holds NaN or inf. The same selection and dense part as isolate_outliers on a token axis.
inline bool isolate_row(const float* r, int64_t D, int64_t gc, int64_t k, float* dense,
                        int32_t* sel, float* vals, float* lo, float* hi, OutlierScratch& sc) {
#if KVQ_HAS_AVX2
  if (gc % 8 == 0 && k >= 1 && k <= detail::kRowTopKAvx2 && D <= 64 * detail::kRowMaskWords)
    return detail::isolate_row_avx2(r, D, gc, k, dense, sel, vals, lo, hi, sc);
#endif
  return detail::isolate_row_scalar(r, D, gc, k, dense, sel, vals, lo, hi, sc);
}

/// Isolates k outliers per vector of `x` ([s.tokens, s.heads, s.head_dim] contiguous f32,
/// finite): sel[(t * H + h) * k + j] gets the j-th selected channel (ascending), vals the
/// original value, and x is rewritten with the dense part (see the file comment). The group
/// box is that of (axis, group) on s (throws kShapeMismatch when it does not divide s).
inline void isolate_outliers(const Shape& s, Axis axis, int64_t group, int64_t k, float* x,
                             int32_t* sel, float* vals, OutlierScratch& sc) {
  const int64_t T = s.tokens, H = s.heads, D = s.head_dim;
  KVQ_REQUIRE(k >= 0 && k <= D, kInvalidArgument, k, " outliers per vector but head_dim is ", D);
  if (k == 0 || s.numel() == 0) return;
  const GroupBox box = group_box(axis, group, s);
#if KVQ_HAS_AVX2
  if (axis == Axis::kChannel && D % 8 == 0 && k <= 4 && D <= 64 * detail::kRowMaskWords) {
    // Finite input only (NaN would stall the top-k): anything else takes the scalar path.
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf8 = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int64_t i = 0; i < s.numel(); i += 8)
      ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), inf8,
                                           _CMP_LT_OQ));
    if (_mm256_movemask_ps(ok) == 0xff) {
      switch (k) {
        case 1: return detail::isolate_channel_avx2<1>(s, box, x, sel, vals, sc);
        case 2: return detail::isolate_channel_avx2<2>(s, box, x, sel, vals, sc);
        case 3: return detail::isolate_channel_avx2<3>(s, box, x, sel, vals, sc);
        default: return detail::isolate_channel_avx2<4>(s, box, x, sel, vals, sc);
      }
    }
  }
#endif
  if (axis == Axis::kToken) {  // boxes inside one vector: row by row
    const auto nc = static_cast<std::size_t>(box.nc);
    float* rl = detail::grow(sc.lo, nc);
    float* rh = detail::grow(sc.hi, nc);
    for (int64_t v = 0; v < T * H; ++v)
      KVQ_REQUIRE(isolate_row(x + v * D, D, box.gc, k, x + v * D, sel + v * k, vals + v * k, rl,
                              rh, sc),
                  kNonFinite, "isolate_outliers: vector (token=", v / H, ", head=", v % H,
                  ") holds a non-finite value");
    return;
  }
  const auto nb = static_cast<std::size_t>(box.count());
  double* mean = detail::grow(sc.mean, nb);
  double* sd = detail::grow(sc.sd, nb);
  float* lo = detail::grow(sc.lo, nb);
  float* hi = detail::grow(sc.hi, nb);
  float* score = detail::grow(sc.score, static_cast<std::size_t>(D));
  int32_t* idx = detail::grow(sc.idx, static_cast<std::size_t>(D));
  uint8_t* mark = detail::grow(sc.mark, static_cast<std::size_t>(D));
  // Box sums in a fixed order (the oracle's too): four partial sums per box, partial j taking
  // the channels d = j (mod 4) in [token, head, channel] order, combined as (p0 + p1) + (p2 + p3).
  // Four independent chains instead of one keep the double adds from serializing.
  double* p4 = detail::grow(sc.part, 4 * nb);
  std::fill(p4, p4 + 4 * nb, 0.0);
  const double inv_n = 1.0 / static_cast<double>(box.size());
  // Box index of channel d in row (t, h): base + d / gc (gc == D except on the token axis).
  auto base_of = [&](int64_t t, int64_t h) { return ((t / box.gt) * box.nh + h / box.gh) * box.nc; };
  const int64_t gc = box.gc;
  const bool per_channel = gc == 1;
  // Adds f(acc, r[d], box) over row (t, h) into the partials (f returns the new partial).
  auto accumulate = [&](const float* r, int64_t b0, auto&& f) {
    if (per_channel) {  // one channel per box: only partial d % 4 of box b0 + d is used
      for (int64_t d = 0; d < D; ++d) {
        double& a = p4[4 * (b0 + d) + (d & 3)];
        a = f(a, r[d], b0 + d);
      }
    } else {
      for (int64_t c0 = 0, b = b0; c0 < D; c0 += gc, ++b)
        for (int64_t d = c0; d < c0 + gc; ++d) {
          double& a = p4[4 * b + (d & 3)];
          a = f(a, r[d], b);
        }
    }
  };
  auto combine = [&](std::size_t b) { return (p4[4 * b] + p4[4 * b + 1]) + (p4[4 * b + 2] + p4[4 * b + 3]); };
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      accumulate(x + (t * H + h) * D, base_of(t, h),
                 [](double a, float v, int64_t) { return a + static_cast<double>(v); });
  for (std::size_t b = 0; b < nb; ++b) mean[b] = combine(b) * inv_n;
  std::fill(p4, p4 + 4 * nb, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      accumulate(x + (t * H + h) * D, base_of(t, h), [&](double a, float v, int64_t b) {
        const double dv = static_cast<double>(v) - mean[b];
        return std::fma(dv, dv, a);
      });
  // sd[] holds 1 / sd (0 for a constant box): score = |x - mean| * (1 / sd).
  for (std::size_t b = 0; b < nb; ++b) {
    const double v = std::sqrt(combine(b) * inv_n);
    sd[b] = v > 0.0 ? 1.0 / v : 0.0;
  }

  // Selection per vector, then the non-selected range of every box.
  std::fill(lo, lo + nb, std::numeric_limits<float>::infinity());
  std::fill(hi, hi + nb, -std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* r = x + (t * H + h) * D;
      const int64_t b0 = base_of(t, h);
      for (int64_t d = 0; d < D; ++d) {
        const int64_t bd = b0 + d / gc;
        score[d] = static_cast<float>(std::fabs(static_cast<double>(r[d]) - mean[bd]) * sd[bd]);
      }
      int32_t* out = sel + (t * H + h) * k;
      detail::select_top_k(score, D, k, out, idx);
      std::fill(mark, mark + D, uint8_t{0});
      for (int64_t j = 0; j < k; ++j) mark[out[j]] = 1;
      for (int64_t d = 0; d < D; ++d) {
        if (mark[d]) continue;
        const int64_t b = b0 + d / gc;
        lo[b] = std::min(lo[b], r[d]);
        hi[b] = std::max(hi[b], r[d]);
      }
    }
  // Values out, dense part in.
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      float* r = x + (t * H + h) * D;
      const int64_t b0 = base_of(t, h);
      const int32_t* s_ = sel + (t * H + h) * k;
      float* v = vals + (t * H + h) * k;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t d = s_[j];
        const int64_t b = b0 + d / gc;
        v[j] = r[d];
        r[d] = detail::dense_value(r[d], lo[b], hi[b], mean[b]);
      }
    }
}

}  // namespace kvq
