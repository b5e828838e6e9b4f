#pragma once
/// \file element.hpp
/// Forwarding header, kept for one release (kvq 0.1 -> 0.2): this header moved to
/// kvq/format/element.hpp (docs/architecture.md, "Moved headers"). Include the new path.
#if !defined(KVQ_NO_DEPRECATED_HEADER_WARNINGS)
#pragma message("kvq/kernels/common/element.hpp is deprecated: include kvq/format/element.hpp")
#endif
#include "kvq/format/element.hpp"
