#pragma once
/// \file kvq_cuda.cuh
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/cuda/kvq_cuda.cuh (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cuda/kvq_cuda.cuh is deprecated: include kvq/cuda/kvq_cuda.cuh")
#endif
#include "kvq/cuda/kvq_cuda.cuh"
