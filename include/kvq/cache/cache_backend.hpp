#pragma once
/// \file cache_backend.hpp
/// Compatibility path: kvq::CacheBackend moved to kvq/eval/cache_backend.hpp (it depends on
/// attention/, which sits above cache/; nothing in cache/ includes this file). Include the new
/// path in new code.
#include "kvq/eval/cache_backend.hpp"
