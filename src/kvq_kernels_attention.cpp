// One of the two translation units of kvq's compiled-kernels mode (include/kvq/config.hpp,
// docs/architecture.md; KVQ_COMPILED_KERNELS in CMakeLists.txt): it defines the fused attention
// entry point (its AVX2/AVX-512 and scalar instances), which every other translation unit of
// kvq's tests, tools and benchmarks only declares (KVQ_EXTERN_KERNELS). The quantizers are in
// kvq_kernels_quantize.cpp, so the two compile in parallel. (An engine can use one file with
// KVQ_KERNELS_IMPLEMENTATION defined empty instead.)
#define KVQ_KERNELS_IMPLEMENTATION 2  // 2: the fused attention only
#include "kvq/attention/attention.hpp"
