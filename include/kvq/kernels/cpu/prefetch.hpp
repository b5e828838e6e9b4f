#pragma once
/// \file prefetch.hpp
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/simd/prefetch.hpp (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cpu/prefetch.hpp is deprecated: include kvq/simd/prefetch.hpp")
#endif
#include "kvq/simd/prefetch.hpp"
