#pragma once
/// \file kvq_cuda.cuh
/// kvq's CUDA kernel layer in one include (compile with nvcc): the device page description
/// (common.cuh), dequantize_pages (dequantize.cuh), quantize-append (append.cuh, AppendPlan)
/// and batched flash-decoding attention (decode_attention.cuh, DecodePlan). docs/cuda.md.
#include "kvq/cuda/common.cuh"
#include "kvq/cuda/dequantize.cuh"
#include "kvq/cuda/append.cuh"
#include "kvq/cuda/decode_attention.cuh"
