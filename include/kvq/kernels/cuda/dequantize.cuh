#pragma once
/// \file dequantize.cuh
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/cuda/dequantize.cuh (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cuda/dequantize.cuh is deprecated: include kvq/cuda/dequantize.cuh")
#endif
#include "kvq/cuda/dequantize.cuh"
