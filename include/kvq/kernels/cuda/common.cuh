#pragma once
/// \file common.cuh
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/cuda/common.cuh (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cuda/common.cuh is deprecated: include kvq/cuda/common.cuh")
#endif
#include "kvq/cuda/common.cuh"
