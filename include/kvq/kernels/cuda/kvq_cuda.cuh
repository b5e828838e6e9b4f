#pragma once
/// \file kvq_cuda.cuh
/// kvq's CUDA kernel layer in one include (compile with nvcc): the device page description
/// (common.cuh), dequantize_pages (dequantize.cuh), quantize-append (append.cuh, AppendPlan)
/// and batched flash-decoding attention (decode_attention.cuh, DecodePlan). docs/cuda.md.
#include "kvq/kernels/cuda/common.cuh"
#include "kvq/kernels/cuda/dequantize.cuh"
#include "kvq/kernels/cuda/append.cuh"
#include "kvq/kernels/cuda/decode_attention.cuh"
