/// \file fuzz_packed.cpp
/// Fuzz target: the packed-block decoders (kvq::dequantize of every format) on arbitrary
/// packed bytes whose header passed validation — what a reader of stored or shipped blocks
/// (an archive, an offloaded page) hands to the kernels.
///
/// Input layout: 9 header bytes, then the payload.
///   0 format (mod 8; 240..255: nvfp4 even, mxfp4 odd)     1 bits selector          2 flags: bit0 symmetric, bit1 f32 meta,
///   3 group selector     4 tokens - 1 (mod 8)          bit2 qjl, bits 3-4 axis, bits 5-6
///                                                      outliers per vector (int/fp8/nuq)
///   5 heads - 1 (mod 2)  6 head_dim selector      7 seed selector   8 output kind
/// then, for nuq, one byte per codebook level (ascending steps), then the payload.
/// The config and shape are validated as kvq validates them (validate_config, packed_sizes,
/// the Hadamard size for Lloyd-Max); every buffer is sized by size_for() (checked against the
/// accountant) and filled from the payload (zeros once it runs out). Then:
///   - int, fp8 and nuq decode bit-identically to the scalar reference oracles (reference/),
///     with dense-and-sparse outliers written over their positions (any position outside
///     head_dim must be refused with kvq::Error);
///   - raw formats decode to the stored values;
///   - nvfp4 / mxfp4 decode to e2m1 value x block scale as reference/fp4_ref.hpp values them
///     (nvfp4 with the tensor scale of the seed selector), for any code and scale byte;
///   - fp16 and bf16 outputs equal the f32 output rounded, a strided (HND) output equals the
///     contiguous one, and a token range decoded alone (dequantize_tokens) equals its rows;
///   - the output is finite wherever the format guarantees it: finite metadata (fp16, or f32
///     below 1e15 so that no product can overflow) and, for fp8, codes that are not the
///     NaN/Inf encodings; for raw formats, finite stored values.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_util.hpp"
#include "kvq/accounting/accountant.hpp"
#include "kvq/core/half.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/format/nuq.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/reference/fp4_ref.hpp"
#include "kvq/reference/fp8_quant_ref.hpp"
#include "kvq/reference/nuq_ref.hpp"
#include "kvq/reference/uniform_ref.hpp"

namespace {

using kvq::fuzz::same_float;

constexpr int64_t kHeadDims[] = {1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 64, 96, 128};
constexpr uint64_t kSeeds[] = {0x6b7671u, 1, 0xdeadbeefcafef00dULL, 42};

/// Every value of a metadata buffer is finite and small enough that code * scale + zero (or
/// norm * rotated codebook value + QJL term) cannot overflow f32.
bool meta_bounded(const kvq::MetaBuffer& m) {
  for (std::size_t i = 0; i < m.size(); ++i) {
    const float v = m.get(i);
    if (!std::isfinite(v) || std::fabs(v) > 1e15f) return false;
  }
  return true;
}

bool fp8_codes_finite(const kvq::QTensor& q) {
  for (uint8_t c : q.codes) {
    const float v =
        q.config.format == kvq::Format::kE5M2 ? kvq::fp8::decode_e5m2(c) : kvq::fp8::decode_e4m3(c);
    if (!std::isfinite(v)) return false;
  }
  return true;
}

bool outliers_finite(const kvq::QTensor& q) {
  for (std::size_t i = 0; i + 1 < q.outlier_values.size(); i += 2) {
    uint16_t h;
    std::memcpy(&h, q.outlier_values.data() + i, 2);
    if (!std::isfinite(kvq::half_bits_to_float(h))) return false;
  }
  return true;
}

bool raw_codes_finite(const kvq::QTensor& q) {
  const std::size_t n = static_cast<std::size_t>(q.shape.numel());
  for (std::size_t i = 0; i < n; ++i) {
    float v;
    if (q.config.format == kvq::Format::kF32) {
      std::memcpy(&v, q.codes.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, q.codes.data() + 2 * i, 2);
      v = q.config.format == kvq::Format::kF16 ? kvq::half_bits_to_float(h)
                                               : kvq::bf16_bits_to_float(h);
    }
    if (!std::isfinite(v)) return false;
  }
  return true;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 9) return 0;
  kvq::fuzz::ByteReader in(data, size);
  kvq::QuantConfig c;
  const uint8_t format_byte = in.u8();
  c.format = static_cast<kvq::Format>(format_byte % 8);
  if (format_byte >= 240) c.format = format_byte % 2 ? kvq::Format::kMxfp4 : kvq::Format::kNvfp4;
  const uint8_t bits_sel = in.u8();
  const uint8_t flags = in.u8();
  const uint8_t group_sel = in.u8();
  kvq::Shape s;
  s.tokens = 1 + in.u8() % 8;
  s.heads = 1 + in.u8() % 2;
  s.head_dim = kHeadDims[in.u8() % (sizeof(kHeadDims) / sizeof(kHeadDims[0]))];
  const uint8_t seed_sel = in.u8();
  c.seed = kSeeds[seed_sel % 4];
  const uint8_t out_kind = in.u8();

  static constexpr int kIntBits[] = {2, 3, 4, 8};
  c.bits = c.format == kvq::Format::kInt        ? kIntBits[bits_sel % 4]
           : c.format == kvq::Format::kLloydMax ? 1 + bits_sel % 4
           : c.format == kvq::Format::kNuq      ? 2 + bits_sel % 3
                                                : 8;
  c.symmetric = flags & 1;
  c.meta = (flags & 2) ? kvq::MetaDType::kF32 : kvq::MetaDType::kF16;
  c.qjl = c.format == kvq::Format::kLloydMax && (flags & 4);
  c.axis = static_cast<kvq::Axis>((flags >> 3) & 3);
  const bool dense_sparse = c.format == kvq::Format::kInt || c.format == kvq::Format::kNuq ||
                            c.format == kvq::Format::kE4M3 || c.format == kvq::Format::kE5M2;
  if (dense_sparse) c.outliers = (flags >> 5) & 3;  // 0..3 exact entries per vector
  if (c.format == kvq::Format::kNuq) {  // an ascending codebook derived from the payload
    c.nuq_ready = true;
    float level = -1.f;
    for (int i = 0; i < (1 << c.bits); ++i) {
      c.nuq_levels[static_cast<std::size_t>(i)] = level;
      level += static_cast<float>(1 + in.u8()) / 128.f;
    }
  }
  // The group: a divisor of the axis extent (or 0, "whole extent", where the format allows it).
  const int64_t extent = c.axis == kvq::Axis::kToken ? s.head_dim : s.tokens;
  std::vector<int64_t> divisors;
  if (c.format != kvq::Format::kInt) divisors.push_back(0);
  for (int64_t g = 1; g <= extent; ++g)
    if (extent % g == 0) divisors.push_back(g);
  c.group = divisors[group_sel % divisors.size()];
  if (kvq::is_fp4(c.format)) {  // the block is the format; head_dim must hold whole blocks
    c.bits = 4;
    c.axis = kvq::Axis::kToken;
    c.group = kvq::fp4_block(c.format);
    static constexpr float kTensorScales[] = {1.0f, 0.015625f, 3.0f, 1e-30f};
    if (c.format == kvq::Format::kNvfp4) c.fp4_tensor_scale = kTensorScales[seed_sel % 4];
  }

  try {  // validation, as kvq does it before it stores or reads a block
    if (c.format == kvq::Format::kNuq) {
      kvq::check_nuq_levels(c.nuq_levels.data(), c.bits);
    } else {
      kvq::validate_config(c, "fuzzed", true);
    }
    (void)kvq::packed_sizes(c, s);  // bits, group box, sizes
    if (c.format == kvq::Format::kLloydMax) kvq::detail::check_lloyd_max(c, s);
  } catch (const kvq::Error&) {
    return 0;
  }

  // Buffers sized exactly as kvq sizes a block of (c, s), filled from the payload.
  kvq::QTensor q;
  kvq::size_for(q, c, s);
  in.fill(q.codes.data(), q.codes.size());
  in.fill(q.scales.data(), q.scales.bytes());
  in.fill(q.zeros.data(), q.zeros.bytes());
  in.fill(q.norms.data(), q.norms.bytes());
  in.fill(q.qjl_signs.data(), q.qjl_signs.size());
  in.fill(q.qjl_norms.data(), q.qjl_norms.bytes());
  in.fill(q.outlier_values.data(), q.outlier_values.size());
  in.fill(q.outlier_pos.data(), q.outlier_pos.size());
  KVQ_FUZZ_CHECK(q.breakdown() == kvq::account(c, s));

  const std::size_t n = static_cast<std::size_t>(s.numel());
  std::vector<float> out(n);
  try {
    kvq::dequantize(q, kvq::KVView<float>::nhd(out.data(), s.tokens, s.heads, s.head_dim));
  } catch (const kvq::Error&) {
    // A clean refusal is allowed: an outlier position outside head_dim is data corruption the
    // decoder names. (corpus/packed/crash-packed-lm-head-dim-1 was the other case: Lloyd-Max
    // with head_dim 1 passed check_lloyd_max, which now refuses head_dim < 3.)
    return 0;
  }

  // Oracles: the scalar reference decoders for the dense part, then each outlier entry written
  // over its position in order (fp16 value, exactly).
  if (dense_sparse) {
    kvq::QTensor dense = q;
    dense.config.outliers = 0;
    dense.outlier_values.clear();
    dense.outlier_pos.clear();
    std::vector<float> ref(n);
    const auto rv = kvq::KVView<float>::nhd(ref.data(), s.tokens, s.heads, s.head_dim);
    if (c.format == kvq::Format::kInt) {
      kvq::reference::dequantize_uniform(dense, rv);
    } else if (c.format == kvq::Format::kNuq) {
      kvq::reference::dequantize_nuq(dense, rv);
    } else {
      kvq::reference::dequantize_fp8(dense, rv);
    }
    const int64_t k = c.outliers, D = s.head_dim;
    const int pb = kvq::outlier_pos_bytes(D);
    for (int64_t v = 0; v < s.tokens * s.heads; ++v)
      for (int64_t j = 0; j < k; ++j) {
        uint16_t hb;
        std::memcpy(&hb, q.outlier_values.data() + 2 * (v * k + j), 2);
        const uint8_t* p = q.outlier_pos.data() + pb * (v * k + j);
        const int64_t d = pb == 1 ? p[0] : (p[0] | (p[1] << 8));
        KVQ_FUZZ_CHECK(d < D);  // dequantize refused anything else
        ref[static_cast<std::size_t>(v * D + d)] = kvq::half_bits_to_float(hb);
      }
    for (std::size_t i = 0; i < n; ++i) KVQ_FUZZ_CHECK(same_float(out[i], ref[i]));
  }
  if (kvq::is_fp4(c.format)) {  // value(code) x block scale, from the oracle's definitions
    const auto blk = static_cast<std::size_t>(kvq::fp4_block(c.format));
    for (std::size_t i = 0; i < n; ++i) {
      const auto code = static_cast<uint8_t>((q.codes[i / 2] >> (4 * (i % 2))) & 0xf);
      const uint8_t sc = q.scales.raw()[i / blk];
      float want;
      if (c.format == kvq::Format::kMxfp4) {
        want = static_cast<float>(kvq::reference::e2m1_value(code) * kvq::reference::e8m0_value(sc));
      } else {
        const float es = static_cast<float>(
            kvq::reference::fp8_value(kvq::fp8::Fp8Kind::kE4M3, sc) * c.fp4_tensor_scale);
        want = static_cast<float>(kvq::reference::e2m1_value(code) * es);
      }
      KVQ_FUZZ_CHECK(same_float(out[i], want));
    }
  }
  if (c.is_raw()) {
    for (std::size_t i = 0; i < n; ++i) {
      float v;
      if (c.format == kvq::Format::kF32) {
        std::memcpy(&v, q.codes.data() + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, q.codes.data() + 2 * i, 2);
        v = c.format == kvq::Format::kF16 ? kvq::half_bits_to_float(h) : kvq::bf16_bits_to_float(h);
      }
      KVQ_FUZZ_CHECK(same_float(out[i], v));
    }
  }

  // Other output types and layouts agree with the f32 contiguous output.
  switch (out_kind % 4) {
    case 1: {
      std::vector<kvq::f16> h(n);
      kvq::dequantize(q, kvq::KVView<kvq::f16>::nhd(h.data(), s.tokens, s.heads, s.head_dim));
      for (std::size_t i = 0; i < n; ++i)
        KVQ_FUZZ_CHECK(same_float(static_cast<float>(h[i]), static_cast<float>(kvq::f16(out[i]))));
      break;
    }
    case 2: {
      std::vector<kvq::bf16> h(n);
      kvq::dequantize(q, kvq::KVView<kvq::bf16>::nhd(h.data(), s.tokens, s.heads, s.head_dim));
      for (std::size_t i = 0; i < n; ++i)
        KVQ_FUZZ_CHECK(same_float(static_cast<float>(h[i]), static_cast<float>(kvq::bf16(out[i]))));
      break;
    }
    case 3: {
      std::vector<float> hnd(n);
      kvq::dequantize(q, kvq::KVView<float>::hnd(hnd.data(), s.heads, s.tokens, s.head_dim));
      for (int64_t t = 0; t < s.tokens; ++t)
        for (int64_t h = 0; h < s.heads; ++h)
          for (int64_t d = 0; d < s.head_dim; ++d)
            KVQ_FUZZ_CHECK(
                same_float(hnd[static_cast<std::size_t>((h * s.tokens + t) * s.head_dim + d)],
                           out[static_cast<std::size_t>((t * s.heads + h) * s.head_dim + d)]));
      break;
    }
    default:
      break;
  }

  // A token range [t0, t1) decoded on its own (what paged and range reads do) equals those
  // rows of the whole decode.
  {
    const int64_t t0 = (out_kind >> 2) % s.tokens;
    const int64_t t1 = t0 + 1 + (out_kind >> 5) % (s.tokens - t0);
    const int64_t row = s.heads * s.head_dim;
    std::vector<float> part(static_cast<std::size_t>((t1 - t0) * row));
    kvq::QuantWorkspace ws;
    kvq::dequantize_tokens(kvq::view_of(q), t0,
                           kvq::KVView<float>::nhd(part.data(), t1 - t0, s.heads, s.head_dim), ws);
    for (std::size_t i = 0; i < part.size(); ++i)
      KVQ_FUZZ_CHECK(same_float(part[i], out[static_cast<std::size_t>(t0 * row) + i]));
  }

  // Finiteness where the format guarantees it.
  bool guaranteed = false;
  switch (c.format) {
    case kvq::Format::kF32:
    case kvq::Format::kF16:
    case kvq::Format::kBF16:
      guaranteed = raw_codes_finite(q);
      break;
    case kvq::Format::kInt:
    case kvq::Format::kNuq:
      guaranteed = meta_bounded(q.scales) && meta_bounded(q.zeros) && outliers_finite(q);
      break;
    case kvq::Format::kE4M3:
    case kvq::Format::kE5M2:
      guaranteed = meta_bounded(q.scales) && fp8_codes_finite(q) && outliers_finite(q);
      break;
    case kvq::Format::kLloydMax:
      guaranteed = meta_bounded(q.norms) && meta_bounded(q.qjl_norms);
      break;
    case kvq::Format::kNvfp4:
    case kvq::Format::kMxfp4: {
      // nvfp4: every e4m3 scale but the NaN encodings decodes finite (448 x 6 x g stays finite
      // for the tensor scales used here); mxfp4: e8m0 codes up to 252, the largest the
      // quantizer writes (6 x 2^125); 253 and 254 overflow to inf for the larger codes, 255 is NaN.
      guaranteed = true;
      for (uint8_t sc : q.scales.raw())
        guaranteed = guaranteed && (c.format == kvq::Format::kMxfp4 ? sc <= 252
                                                                    : (sc & 0x7f) != 0x7f);
      break;
    }
  }
  if (guaranteed) {
    for (float v : out) KVQ_FUZZ_CHECK(std::isfinite(v));
  }
#ifdef KVQ_FUZZ_TRACE  // which seeds reach the end (checking a corpus by hand)
  std::fprintf(stderr, "decoded %s %s\n", c.name().c_str(), s.str().c_str());
#endif
  return 0;
}
