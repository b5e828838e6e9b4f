// One of the two translation units of kvq's compiled-kernels mode (include/kvq/config.hpp,
// KVQ_COMPILED_KERNELS in CMakeLists.txt): it defines the attention entry points that every other
// translation unit of kvq's tests, tools and benchmarks only declares. (Two units so that they
// compile in parallel; an engine can use one file with KVQ_KERNELS_IMPLEMENTATION instead.)
#define KVQ_KERNELS_IMPLEMENTATION_ATTENTION 1
#include "kvq/kvq.hpp"
