#pragma once
/// \file append.cuh
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/cuda/append.cuh (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cuda/append.cuh is deprecated: include kvq/cuda/append.cuh")
#endif
#include "kvq/cuda/append.cuh"
