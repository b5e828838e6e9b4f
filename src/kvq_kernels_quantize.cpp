// One of the three translation units of kvq's compiled-kernels mode (include/kvq/config.hpp,
// KVQ_COMPILED_KERNELS in CMakeLists.txt): it defines the quantize entry points that every other
// translation unit of kvq's tests, tools and benchmarks only declares. (Two units so that they
// compile in parallel; an engine can use one file with KVQ_KERNELS_IMPLEMENTATION instead.)
#define KVQ_KERNELS_IMPLEMENTATION_QUANTIZE 1
#include "kvq/quant/quantize.hpp"
