#pragma once
// Every KVQ_HOST_DEVICE function of kvq, evaluated on one float input: written once, compiled
// three ways by the CUDA test (nvcc's device pass, nvcc's host pass, and g++ in the
// kvq_cuda_host_ref shared library), so the results can be compared bit for bit.
#include <cstdint>

#include <kvq/format/fp4.hpp>
#include <kvq/format/element.hpp>
#include <kvq/kvq.hpp>

namespace kvq_cuda_test {

/// Result columns per input (each a 32-bit word; floats as their bits).
enum Col : int {
  kHalf,           ///< float_to_half_bits(x)
  kHalfDecode,     ///< half_bits_to_float(u >> 16)
  kBf16,           ///< float_to_bf16_bits(x)
  kBf16Decode,     ///< bf16_bits_to_float(u >> 16)
  kE4m3Sat,        ///< encode_e4m3(x, saturate)
  kE4m3NoSat,      ///< encode_e4m3(x, no saturation)
  kE5m2Sat,        ///< encode_e5m2(x, saturate)
  kE5m2NoSat,      ///< encode_e5m2(x, no saturation)
  kE4m3Decode,     ///< decode_e4m3(u >> 24)
  kE5m2Decode,     ///< decode_e5m2(u >> 24)
  kKindEncode,     ///< encode(kind, ...) of both kinds and modes, one byte each
  kKindDecode,     ///< decode(kE5M2, u >> 24) through the run-time kind
  kF16Type,        ///< f16(x).to_float(), f16::from_bits, to_float/from_float<f16>
  kBf16Type,       ///< the same for bf16
  kMaxFinite,      ///< max_finite of both kinds, summed
  kCodebook,       ///< codebook_encode(3-bit Gaussian Lloyd-Max thresholds, x)
  kUniformEncode,  ///< uniform_encode(x, ...) asymmetric 4-bit and symmetric 8-bit, one byte each
  kUniformDecode,  ///< uniform_decode(u >> 24, ...)
  kNuqEncode,      ///< elem::nuq_encode(x, ...) 3-bit and 4-bit, one byte each
  kNuqDecode,      ///< elem::nuq_decode(u >> 28, ...) and nuq_params(-|x|, |x|) scale
  kE2m1,           ///< fp4::encode_e2m1(x) and decode_e2m1(u >> 28), mixed
  kE8m0,           ///< fp4::e8m0_floor(|x|), mx_scale_code(|x|), decode_e8m0(u >> 24)
  kMx,             ///< fp4::mx_encode(x, 127 / 120 / 140), mx_decode(u >> 28, u >> 24)
  kNv,             ///< fp4::nv_scale_code(|x|, 1 / 3e-3), nv_encode(x, 0.75), nv_decode, tensor scale
  kCols
};

/// The results of every host-device function for input x (float bits u).
KVQ_HOST_DEVICE void eval_all(float x, uint32_t* out) {
  using kvq::detail::f32_bits;
  namespace fp8 = kvq::fp8;
  const uint32_t u = f32_bits(x);
  const uint16_t hi16 = static_cast<uint16_t>(u >> 16);
  const uint8_t hi8 = static_cast<uint8_t>(u >> 24);
  out[kHalf] = kvq::float_to_half_bits(x);
  out[kHalfDecode] = f32_bits(kvq::half_bits_to_float(hi16));
  out[kBf16] = kvq::float_to_bf16_bits(x);
  out[kBf16Decode] = f32_bits(kvq::bf16_bits_to_float(hi16));
  out[kE4m3Sat] = fp8::encode_e4m3(x);
  out[kE4m3NoSat] = fp8::encode_e4m3(x, false);
  out[kE5m2Sat] = fp8::encode_e5m2(x);
  out[kE5m2NoSat] = fp8::encode_e5m2(x, false);
  out[kE4m3Decode] = f32_bits(fp8::decode_e4m3(hi8));
  out[kE5m2Decode] = f32_bits(fp8::decode_e5m2(hi8));
  out[kKindEncode] = static_cast<uint32_t>(fp8::encode(fp8::Fp8Kind::kE4M3, x)) |
                     static_cast<uint32_t>(fp8::encode(fp8::Fp8Kind::kE4M3, x, false)) << 8 |
                     static_cast<uint32_t>(fp8::encode(fp8::Fp8Kind::kE5M2, x)) << 16 |
                     static_cast<uint32_t>(fp8::encode(fp8::Fp8Kind::kE5M2, x, false)) << 24;
  out[kKindDecode] = f32_bits(fp8::decode(fp8::Fp8Kind::kE5M2, hi8)) ^
                     f32_bits(fp8::decode(fp8::Fp8Kind::kE4M3, hi8));
  const kvq::f16 h(x);
  out[kF16Type] = f32_bits(h.to_float()) ^ f32_bits(static_cast<float>(kvq::f16::from_bits(hi16))) ^
                  f32_bits(kvq::to_float(kvq::from_float<kvq::f16>(x))) ^ h.bits;
  const kvq::bf16 b(x);
  out[kBf16Type] = f32_bits(b.to_float()) ^
                   f32_bits(static_cast<float>(kvq::bf16::from_bits(hi16))) ^
                   f32_bits(kvq::to_float(kvq::from_float<kvq::bf16>(x))) ^
                   f32_bits(kvq::to_float(kvq::from_float<float>(x))) ^ b.bits;
  out[kMaxFinite] =
      f32_bits(fp8::max_finite(fp8::Fp8Kind::kE4M3) + fp8::max_finite(fp8::Fp8Kind::kE5M2));
  // 3-bit Lloyd-Max thresholds for N(0, 1) (shared/docs/reference.md), ascending.
  const float th[7] = {-1.7479f, -1.0500f, -0.5005f, 0.f, 0.5005f, 1.0500f, 1.7479f};
  out[kCodebook] = kvq::codebook_encode(th, 3, x);
  out[kUniformEncode] =
      static_cast<uint32_t>(kvq::uniform_encode(x, -1.5f, 1.0f / 0.2f, 0.f, 15.f)) |
      static_cast<uint32_t>(kvq::uniform_encode(x, 0.f, 1.0f / 0.03f, 127.f, 254.f)) << 8;
  out[kUniformDecode] = f32_bits(kvq::uniform_decode(hi8, 0.2f, -1.5f, 0.f)) ^
                        f32_bits(kvq::uniform_decode(hi8, 0.03f, 0.f, 127.f)) * 3u;
  // A non-uniform 4-bit codebook in [0, 1] and its midpoints; 3-bit uses its even levels.
  float lv4[16], th4[15], lv3[8], th3[7];
  for (int i = 0; i < 16; ++i) lv4[i] = static_cast<float>(i * i) / 225.f;
  for (int i = 0; i < 8; ++i) lv3[i] = lv4[2 * i];
  kvq::nuq_thresholds(lv4, 16, th4);
  kvq::nuq_thresholds(lv3, 8, th3);
  out[kNuqEncode] = static_cast<uint32_t>(kvq::elem::nuq_encode(th3, 3, x, -1.5f, 1.0f / 3.f)) |
                    static_cast<uint32_t>(kvq::elem::nuq_encode(th4, 4, x, 0.25f, 7.f)) << 8;
  kvq::elem::GroupParams gp;
  const float ax = x < 0.f ? -x : x;
  const auto st = kvq::elem::nuq_params(-ax, ax, true, &gp);
  out[kNuqDecode] = f32_bits(kvq::elem::nuq_decode(lv4, 4, static_cast<uint8_t>(u >> 28), 3.f, -1.5f)) ^
                    (f32_bits(gp.scale) + static_cast<uint32_t>(st)) * 5u;
  namespace fp4 = kvq::fp4;
  out[kE2m1] = static_cast<uint32_t>(fp4::encode_e2m1(x)) ^
               f32_bits(fp4::decode_e2m1(static_cast<uint8_t>(u >> 28))) * 7u;
  out[kE8m0] = static_cast<uint32_t>(fp4::e8m0_floor(ax)) |
               static_cast<uint32_t>(fp4::mx_scale_code(ax)) << 8 |
               (f32_bits(fp4::decode_e8m0(hi8)) ^ f32_bits(fp4::mx_inverse_scale(hi8 == 255 ? 0 : hi8))) << 16;
  out[kMx] = static_cast<uint32_t>(fp4::mx_encode(x, 127)) |
             static_cast<uint32_t>(fp4::mx_encode(x, 120)) << 4 |
             static_cast<uint32_t>(fp4::mx_encode(x, 140)) << 8 |
             f32_bits(fp4::mx_decode(static_cast<uint8_t>(u >> 28), hi8 == 255 ? 1 : hi8)) << 12;
  out[kNv] = static_cast<uint32_t>(fp4::nv_scale_code(ax, 1.f)) ^
             static_cast<uint32_t>(fp4::nv_scale_code(ax, 3e-3f)) << 8 ^
             static_cast<uint32_t>(fp4::nv_encode(x, 0.75f)) << 16 ^
             f32_bits(fp4::nv_decode(static_cast<uint8_t>(u >> 28), fp4::nv_element_scale(hi8, 3e-3f))) ^
             f32_bits(fp4::nv_tensor_scale_from_amax(ax));
}

}  // namespace kvq_cuda_test
