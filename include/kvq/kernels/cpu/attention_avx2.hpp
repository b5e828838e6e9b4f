#pragma once
/// \file attention_avx2.hpp
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/simd/attention_avx2.hpp (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cpu/attention_avx2.hpp is deprecated: include kvq/simd/attention_avx2.hpp")
#endif
#include "kvq/simd/attention_avx2.hpp"
