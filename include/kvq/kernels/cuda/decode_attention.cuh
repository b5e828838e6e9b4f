#pragma once
/// \file decode_attention.cuh
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/cuda/decode_attention.cuh (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cuda/decode_attention.cuh is deprecated: include kvq/cuda/decode_attention.cuh")
#endif
#include "kvq/cuda/decode_attention.cuh"
