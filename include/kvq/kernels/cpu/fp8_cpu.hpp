#pragma once
/// \file fp8_cpu.hpp
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/simd/fp8_cpu.hpp (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cpu/fp8_cpu.hpp is deprecated: include kvq/simd/fp8_cpu.hpp")
#endif
#include "kvq/simd/fp8_cpu.hpp"
