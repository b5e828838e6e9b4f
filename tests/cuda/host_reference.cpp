// The g++-compiled side of the CUDA test: every KVQ_HOST_DEVICE function evaluated by the host
// compiler alone. Built as a shared library with hidden visibility, so its inline kvq functions
// stay its own (a static link would merge them with nvcc's copies and compare a function with
// itself); only kvq_cuda_host_reference is exported.
#include <cstdint>

#include "host_device_cases.hpp"

extern "C" __attribute__((visibility("default"))) void kvq_cuda_host_reference(const float* x,
                                                                               int64_t n,
                                                                               uint32_t* out) {
  for (int64_t i = 0; i < n; ++i) kvq_cuda_test::eval_all(x[i], out + i * kvq_cuda_test::kCols);
}
