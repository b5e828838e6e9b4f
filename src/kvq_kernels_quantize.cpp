// One of the two translation units of kvq's compiled-kernels mode (include/kvq/config.hpp,
// docs/architecture.md; KVQ_COMPILED_KERNELS in CMakeLists.txt): it defines the quantize entry
// points that every other translation unit of kvq's tests, tools and benchmarks only declares
// (KVQ_EXTERN_KERNELS). (Two units so that they compile in parallel; an engine can use one file
// with KVQ_KERNELS_IMPLEMENTATION defined empty instead.)
#define KVQ_KERNELS_IMPLEMENTATION 3  // 3: the quantizers only
#include "kvq/quant/quantize.hpp"
