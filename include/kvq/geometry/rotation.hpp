#pragma once
/// \file rotation.hpp
/// Random orthogonal rotations applied to each head vector before scalar rounding.
///
/// Why rotate: KV vectors carry most of their energy in a few fixed channels. A random
/// orthogonal map spreads that energy over all coordinates, so every coordinate of the rotated
/// unit vector follows (nearly) the same known distribution and one Lloyd-Max codebook fits
/// them all (TurboQuant). Two kinds:
///
/// - **Randomized Hadamard** (kHadamard, the fast one): y = H D x / sqrt(d) with D a seeded
///   random +-1 diagonal and H the Sylvester Walsh-Hadamard matrix, computed by the fast
///   Walsh-Hadamard transform (d log2 d additions). For d = m * 2^k with odd m > 1 (head_dim
///   80, 96, 192, ...) there is no Hadamard matrix of order d that the FWHT can use, so kvq
///   composes two block-diagonal stages:
///     y = Hb D2 P Hb D1 x
///   Hb = block-diagonal of m orthonormal Hadamard blocks of size B = 2^k, D1 and D2 seeded
///   +-1 diagonals, P a seeded permutation. One block stage alone keeps a channel's energy
///   inside its block of B coordinates (with B = 16 for d = 80, coordinate variances then differ
///   between blocks by the outlier energy, and distortion rises ~20% at 1 bit). P deals the B
///   outputs of every first-stage block over all m blocks and the second stage spreads each
///   again, so every output depends on every input when m <= B (kvq requires that, and B >= 8).
///   P is a *balanced* random deal: every second-stage block receives floor(B/m) or ceil(B/m)
///   coordinates from each first-stage block (positions random). A uniformly random P leaves
///   hypergeometric counts (0..7 of 16 at d = 80), and unlucky seeds were measurably worse
///   than a dense rotation; the balanced deal removed that seed-to-seed spread.
///   Cost: two FWHT passes of size B plus one gather, O(d log d).
///   docs/rotation.md has the measured quality of both schemes against a dense rotation.
/// - **Dense** (kDense, the oracle and the alternative): a Haar-distributed random orthogonal
///   d x d matrix (Householder QR of a seeded Gaussian matrix, columns sign-fixed by the signs
///   of R's diagonal so the distribution is exactly Haar), applied as a matrix product: O(d^2)
///   per vector, any d >= 1. Building one needs Eigen's QR, so it lives in
///   <kvq/geometry/dense_rotation.hpp> (kvq::dense_rotation, kvq::make_rotation); this header
///   stays free of Eigen, which keeps every translation unit that only quantizes cheap to
///   compile. A Rotation holds and applies a dense matrix either way (Rotation::from_matrix).
///
/// Determinism: all randomness comes from kvq::detail::Xoshiro256ss seeded by splitmix64 from
/// the user's 64-bit seed; both are integer-only, so the Hadamard signs and permutation are the
/// same on every platform and compiler, and so are the Hadamard outputs (the transform only
/// adds, subtracts and multiplies by +-1 and by one correctly rounded constant, in a fixed
/// order; every SIMD path keeps the scalar order, so SIMD and scalar results are bit-identical).
/// The dense matrix uses std::log/std::cos/std::sin (Box-Muller) and Eigen's QR, whose last bits
/// may differ between math libraries and Eigen's SIMD levels: deterministic per build, equal
/// across platforms only up to float rounding.
///
/// Non-finite input propagates, it is not checked (this is the hot path; quantizers validate
/// their input before rotating): a NaN anywhere in a vector makes every output of that vector
/// NaN; one +-Inf makes every output +-Inf, several may give NaN. The Hadamard transform sums
/// unscaled and scales at the end (that order keeps it exact against the reference under any
/// -ffp-contract), so inputs above ~3.4e38 / d in magnitude overflow to Inf.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "kvq/config.hpp"
#include "kvq/core/error.hpp"

namespace kvq {

namespace detail {

/// One splitmix64 step (Steele, Lea, Flood 2014): advances `state` by the golden-ratio
/// increment and returns a mixed 64-bit value. Used only to expand a user seed into the
/// xoshiro state, which must not be all zero.
inline uint64_t splitmix64(uint64_t& state) {
  state += 0x9e3779b97f4a7c15ull;
  uint64_t z = state;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// xoshiro256** (Blackman & Vigna 2018): kvq's portable PRNG. std:: engines are portable but
/// std:: distributions are not (libstdc++, libc++ and MSVC map engine output to values
/// differently), so kvq derives every random quantity itself from these 64-bit words.
class Xoshiro256ss {
 public:
  /// State words = four successive splitmix64 outputs starting from `seed`.
  explicit Xoshiro256ss(uint64_t seed) {
    uint64_t sm = seed;
    for (uint64_t& w : s_) w = splitmix64(sm);
  }

  /// A generator with an explicit state (not all zero), for known-answer tests.
  static Xoshiro256ss from_state(uint64_t s0, uint64_t s1, uint64_t s2, uint64_t s3) {
    Xoshiro256ss g(0);
    g.s_[0] = s0;
    g.s_[1] = s1;
    g.s_[2] = s2;
    g.s_[3] = s3;
    return g;
  }

  /// Next 64 random bits.
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5u, 7) * 9u;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  /// Uniform double in [0, 1): the top 53 bits of one draw (exact, portable).
  double uniform01() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  /// Uniform integer in [0, n), n >= 1, without modulo bias: draws below 2^64 mod n are
  /// rejected, so every residue has the same number of preimages.
  uint64_t bounded(uint64_t n) {
    const uint64_t reject_below = (0 - n) % n;  // == 2^64 mod n
    for (;;) {
      const uint64_t r = next();
      if (r >= reject_below) return r % n;
    }
  }

  /// +1.0f or -1.0f from the top bit of one draw.
  float sign() { return (next() >> 63) ? -1.0f : 1.0f; }

  /// Standard normal by Box-Muller; each call consumes two draws and returns the cosine branch
  /// (the sine branch is dropped so the stream position never depends on call history).
  /// Portable up to the last-bit accuracy of std::log / std::cos.
  double normal() {
    const double u1 = 1.0 - uniform01();  // (0, 1]: log(u1) is finite
    const double u2 = uniform01();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586476925 * u2);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

inline bool is_pow2(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

/// 1/sqrt(n) rounded to float once. IEEE sqrt and division are correctly rounded, so this
/// constant is the same everywhere; the reference oracle computes it the same way.
inline float inv_sqrt_f(int64_t n) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
}

/// Scalar FWHT kernel, the portable fallback and the order every SIMD path reproduces, from
/// `in` to `x` (in == x for in place; otherwise they must not overlap):
///   x[i] = in[i] * pre[i] (if pre; kvq passes only +-1 there, so it is exact),
///   butterfly stages h = 1, 2, 4, ..., n/2 with (a, b) -> (a + b, a - b),
///   x[i] *= post ? post[i] : scale (the only rounding multiply, last, so no compiler may fuse
///   it with an addition).
inline void fwht_scalar(const float* in, float* x, int n, const float* pre, const float* post,
                        float scale) {
  if (pre) {
    for (int i = 0; i < n; ++i) x[i] = in[i] * pre[i];
  } else if (in != x) {
    std::memcpy(x, in, sizeof(float) * n);
  }
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const float a = x[j];
        const float b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
    }
  }
  if (post) {
    for (int i = 0; i < n; ++i) x[i] *= post[i];
  } else {
    for (int i = 0; i < n; ++i) x[i] *= scale;
  }
}

/// Butterfly stages h >= `first_h` done across memory, 16 or 8 floats at a time (SIMD paths for
/// long vectors after the in-register part).
#if KVQ_HAS_AVX512
inline void fwht_memory_stages_avx512(float* x, int n, int first_h) {
  for (int h = first_h; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; j += 16) {
        const __m512 a = _mm512_loadu_ps(x + j);
        const __m512 b = _mm512_loadu_ps(x + j + h);
        _mm512_storeu_ps(x + j, _mm512_add_ps(a, b));
        _mm512_storeu_ps(x + j + h, _mm512_sub_ps(a, b));
      }
    }
  }
}

/// Stages h = 1, 2, 4, 8 inside one 16-float register. Each stage: p = v with every lane
/// swapped with its partner (lane ^ h), then v * (+1 low lane / -1 high lane) + p, which is
/// a + b in the low lane and a - b in the high lane, exactly (the product by +-1 is exact, so
/// the fused add rounds the same as the scalar add/sub). The all-ones masked forms of the
/// shuffles are the same instructions; they avoid GCC 12's spurious -Wmaybe-uninitialized on
/// the unmasked intrinsics.
inline __m512 fwht16_avx512(__m512 v) {
  const __m512 s1 = _mm512_setr_ps(1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1);
  const __m512 s2 = _mm512_setr_ps(1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1);
  const __m512 s4 = _mm512_setr_ps(1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1);
  const __m512 s8 = _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __mmask16 all = 0xFFFF;
  v = _mm512_fmadd_ps(v, s1, _mm512_mask_permute_ps(v, all, v, 0xB1));        // lanes 2i <-> 2i+1
  v = _mm512_fmadd_ps(v, s2, _mm512_mask_permute_ps(v, all, v, 0x4E));        // pairs in 128 bits
  v = _mm512_fmadd_ps(v, s4, _mm512_mask_shuffle_f32x4(v, all, v, v, 0xB1));  // 128-bit quarters
  return _mm512_fmadd_ps(v, s8, _mm512_mask_shuffle_f32x4(v, all, v, v, 0x4E));  // 256-bit halves
}

/// Whole transform of n = 16 * kRegs floats kept in registers (kRegs <= 16 uses at most 16 of
/// the 32 zmm registers, so nothing spills): loads (with the pre sign), in-register stages,
/// cross-register stages, post multiply, stores. kPost: 0 none, 1 scalar scale, 2 vector.
/// Loops have compile-time trip counts and are fully unrolled, so v[] lives in registers.
template <int kRegs, bool kPre, int kPost>
inline void fwht_regs_avx512(const float* in, float* x, const float* pre, const float* post,
                             float scale) {
  __m512 v[kRegs];
#pragma GCC unroll 16
  for (int r = 0; r < kRegs; ++r) {
    v[r] = _mm512_loadu_ps(in + 16 * r);
    if (kPre) v[r] = _mm512_mul_ps(v[r], _mm512_loadu_ps(pre + 16 * r));
    v[r] = fwht16_avx512(v[r]);
  }
  constexpr int kStages = kRegs >= 16 ? 4 : kRegs >= 8 ? 3 : kRegs >= 4 ? 2 : kRegs >= 2 ? 1 : 0;
#pragma GCC unroll 4
  for (int s = 0; s < kStages; ++s) {
    const int h = 1 << s;
#pragma GCC unroll 8
    for (int p = 0; p < kRegs / 2; ++p) {
      const int q = (p >> s) * 2 * h + (p & (h - 1));  // low register of the p-th pair
      const __m512 a = v[q];
      const __m512 b = v[q + h];
      v[q] = _mm512_add_ps(a, b);
      v[q + h] = _mm512_sub_ps(a, b);
    }
  }
  const __m512 vs = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int r = 0; r < kRegs; ++r) {
    if (kPost == 1) v[r] = _mm512_mul_ps(v[r], vs);
    if (kPost == 2) v[r] = _mm512_mul_ps(v[r], _mm512_loadu_ps(post + 16 * r));
    _mm512_storeu_ps(x + 16 * r, v[r]);
  }
}

template <int kRegs>
inline void fwht_regs_avx512_dispatch(const float* in, float* x, const float* pre,
                                      const float* post, float scale) {
  if (pre) {
    if (post) return fwht_regs_avx512<kRegs, true, 2>(in, x, pre, post, scale);
    return fwht_regs_avx512<kRegs, true, 1>(in, x, pre, post, scale);
  }
  if (post) return fwht_regs_avx512<kRegs, false, 2>(in, x, pre, post, scale);
  return fwht_regs_avx512<kRegs, false, 1>(in, x, pre, post, scale);
}

/// AVX-512 FWHT for power-of-two n >= 16, same contract and bit-identical to fwht_scalar.
inline void fwht_avx512(const float* in, float* x, int n, const float* pre, const float* post,
                        float scale) {
  switch (n) {
    case 16: return fwht_regs_avx512_dispatch<1>(in, x, pre, post, scale);
    case 32: return fwht_regs_avx512_dispatch<2>(in, x, pre, post, scale);
    case 64: return fwht_regs_avx512_dispatch<4>(in, x, pre, post, scale);
    case 128: return fwht_regs_avx512_dispatch<8>(in, x, pre, post, scale);
    case 256: return fwht_regs_avx512_dispatch<16>(in, x, pre, post, scale);
    default: break;
  }
  // n >= 512: stages up to h = 128 per 256-float block in registers, the rest across memory.
  for (int i = 0; i < n; i += 256) {
    if (pre) {
      fwht_regs_avx512<16, true, 0>(in + i, x + i, pre + i, nullptr, 0.0f);
    } else {
      fwht_regs_avx512<16, false, 0>(in + i, x + i, nullptr, nullptr, 0.0f);
    }
  }
  fwht_memory_stages_avx512(x, n, 256);
  if (post) {
    for (int i = 0; i < n; i += 16) {
      _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(post + i)));
    }
  } else {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int i = 0; i < n; i += 16) {
      _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), vs));
    }
  }
}
#endif  // KVQ_HAS_AVX512

#if KVQ_HAS_AVX2
/// Stages h = 1, 2, 4 inside one 8-float register (same exact +-1 fused trick as AVX-512).
inline __m256 fwht8_avx2(__m256 v) {
  const __m256 s1 = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
  const __m256 s2 = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 s4 = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps(v, 0xB1));             // lanes 2i <-> 2i+1
  v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps(v, 0x4E));             // pairs within 128 bits
  return _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps(v, v, 0x01));  // 128-bit halves
}

/// Whole transform of n = 8 * kRegs floats kept in registers (kRegs <= 8: half of the 16 ymm
/// registers, nothing spills): loads (with the pre sign), in-register stages, cross-register
/// stages, post multiply, stores, in one pass over memory. kPost: 0 none, 1 scalar scale, 2
/// vector. Fully unrolled (compile-time trip counts), so v[] lives in registers.
template <int kRegs, bool kPre, int kPost>
inline void fwht_regs_avx2(const float* in, float* x, const float* pre, const float* post,
                           float scale) {
  __m256 v[kRegs];
#pragma GCC unroll 8
  for (int r = 0; r < kRegs; ++r) {
    v[r] = _mm256_loadu_ps(in + 8 * r);
    if (kPre) v[r] = _mm256_mul_ps(v[r], _mm256_loadu_ps(pre + 8 * r));
    v[r] = fwht8_avx2(v[r]);
  }
  constexpr int kStages = kRegs >= 8 ? 3 : kRegs >= 4 ? 2 : kRegs >= 2 ? 1 : 0;
#pragma GCC unroll 3
  for (int s = 0; s < kStages; ++s) {
    const int h = 1 << s;
#pragma GCC unroll 4
    for (int p = 0; p < kRegs / 2; ++p) {
      const int q = (p >> s) * 2 * h + (p & (h - 1));  // low register of the p-th pair
      const __m256 a = v[q];
      const __m256 b = v[q + h];
      v[q] = _mm256_add_ps(a, b);
      v[q + h] = _mm256_sub_ps(a, b);
    }
  }
  const __m256 vs = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < kRegs; ++r) {
    if (kPost == 1) v[r] = _mm256_mul_ps(v[r], vs);
    if (kPost == 2) v[r] = _mm256_mul_ps(v[r], _mm256_loadu_ps(post + 8 * r));
    _mm256_storeu_ps(x + 8 * r, v[r]);
  }
}

/// n = 128: the first 64 floats through stages h = 1..32 in registers and stored, the second
/// 64 likewise but kept in registers, then the last stage (h = 64) against the stored first
/// half, fused with the post multiply. All 128 floats would need all 16 ymm registers plus the
/// sign constants and spill; this order spills nothing and stores each output once more only
/// for the first half (measured ~8% faster than the all-register version on Zen 3).
template <bool kPre, int kPost>
inline void fwht128_avx2(const float* in, float* x, const float* pre, const float* post,
                         float scale) {
  fwht_regs_avx2<8, kPre, 0>(in, x, pre, nullptr, 0.0f);
  __m256 v[8];
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    v[r] = _mm256_loadu_ps(in + 64 + 8 * r);
    if (kPre) v[r] = _mm256_mul_ps(v[r], _mm256_loadu_ps(pre + 64 + 8 * r));
    v[r] = fwht8_avx2(v[r]);
  }
#pragma GCC unroll 3
  for (int s = 0; s < 3; ++s) {
    const int h = 1 << s;
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const int q = (p >> s) * 2 * h + (p & (h - 1));
      const __m256 a = v[q];
      const __m256 b = v[q + h];
      v[q] = _mm256_add_ps(a, b);
      v[q + h] = _mm256_sub_ps(a, b);
    }
  }
  const __m256 vs = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const __m256 a = _mm256_loadu_ps(x + 8 * r);
    __m256 lo = _mm256_add_ps(a, v[r]), hi = _mm256_sub_ps(a, v[r]);
    if (kPost == 1) {
      lo = _mm256_mul_ps(lo, vs);
      hi = _mm256_mul_ps(hi, vs);
    } else if (kPost == 2) {
      lo = _mm256_mul_ps(lo, _mm256_loadu_ps(post + 8 * r));
      hi = _mm256_mul_ps(hi, _mm256_loadu_ps(post + 64 + 8 * r));
    }
    _mm256_storeu_ps(x + 8 * r, lo);
    _mm256_storeu_ps(x + 64 + 8 * r, hi);
  }
}

template <int kRegs>
inline void fwht_regs_avx2_dispatch(const float* in, float* x, const float* pre,
                                    const float* post, float scale) {
  if (pre) {
    if (post) return fwht_regs_avx2<kRegs, true, 2>(in, x, pre, post, scale);
    return fwht_regs_avx2<kRegs, true, 1>(in, x, pre, post, scale);
  }
  if (post) return fwht_regs_avx2<kRegs, false, 2>(in, x, pre, post, scale);
  return fwht_regs_avx2<kRegs, false, 1>(in, x, pre, post, scale);
}

/// AVX2 FWHT for power-of-two n >= 8 (used when AVX-512 is not compiled in), bit-identical to
/// fwht_scalar. n <= 64: one pass in registers; n = 128: fwht128_avx2. Larger n: stages up to h = 64 per 128-float
/// block in registers, the remaining stages across memory, the last of them fused with the
/// post multiply (the multiply still follows the final add/sub, as in fwht_scalar).
inline void fwht_avx2(const float* in, float* x, int n, const float* pre, const float* post,
                      float scale) {
  switch (n) {
    case 8: return fwht_regs_avx2_dispatch<1>(in, x, pre, post, scale);
    case 16: return fwht_regs_avx2_dispatch<2>(in, x, pre, post, scale);
    case 32: return fwht_regs_avx2_dispatch<4>(in, x, pre, post, scale);
    case 64: return fwht_regs_avx2_dispatch<8>(in, x, pre, post, scale);
    case 128:
      if (pre) {
        if (post) return fwht128_avx2<true, 2>(in, x, pre, post, scale);
        return fwht128_avx2<true, 1>(in, x, pre, post, scale);
      }
      if (post) return fwht128_avx2<false, 2>(in, x, pre, post, scale);
      return fwht128_avx2<false, 1>(in, x, pre, post, scale);
    default: break;
  }
  for (int i = 0; i < n; i += 128) {
    if (pre) {
      fwht128_avx2<true, 0>(in + i, x + i, pre + i, nullptr, 0.0f);
    } else {
      fwht128_avx2<false, 0>(in + i, x + i, nullptr, nullptr, 0.0f);
    }
  }
  for (int h = 128; h < n / 2; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; j += 8) {
        const __m256 a = _mm256_loadu_ps(x + j);
        const __m256 b = _mm256_loadu_ps(x + j + h);
        _mm256_storeu_ps(x + j, _mm256_add_ps(a, b));
        _mm256_storeu_ps(x + j + h, _mm256_sub_ps(a, b));
      }
    }
  }
  const int h = n / 2;  // last stage, then the post multiply of both outputs
  const __m256 vs = _mm256_set1_ps(scale);
  for (int j = 0; j < h; j += 8) {
    const __m256 a = _mm256_loadu_ps(x + j);
    const __m256 b = _mm256_loadu_ps(x + j + h);
    const __m256 m0 = post ? _mm256_loadu_ps(post + j) : vs;
    const __m256 m1 = post ? _mm256_loadu_ps(post + j + h) : vs;
    _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_add_ps(a, b), m0));
    _mm256_storeu_ps(x + j + h, _mm256_mul_ps(_mm256_sub_ps(a, b), m1));
  }
}
#endif  // KVQ_HAS_AVX2

/// FWHT of a power-of-two n (unchecked) from `in` to `x` (same pointer for in place) with
/// optional pre signs and post multipliers; picks the widest SIMD path compiled in. See
/// fwht_scalar for the exact operation order.
inline void fwht_kernel(const float* in, float* x, int n, const float* pre, const float* post,
                        float scale) {
#if KVQ_HAS_AVX512
  if (n >= 16) return fwht_avx512(in, x, n, pre, post, scale);
#endif
#if KVQ_HAS_AVX2
  if (n >= 8) return fwht_avx2(in, x, n, pre, post, scale);
#endif
  fwht_scalar(in, x, n, pre, post, scale);
}

/// fwht_kernel on each of the dim / block consecutive blocks (pre/post indexed over all dim).
/// One dispatch for all blocks, so the small blocks of the two-stage scheme (16 floats at
/// d = 80) do not pay a call and a switch each.
inline void fwht_blocks(const float* in, float* x, int dim, int block, const float* pre,
                        const float* post, float scale) {
#if KVQ_HAS_AVX512
  auto run = [&](auto regs) {
    constexpr int kRegs = decltype(regs)::value;
    for (int o = 0; o < dim; o += 16 * kRegs) {
      if (pre) {
        if (post) {
          fwht_regs_avx512<kRegs, true, 2>(in + o, x + o, pre + o, post + o, scale);
        } else {
          fwht_regs_avx512<kRegs, true, 1>(in + o, x + o, pre + o, nullptr, scale);
        }
      } else if (post) {
        fwht_regs_avx512<kRegs, false, 2>(in + o, x + o, nullptr, post + o, scale);
      } else {
        fwht_regs_avx512<kRegs, false, 1>(in + o, x + o, nullptr, nullptr, scale);
      }
    }
  };
  switch (block) {
    case 16: return run(std::integral_constant<int, 1>());
    case 32: return run(std::integral_constant<int, 2>());
    case 64: return run(std::integral_constant<int, 4>());
    case 128: return run(std::integral_constant<int, 8>());
    case 256: return run(std::integral_constant<int, 16>());
    default: break;
  }
#endif
  for (int o = 0; o < dim; o += block) {
    fwht_kernel(in + o, x + o, block, pre ? pre + o : nullptr, post ? post + o : nullptr, scale);
  }
}

/// y[i] = x[idx[i]] for i < n (the permutation step of the two-stage scheme). Vector gathers
/// instead of scalar loads also avoid store-forwarding stalls on the just-written vectors.
inline void gather(const float* x, const int32_t* idx, float* y, int n) {
  int i = 0;
#if KVQ_HAS_AVX512
  for (; i + 16 <= n; i += 16) {
    const __m512i id = _mm512_loadu_si512(idx + i);
    _mm512_storeu_ps(y + i, _mm512_i32gather_ps(id, x, 4));
  }
#elif KVQ_HAS_AVX2
  for (; i + 8 <= n; i += 8) {
    const __m256i id = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + i));
    _mm256_storeu_ps(y + i, _mm256_i32gather_ps(x, id, 4));
  }
#endif
  for (; i < n; ++i) y[i] = x[idx[i]];
}

inline void require_fwht_size(int n) {
  KVQ_REQUIRE(is_pow2(n), kInvalidArgument, "fwht: length ", n, " is not a positive power of two");
}

/// Scratch for the gather step of the two-stage scheme: on the stack up to kStackFloats.
constexpr int kStackFloats = 2048;

}  // namespace detail

/// Orthonormal fast Walsh-Hadamard transform in place: x <- H x / sqrt(n), H the Sylvester
/// (natural order) Hadamard matrix. Its own inverse. n must be a power of two (>= 1).
/// Throws kvq::Error(kInvalidArgument) otherwise.
inline void fwht(float* x, int n) {
  detail::require_fwht_size(n);
  detail::fwht_kernel(x, x, n, nullptr, nullptr, detail::inv_sqrt_f(n));
}

/// fwht() on `count` contiguous vectors of n floats: x is [count, n].
inline void fwht_batch(float* x, int64_t count, int n) {
  detail::require_fwht_size(n);
  const float scale = detail::inv_sqrt_f(n);
  for (int64_t v = 0; v < count; ++v) {
    detail::fwht_kernel(x + v * n, x + v * n, n, nullptr, nullptr, scale);
  }
}

/// Which random orthogonal map a Rotation applies.
enum class RotationKind : uint8_t {
  kHadamard,  ///< randomized Hadamard, O(d log d); d = 2^k, or m * 2^k with odd m <= 2^k, 2^k >= 8
  kDense,     ///< Haar random orthogonal matrix, O(d^2); any d >= 1
};

inline const char* to_string(RotationKind k) {
  switch (k) {
    case RotationKind::kHadamard: return "hadamard";
    case RotationKind::kDense: return "dense";
  }
  return "?";
}

/// A seeded random rotation of R^dim, applied in place to float vectors.
///
/// Construction draws all random parameters once (Hadamard: O(d); dense: O(d^3) QR, ~50 ms at
/// d = 512); apply*/apply_inverse* are const and thread-safe. The stream layout, so
/// the parameters can be regenerated elsewhere from (kind, dim, seed) alone:
/// - kHadamard, d = 2^k: Xoshiro256ss(seed) gives d signs (D1[i] = sign of draw i, top bit set
///   means -1).
/// - kHadamard, d = m * 2^k (B = 2^k): d signs D1; then P: "shuffle" below is Fisher-Yates
///   (for i = n-1 down to 1: j = bounded(i + 1), swap(a[i], a[j])). source = identity [m, B],
///   shuffle each of its m rows; order = identity [m], shuffle it; p[k] = source[order[k % m]]
///   [k / m] for k = 0..d-1; shuffle each block of B entries of p. Then d signs D2.
///   Forward y = Hb D2 P Hb D1 x where (P u)[i] = u[p[i]].
/// - kDense: Xoshiro256ss(seed).normal() fills a d x d matrix G row by row; G = QR
///   (Householder); Q's column j is multiplied by sign(R(j, j)); forward y = Q x.
class Rotation {
 public:
  /// Throws kvq::Error: kInvalidArgument when dim <= 0; kUnsupported for a Hadamard dim with
  /// no supported decomposition (see hadamard_supported) or a dense dim above kMaxDenseDim.
  /// kind must be kHadamard here: dense rotations are drawn by kvq::dense_rotation (or
  /// kvq::make_rotation for either kind) in <kvq/geometry/dense_rotation.hpp>, which needs Eigen.
  Rotation(RotationKind kind, int dim, uint64_t seed) : kind_(kind), dim_(dim), seed_(seed) {
    KVQ_REQUIRE(dim > 0, kInvalidArgument, "rotation: dimension must be positive, got ", dim);
    if (kind != RotationKind::kHadamard) {
      fail(ErrorKind::kUnsupported,
           "rotation: a dense rotation is drawn by kvq::dense_rotation(dim, seed) or "
           "kvq::make_rotation(kind, dim, seed) from <kvq/geometry/dense_rotation.hpp> (it needs "
           "Eigen's QR)");
    }
    init_hadamard();
  }

  static Rotation hadamard(int dim, uint64_t seed) {
    return Rotation(RotationKind::kHadamard, dim, seed);
  }

  /// A dense rotation from its matrix Q ([dim, dim] row-major; forward y = Q x, inverse Q^T x).
  /// `seed` is only recorded. Q must be finite and orthonormal: every |Q^T Q - I| entry at most
  /// `tolerance` (checked, O(d^3)); anything else is kInvalidArgument.
  static Rotation from_matrix(int dim, uint64_t seed, std::vector<float> q,
                              double tolerance = 1e-5) {
    KVQ_REQUIRE(dim > 0 && dim <= kMaxDenseDim, kUnsupported,
                "dense rotation: dimension must be in [1, ", kMaxDenseDim, "], got ", dim);
    KVQ_REQUIRE(q.size() == static_cast<size_t>(dim) * static_cast<size_t>(dim), kShapeMismatch,
                "dense rotation: matrix has ", q.size(), " entries, a ", dim, " x ", dim,
                " rotation needs ", static_cast<size_t>(dim) * static_cast<size_t>(dim));
    for (size_t i = 0; i < q.size(); ++i) {
      KVQ_REQUIRE(std::isfinite(q[i]), kNonFinite, "dense rotation: matrix entry (", i / dim, ", ",
                  i % dim, ") is ", q[i]);
    }
    for (int a = 0; a < dim; ++a) {
      for (int b = a; b < dim; ++b) {
        double s = 0.0;
        for (int i = 0; i < dim; ++i) {
          s += static_cast<double>(q[static_cast<size_t>(i) * dim + a]) *
               q[static_cast<size_t>(i) * dim + b];
        }
        const double want = a == b ? 1.0 : 0.0;
        KVQ_REQUIRE(std::fabs(s - want) <= tolerance, kInvalidArgument,
                    "dense rotation: matrix is not orthonormal: column ", a, " . column ", b,
                    " = ", s, ", expected ", want, " (tolerance ", tolerance, ")");
      }
    }
    Rotation r;
    r.kind_ = RotationKind::kDense;
    r.dim_ = dim;
    r.seed_ = seed;
    r.q_ = std::move(q);
    return r;
  }

  /// Largest dim for a dense rotation (its matrix is dim^2 floats: 64 MiB at the limit).
  static constexpr int kMaxDenseDim = 4096;

  /// True when a Hadamard rotation of this dim can be built: d a power of two, or d = m * B
  /// with B = 2^k >= 8, m odd and 1 < m <= B (two stages then reach every coordinate).
  static bool hadamard_supported(int dim) { return hadamard_unsupported_reason(dim).empty(); }

  int dim() const noexcept { return dim_; }
  uint64_t seed() const noexcept { return seed_; }
  RotationKind kind() const noexcept { return kind_; }
  /// Hadamard block size B (== dim for powers of two); 0 for dense.
  int block() const noexcept { return block_; }
  /// First-stage +-1 signs D1 (Hadamard), [dim]; empty for dense.
  const std::vector<float>& signs() const noexcept { return sign1_; }
  /// Second-stage signs D2, [dim]; empty unless dim is not a power of two.
  const std::vector<float>& signs2() const noexcept { return sign2_; }
  /// The permutation p between the stages, [dim]; empty unless dim is not a power of two.
  const std::vector<int32_t>& permutation() const noexcept { return perm_; }
  /// The dense matrix Q, [dim, dim] row-major; empty for Hadamard.
  const std::vector<float>& dense_matrix() const noexcept { return q_; }

  /// x <- R x for one vector of dim() floats.
  void apply(float* x) const {
    if (kind_ == RotationKind::kDense) return dense_apply(x, 1, false);
    hadamard_forward(x);
  }
  /// x <- R^T x (the inverse) for one vector.
  void apply_inverse(float* x) const {
    if (kind_ == RotationKind::kDense) return dense_apply(x, 1, true);
    hadamard_inverse(x);
  }
  /// apply() on n contiguous vectors: x is [n, dim].
  void apply_batch(float* x, int64_t n) const {
    KVQ_REQUIRE(n >= 0, kInvalidArgument, "rotation: negative batch size ", n);
    if (kind_ == RotationKind::kDense) return dense_apply(x, n, false);
    for (int64_t v = 0; v < n; ++v) hadamard_forward(x + v * dim_);
  }
  /// apply_inverse() on n contiguous vectors: x is [n, dim].
  void apply_inverse_batch(float* x, int64_t n) const {
    KVQ_REQUIRE(n >= 0, kInvalidArgument, "rotation: negative batch size ", n);
    if (kind_ == RotationKind::kDense) return dense_apply(x, n, true);
    for (int64_t v = 0; v < n; ++v) hadamard_inverse(x + v * dim_);
  }

  /// Empty when Hadamard supports dim, else why not (the exception message).
  static std::string hadamard_unsupported_reason(int dim) {
    if (dim <= 0) return detail::cat("dimension must be positive, got ", dim);
    if (detail::is_pow2(dim)) return {};
    int b = 1;
    while (dim % (2 * b) == 0) b *= 2;
    const int m = dim / b;
    if (b < 8 || m > b) {
      return detail::cat("hadamard rotation: head_dim ", dim, " = ", m, " x ", b,
                         " is not supported: it needs a power of two, or m x 2^k with odd m <= "
                         "2^k and 2^k >= 8 (e.g. 80 = 5 x 16, 96 = 3 x 32, 192 = 3 x 64); use "
                         "a dense rotation (kvq::dense_rotation) for this head_dim");
    }
    return {};
  }

 private:
  Rotation() : kind_(RotationKind::kDense), dim_(0), seed_(0) {}  // for from_matrix

  void init_hadamard() {
    const std::string why = hadamard_unsupported_reason(dim_);
    if (!why.empty()) fail(ErrorKind::kUnsupported, why);
    block_ = 1;  // largest power of two dividing dim (dim itself for powers of two)
    while (dim_ % (2 * block_) == 0) block_ *= 2;
    scale_ = detail::inv_sqrt_f(block_);
    detail::Xoshiro256ss rng(seed_);
    sign1_.resize(dim_);
    for (float& s : sign1_) s = rng.sign();
    post1_.resize(dim_);
    for (int i = 0; i < dim_; ++i) post1_[i] = sign1_[i] * scale_;  // exact: +-scale
    if (block_ == dim_) return;
    // Balanced random deal (see the file comment): target block c receives floor(B/m) or
    // ceil(B/m) outputs of every first-stage block, at random positions.
    const int m = dim_ / block_;
    auto shuffle = [&rng](int32_t* a, int n) {  // Fisher-Yates, i = n-1 down to 1
      for (int i = n - 1; i > 0; --i) {
        std::swap(a[i], a[static_cast<int>(rng.bounded(static_cast<uint64_t>(i) + 1))]);
      }
    };
    std::vector<int32_t> source(dim_);  // [m, B]: block b's coordinates in random order
    for (int i = 0; i < dim_; ++i) source[i] = i;
    for (int b = 0; b < m; ++b) shuffle(source.data() + b * block_, block_);
    std::vector<int32_t> block_order(m);
    for (int b = 0; b < m; ++b) block_order[b] = b;
    shuffle(block_order.data(), m);
    perm_.resize(dim_);
    for (int k = 0; k < dim_; ++k) perm_[k] = source[block_order[k % m] * block_ + k / m];
    for (int c = 0; c < m; ++c) shuffle(perm_.data() + c * block_, block_);
    inv_perm_.resize(dim_);
    for (int i = 0; i < dim_; ++i) inv_perm_[perm_[i]] = i;
    sign2_.resize(dim_);
    for (float& s : sign2_) s = rng.sign();
    post2_.resize(dim_);
    for (int i = 0; i < dim_; ++i) post2_[i] = sign2_[i] * scale_;
  }

  // Two-stage forward: Hb D1 from x into scratch t, gather back into x (P), then Hb D2 in
  // place. The inverse runs the mirror image with the inverse permutation.
  void hadamard_forward(float* x) const {
    if (block_ == dim_) return detail::fwht_kernel(x, x, dim_, sign1_.data(), nullptr, scale_);
    float stack[detail::kStackFloats];
    std::vector<float> heap;
    float* t = stack;
    if (dim_ > detail::kStackFloats) {
      heap.resize(dim_);
      t = heap.data();
    }
    detail::fwht_blocks(x, t, dim_, block_, sign1_.data(), nullptr, scale_);
    detail::gather(t, perm_.data(), x, dim_);
    detail::fwht_blocks(x, x, dim_, block_, sign2_.data(), nullptr, scale_);
  }

  void hadamard_inverse(float* x) const {
    if (block_ == dim_) return detail::fwht_kernel(x, x, dim_, nullptr, post1_.data(), 0.0f);
    float stack[detail::kStackFloats];
    std::vector<float> heap;
    float* t = stack;
    if (dim_ > detail::kStackFloats) {
      heap.resize(dim_);
      t = heap.data();
    }
    detail::fwht_blocks(x, t, dim_, block_, nullptr, post2_.data(), 0.0f);
    detail::gather(t, inv_perm_.data(), x, dim_);
    detail::fwht_blocks(x, x, dim_, block_, nullptr, post1_.data(), 0.0f);
  }

  // y = Q x (row dot products) or y = Q^T x (rows scaled and summed), vector by vector, in
  // float with a fixed order: the same result for one vector and for a batch.
  void dense_apply(float* x, int64_t n, bool inverse) const {
    std::vector<float> y(static_cast<size_t>(dim_));
    const size_t d = static_cast<size_t>(dim_);
    for (int64_t v = 0; v < n; ++v) {
      float* xv = x + v * dim_;
      if (inverse) {
        std::fill(y.begin(), y.end(), 0.0f);
        for (size_t j = 0; j < d; ++j) {
          const float xj = xv[j];
          const float* row = q_.data() + j * d;
          for (size_t i = 0; i < d; ++i) y[i] += row[i] * xj;
        }
      } else {
        for (size_t i = 0; i < d; ++i) {
          const float* row = q_.data() + i * d;
          float s = 0.0f;
          for (size_t j = 0; j < d; ++j) s += row[j] * xv[j];
          y[i] = s;
        }
      }
      std::copy(y.begin(), y.end(), xv);
    }
  }

  RotationKind kind_;
  int dim_;
  uint64_t seed_;
  int block_ = 0;
  float scale_ = 1.0f;
  std::vector<float> sign1_, sign2_;  // [dim] +-1
  std::vector<float> post1_, post2_;  // [dim] sign * scale, the inverse's post multipliers
  std::vector<int32_t> perm_;         // [dim] forward gather: (P u)[i] = u[perm_[i]]
  std::vector<int32_t> inv_perm_;     // [dim] its inverse
  std::vector<float> q_;              // [dim, dim] row-major, dense only
};

}  // namespace kvq
