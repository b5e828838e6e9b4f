// CUDA translation unit: includes kvq's public headers and calls KVQ_HOST_DEVICE functions
// from a kernel; results must equal the host calls bit for bit.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include <kvq/core/half.hpp>
#include <kvq/format/fp8.hpp>

namespace {

__global__ void convert_kernel(const float* in, uint16_t* half_out, uint8_t* e4m3_out,
                               uint8_t* e5m2_out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    half_out[i] = kvq::float_to_half_bits(in[i]);
    e4m3_out[i] = kvq::fp8::encode_e4m3(in[i]);
    e5m2_out[i] = kvq::fp8::encode_e5m2(in[i]);
  }
}

bool gpu_visible() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

TEST(CudaHostDevice, KernelMatchesHost) {
  if (!gpu_visible()) GTEST_SKIP() << "no CUDA device visible; kernel compiled but not run";
  const int n = 1 << 16;
  std::vector<float> x(n);
  for (int i = 0; i < n; ++i) x[i] = (i - n / 2) * 0.0137f;
  float* d_in = nullptr;
  uint16_t* d_h = nullptr;
  uint8_t *d_a = nullptr, *d_b = nullptr;
  ASSERT_EQ(cudaMalloc(&d_in, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_h, n * sizeof(uint16_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_a, n), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_b, n), cudaSuccess);
  cudaMemcpy(d_in, x.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  convert_kernel<<<(n + 255) / 256, 256>>>(d_in, d_h, d_a, d_b, n);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<uint16_t> h(n);
  std::vector<uint8_t> a(n), b(n);
  cudaMemcpy(h.data(), d_h, n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
  cudaMemcpy(a.data(), d_a, n, cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), d_b, n, cudaMemcpyDeviceToHost);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(h[i], kvq::float_to_half_bits(x[i])) << i;
    ASSERT_EQ(a[i], kvq::fp8::encode_e4m3(x[i])) << i;
    ASSERT_EQ(b[i], kvq::fp8::encode_e5m2(x[i])) << i;
  }
  cudaFree(d_in);
  cudaFree(d_h);
  cudaFree(d_a);
  cudaFree(d_b);
}

}  // namespace
