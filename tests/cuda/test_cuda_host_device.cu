// CUDA translation unit: compiles kvq's umbrella header kvq/kvq.hpp with nvcc (every
// KVQ_HOST_DEVICE function seen by nvcc's host and device passes) and checks the host-device
// functions three ways, over subnormals, NaNs, infinities, ties and fp8 saturation:
//  - nvcc's host-pass code == the same functions compiled by g++ alone (the kvq_cuda_host_ref
//    shared library), bit for bit;
//  - named edge cases with their expected bits written out here;
//  - CUDA's own host conversions (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h);
//  - on a GPU, a kernel running the same functions == the host results (skipped, with a message,
//    when no GPU is visible: the device code is still compiled for sm_80 and sm_90).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <kvq/kvq.hpp>

#include "host_device_cases.hpp"

extern "C" void kvq_cuda_host_reference(const float* x, int64_t n, uint32_t* out);

namespace {

using kvq_cuda_test::kCols;

const char* const kColNames[kCols] = {
    "float_to_half_bits", "half_bits_to_float", "float_to_bf16_bits", "bf16_bits_to_float",
    "encode_e4m3 sat",    "encode_e4m3 nosat",  "encode_e5m2 sat",    "encode_e5m2 nosat",
    "decode_e4m3",        "decode_e5m2",        "fp8::encode(kind)",  "fp8::decode(kind)",
    "f16 type",           "bf16 type",          "max_finite",         "codebook_encode",
    "uniform_encode",     "uniform_decode",    "nuq_encode",        "nuq_decode",
    "fp4 e2m1",           "fp4 e8m0",          "fp4 mx",            "fp4 nv"};

float bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t ubits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/// Exact value of an fp8 code (positive finite codes only), from its fields.
double fp8_value(bool e5m2, int c) {
  const int mant = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
  const int e = c >> mant, m = c & ((1 << mant) - 1);
  return e == 0 ? std::ldexp(m, 1 - bias - mant) : std::ldexp((1 << mant) + m, e - bias - mant);
}

/// Inputs: named specials (zeros, float subnormals, NaNs with payloads and signs, infinities,
/// fp8/half limits and their neighbours), every bf16 pattern with tie and off-tie low bits
/// (every exponent, so every half/fp8 subnormal and normal range), the exact midpoints between
/// consecutive fp8 values (round-to-nearest-even ties), and a strided sweep of all float bits.
std::vector<float> inputs() {
  std::vector<float> x = {0.f,
                          -0.f,
                          bits(0x00000001u),  // smallest float subnormal
                          bits(0x807fffffu),  // largest negative float subnormal
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          bits(0x7fc00000u),  // quiet NaN
                          bits(0xffc00000u),  // negative quiet NaN
                          bits(0x7f800001u),  // signalling NaN
                          bits(0xff812345u),  // negative signalling NaN with payload
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          448.f,
                          464.f,
                          465.f,
                          -464.f,
                          480.f,
                          57344.f,
                          61439.f,
                          61440.f,
                          -61440.f,
                          65504.f,
                          65519.f,
                          65520.f,
                          1e9f,
                          std::ldexp(1.f, -9),
                          std::ldexp(1.f, -10),
                          std::ldexp(3.f, -11),
                          std::ldexp(1.f, -16),
                          std::ldexp(1.f, -17),
                          std::ldexp(3.f, -18),
                          std::ldexp(1.f, -24),
                          std::ldexp(1.f, -25),
                          std::ldexp(3.f, -26)};
  for (uint32_t i = 0; i < 65536u; ++i) {
    for (uint32_t low : {0x0000u, 0x8000u, 0x7fffu, 0x1000u, 0x3000u, 0x0fffu})
      x.push_back(bits(i << 16 | low));
  }
  for (bool e5m2 : {false, true}) {
    const int last = e5m2 ? 0x7B : 0x7E;
    for (int c = 0; c < last; ++c) {
      const float mid = static_cast<float>((fp8_value(e5m2, c) + fp8_value(e5m2, c + 1)) / 2);
      x.push_back(mid);
      x.push_back(-mid);
    }
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 40009u)
    x.push_back(bits(static_cast<uint32_t>(u)));
  return x;
}

std::vector<uint32_t> nvcc_host_results(const std::vector<float>& x) {
  std::vector<uint32_t> r(x.size() * kCols);
  for (size_t i = 0; i < x.size(); ++i) kvq_cuda_test::eval_all(x[i], r.data() + i * kCols);
  return r;
}

/// First mismatch between two result tables, or empty.
std::string first_mismatch(const std::vector<float>& x, const std::vector<uint32_t>& a,
                           const std::vector<uint32_t>& b) {
  for (size_t i = 0; i < x.size(); ++i)
    for (int c = 0; c < kCols; ++c)
      if (a[i * kCols + c] != b[i * kCols + c]) {
        char buf[200];
        std::snprintf(buf, sizeof buf, "%s differs for input bits 0x%08x: 0x%08x vs 0x%08x",
                      kColNames[c], ubits(x[i]), a[i * kCols + c], b[i * kCols + c]);
        return buf;
      }
  return "";
}

TEST(CudaHostDevice, NvccHostPassEqualsHostCompiler) {
  const auto x = inputs();
  std::vector<uint32_t> gxx(x.size() * kCols);
  kvq_cuda_host_reference(x.data(), static_cast<int64_t>(x.size()), gxx.data());
  const auto nv = nvcc_host_results(x);
  EXPECT_EQ(first_mismatch(x, nv, gxx), "");
  std::printf("  %zu inputs x %d host-device functions: nvcc host pass == g++\n", x.size(),
              static_cast<int>(kCols));
}

TEST(CudaHostDevice, NamedEdgeCases) {
  namespace fp8 = kvq::fp8;
  const float inf = std::numeric_limits<float>::infinity(), nan = bits(0x7fc00000u);
  // e4m3fn: max 448, no inf; 464 ties to even (448); saturation and NaN.
  EXPECT_EQ(fp8::encode_e4m3(448.f), 0x7E);
  EXPECT_EQ(fp8::encode_e4m3(464.f), 0x7E);
  EXPECT_EQ(fp8::encode_e4m3(465.f), 0x7E);
  EXPECT_EQ(fp8::encode_e4m3(465.f, false), 0x7F);
  EXPECT_EQ(fp8::encode_e4m3(inf), 0x7E);
  EXPECT_EQ(fp8::encode_e4m3(-inf), 0xFE);
  EXPECT_EQ(fp8::encode_e4m3(inf, false), 0x7F);
  EXPECT_EQ(fp8::encode_e4m3(-inf, false), 0xFF);
  EXPECT_EQ(fp8::encode_e4m3(nan), 0x7F);
  EXPECT_EQ(fp8::encode_e4m3(-nan), 0x7F);
  // e4m3 subnormals: 2^-9 is the smallest; half of it ties to even (0), 0.75 of it rounds up.
  EXPECT_EQ(fp8::encode_e4m3(std::ldexp(1.f, -9)), 0x01);
  EXPECT_EQ(fp8::encode_e4m3(std::ldexp(1.f, -10)), 0x00);
  EXPECT_EQ(fp8::encode_e4m3(-std::ldexp(1.f, -10)), 0x80);
  EXPECT_EQ(fp8::encode_e4m3(std::ldexp(3.f, -11)), 0x01);
  EXPECT_EQ(fp8::encode_e4m3(std::ldexp(3.f, -10)), 0x02);  // 1.5 steps: tie to even, up
  EXPECT_EQ(fp8::encode_e4m3(bits(0x00000001u)), 0x00);
  EXPECT_EQ(fp8::decode_e4m3(0x01), std::ldexp(1.f, -9));
  EXPECT_EQ(fp8::decode_e4m3(0x87), -std::ldexp(7.f, -9));
  EXPECT_EQ(fp8::decode_e4m3(0x7E), 448.f);
  EXPECT_EQ(ubits(fp8::decode_e4m3(0x7F)), 0x7fffffffu);
  EXPECT_EQ(ubits(fp8::decode_e4m3(0xFF)), 0x7fffffffu);
  // e5m2: max 57344, saturating mode clamps overflow and infinities to it, the other mode
  // gives inf from 61440 (the tie above 57344) up.
  EXPECT_EQ(fp8::encode_e5m2(57344.f), 0x7B);
  EXPECT_EQ(fp8::encode_e5m2(61439.f), 0x7B);
  EXPECT_EQ(fp8::encode_e5m2(61439.f, false), 0x7B);
  EXPECT_EQ(fp8::encode_e5m2(61440.f), 0x7B);
  EXPECT_EQ(fp8::encode_e5m2(61440.f, false), 0x7C);
  EXPECT_EQ(fp8::encode_e5m2(-1e9f), 0xFB);
  EXPECT_EQ(fp8::encode_e5m2(-1e9f, false), 0xFC);
  EXPECT_EQ(fp8::encode_e5m2(inf), 0x7B);
  EXPECT_EQ(fp8::encode_e5m2(-inf), 0xFB);
  EXPECT_EQ(fp8::encode_e5m2(inf, false), 0x7C);
  EXPECT_EQ(fp8::encode_e5m2(-inf, false), 0xFC);
  EXPECT_EQ(fp8::encode_e5m2(std::numeric_limits<float>::max()), 0x7B);
  EXPECT_EQ(fp8::encode_e5m2(nan), 0x7F);
  EXPECT_EQ(fp8::encode_e5m2(bits(0xff812345u)), 0x7F);
  // e5m2 subnormals: 2^-16 is the smallest.
  EXPECT_EQ(fp8::encode_e5m2(std::ldexp(1.f, -16)), 0x01);
  EXPECT_EQ(fp8::encode_e5m2(std::ldexp(1.f, -17)), 0x00);
  EXPECT_EQ(fp8::encode_e5m2(std::ldexp(3.f, -18)), 0x01);
  EXPECT_EQ(fp8::encode_e5m2(std::ldexp(3.f, -17)), 0x02);
  EXPECT_EQ(fp8::decode_e5m2(0x01), std::ldexp(1.f, -16));
  EXPECT_EQ(fp8::decode_e5m2(0x7B), 57344.f);
  EXPECT_EQ(fp8::decode_e5m2(0x7C), inf);
  EXPECT_EQ(fp8::decode_e5m2(0xFC), -inf);
  for (uint8_t c : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF})
    EXPECT_EQ(ubits(fp8::decode_e5m2(c)), 0x7fffffffu) << int(c);
  // binary16: max 65504, 65520 rounds to inf, subnormals from 2^-24, NaN stays NaN.
  EXPECT_EQ(kvq::float_to_half_bits(65504.f), 0x7BFF);
  EXPECT_EQ(kvq::float_to_half_bits(65519.f), 0x7BFF);
  EXPECT_EQ(kvq::float_to_half_bits(65520.f), 0x7C00);
  EXPECT_EQ(kvq::float_to_half_bits(-inf), 0xFC00);
  EXPECT_EQ(kvq::float_to_half_bits(std::ldexp(1.f, -24)), 0x0001);
  EXPECT_EQ(kvq::float_to_half_bits(std::ldexp(1.f, -25)), 0x0000);
  EXPECT_EQ(kvq::float_to_half_bits(std::ldexp(3.f, -26)), 0x0001);
  EXPECT_EQ(kvq::float_to_half_bits(std::ldexp(3.f, -25)), 0x0002);
  EXPECT_EQ(kvq::float_to_half_bits(-std::ldexp(1.f, -15)), 0x8200);
  EXPECT_EQ(kvq::float_to_half_bits(nan) & 0x7C00, 0x7C00);
  EXPECT_NE(kvq::float_to_half_bits(nan) & 0x03FF, 0);
  EXPECT_EQ(kvq::float_to_half_bits(bits(0xffc00000u)) & 0x8000, 0x8000);
  EXPECT_EQ(kvq::half_bits_to_float(0x0001), std::ldexp(1.f, -24));
  EXPECT_EQ(kvq::half_bits_to_float(0x83FF), -std::ldexp(1023.f, -24));
  EXPECT_EQ(kvq::half_bits_to_float(0x7C00), inf);
  EXPECT_TRUE(std::isnan(kvq::half_bits_to_float(0x7C01)));
  // bf16 keeps float's exponent range: float subnormals survive, NaN stays NaN.
  EXPECT_EQ(kvq::float_to_bf16_bits(bits(0x00010000u)), 0x0001);
  EXPECT_EQ(kvq::float_to_bf16_bits(bits(0x00018000u)), 0x0002);  // tie to even, up
  EXPECT_EQ(kvq::float_to_bf16_bits(bits(0x00008000u)), 0x0000);  // tie to even, down
  EXPECT_EQ(kvq::float_to_bf16_bits(inf), 0x7F80);
  EXPECT_EQ(kvq::float_to_bf16_bits(bits(0x7f800001u)) & 0x7FC0, 0x7FC0);  // quieted NaN
}

TEST(CudaHostDevice, MatchesCudaHostConversions) {
  const auto x = inputs();
  for (float v : x) {
    const uint32_t u = ubits(v);
    for (bool sat : {true, false}) {
      const __nv_saturation_t s = sat ? __NV_SATFINITE : __NV_NOSAT;
      ASSERT_EQ(kvq::fp8::encode_e4m3(v, sat), __nv_cvt_float_to_fp8(v, s, __NV_E4M3))
          << std::hex << u << " sat " << sat;
      ASSERT_EQ(kvq::fp8::encode_e5m2(v, sat), __nv_cvt_float_to_fp8(v, s, __NV_E5M2))
          << std::hex << u << " sat " << sat;
    }
    if (std::isnan(v)) continue;  // NaN payloads: kvq keeps F16C's, checked above and vs g++
    ASSERT_EQ(kvq::float_to_half_bits(v), static_cast<__half_raw>(__float2half_rn(v)).x)
        << std::hex << u;
    ASSERT_EQ(kvq::float_to_bf16_bits(v), static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(v)).x)
        << std::hex << u;
  }
  for (int c = 0; c < 256; ++c) {
    for (bool e5m2 : {false, true}) {
      __half_raw hr;
      hr.x =
          __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(c), e5m2 ? __NV_E5M2 : __NV_E4M3)
              .x;
      const float cuda = __half2float(__half(hr));
      const float ours = e5m2 ? kvq::fp8::decode_e5m2(static_cast<uint8_t>(c))
                              : kvq::fp8::decode_e4m3(static_cast<uint8_t>(c));
      ASSERT_EQ(ubits(ours), ubits(cuda)) << (e5m2 ? "e5m2 " : "e4m3 ") << c;
    }
  }
}

__global__ void eval_kernel(const float* x, uint32_t* out, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) kvq_cuda_test::eval_all(x[i], out + i * kCols);
}

TEST(CudaHostDevice, KernelEqualsHost) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    GTEST_SKIP() << "no CUDA device visible (cudaGetDeviceCount: "
                 << (err != cudaSuccess ? cudaGetErrorString(err) : "0 devices")
                 << "): the kernel was compiled for sm_80/sm_90 but not run; the host-side "
                    "checks (nvcc host pass vs g++, edge cases, CUDA host conversions) ran";
  }
  const auto x = inputs();
  const int64_t n = static_cast<int64_t>(x.size());
  float* d_x = nullptr;
  uint32_t* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_x, x.size() * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, x.size() * kCols * sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(d_x, x.data(), x.size() * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  eval_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(d_x, d_out, n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint32_t> dev(x.size() * kCols);
  ASSERT_EQ(cudaMemcpy(dev.data(), d_out, dev.size() * sizeof(uint32_t), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(d_x);
  cudaFree(d_out);
  EXPECT_EQ(first_mismatch(x, dev, nvcc_host_results(x)), "");
}

}  // namespace
