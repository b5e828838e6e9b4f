#pragma once
/// \file attention_simd.hpp
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/simd/attention_simd.hpp (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cpu/attention_simd.hpp is deprecated: include kvq/simd/attention_simd.hpp")
#endif
#include "kvq/simd/attention_simd.hpp"
