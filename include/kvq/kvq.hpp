#pragma once
/// \file kvq.hpp
/// Umbrella header: every public kvq header. Engines that care about compile time include the
/// layers they use instead (kvq/cache/kv_cache.hpp pulls in everything the cache needs; only
/// kvq/geometry/dense_rotation.hpp includes Eigen). The model runners (kvq/eval/..., the GGUF
/// reader kvq/io/gguf.hpp) are not part of the library: they live in extras/include, target
/// kvq::eval, and nothing here includes them (docs/architecture.md).
#include "kvq/config.hpp"
#include "kvq/core/bitpack.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/format/codebook.hpp"
#include "kvq/format/fp8.hpp"
#include "kvq/format/meta.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/simd/fp8_cpu.hpp"
#include "kvq/geometry/dense_rotation.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/geometry/rotation.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/quant/packed_view.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/accounting/accountant.hpp"
#include "kvq/policy/policy.hpp"
#include "kvq/policy/spec.hpp"
#include "kvq/policy/layout.hpp"  // page layouts for engine-owned pages
#include "kvq/policy/plan.hpp"    // the budget planner's allocation
#include "kvq/cache/kv_cache.hpp"
#include "kvq/attention/attention.hpp"
#include "kvq/attention/worker_pool.hpp"
#include "kvq/layout/page_layout.hpp"
#include "kvq/cache/page_arena.hpp"
#include "kvq/io/kv_dump.hpp"
#include "kvq/policy/calibrate.hpp"     // nuq codebooks learned (kvq::calibrate)
#include "kvq/io/calibration_file.hpp"  // calibration from KV dumps, calibration files
#include "kvq/io/npy.hpp"
#include "kvq/io/safetensors.hpp"
#include "kvq/io/archive.hpp"
