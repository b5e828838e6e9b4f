// One of the translation units of kvq's compiled-kernels mode (include/kvq/config.hpp,
// KVQ_COMPILED_KERNELS in CMakeLists.txt): it defines the fused attention entry point and its
// AVX2 and scalar instances, which every other translation unit of kvq's tests, tools and
// benchmarks only declares; the AVX-512 instance is in kvq_kernels_attention_avx512.cpp and the
// quantizers in kvq_kernels_quantize.cpp, so the three compile in parallel. (An engine can use
// one file with KVQ_KERNELS_IMPLEMENTATION instead.)
#define KVQ_KERNELS_IMPLEMENTATION_ATTENTION 1
#define KVQ_KERNELS_SEPARATE_AVX512 1
#include "kvq/attention/attention.hpp"
