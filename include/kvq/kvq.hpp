#pragma once
/// \file kvq.hpp
/// Umbrella header: everything a consumer needs.
#include "kvq/config.hpp"
#include "kvq/core/bitpack.hpp"
#include "kvq/core/error.hpp"
#include "kvq/core/half.hpp"
#include "kvq/core/tensor.hpp"
#include "kvq/format/uniform.hpp"
#include "kvq/geometry/grouping.hpp"
#include "kvq/quant/qtensor.hpp"
#include "kvq/quant/quantize.hpp"
#include "kvq/accounting/accountant.hpp"
