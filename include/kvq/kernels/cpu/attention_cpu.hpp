#pragma once
/// \file attention_cpu.hpp
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/attention/cpu/attention_cpu.hpp (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/cpu/attention_cpu.hpp is deprecated: include kvq/attention/cpu/attention_cpu.hpp")
#endif
#include "kvq/attention/cpu/attention_cpu.hpp"
