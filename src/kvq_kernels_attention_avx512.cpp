// Compiled-kernels mode (see kvq_kernels_attention.cpp): the AVX-512 instance of the fused
// attention, in its own translation unit (empty when the target has no AVX-512).
#define KVQ_KERNELS_IMPLEMENTATION_ATTENTION_AVX512 1
#include "kvq/attention/cpu/attention_cpu.hpp"
