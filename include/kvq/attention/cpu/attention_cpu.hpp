#pragma once
/// \file attention_cpu.hpp
/// Fused CPU attention straight from packed KV: decode (one query per head) and chunked
/// prefill (n_q causal queries at the newest positions) over a sequence of segments — f32 rows
/// (sinks, residual window) and packed views (PackedView: a KVCache block, a page of the paged
/// layout, or a page an engine allocated). Only the segments are read, never QTensor or cache
/// internals, so the same kernels run on every storage.
///
/// Design (why it is fast):
///  - Keys are scored from their codes. Per-channel int keys fold the block's scales into the
///    query (q'_d = q_d s_d, once per token block) and add q.zero once per block; per-token
///    scales with one group per row (fp8 per head, int group 0) scale the dot product once per
///    row (plus zero * sum(q)); per-token groups narrower than the row dequantize 16 codes in a
///    register with one FMA shared by all query heads of the GQA group; Lloyd-Max keys are
///    scored against centroids with the query rotated once (q.k = (Rq).(Rk)), QJL adding
///    norm * c * (S Rq).sign; f32/f16/bf16 are read directly. No float key tensor is ever
///    written to memory (pre-RoPE keys are the exception: rows are decoded to floats in
///    blocks of 16 tokens x all heads (per-head path: one row), rotated at their positions
///    with a per-tile RoPE table, then scored).
///  - Values are accumulated from their codes: a row scale multiplies the softmax weight
///    (w = p s) and zero points accumulate as one scalar per row; Lloyd-Max values accumulate
///    in the rotated domain (w = p * norm) and are rotated back once per work unit.
///  - fp32 online softmax per 64-token tile; all query heads of a GQA group (and all queries of
///    a prefill block) are processed in one pass over each tile, so K/V bytes are read once per
///    group.
///  - Long contexts are split into fixed chunks of `split_tokens` processed independently and
///    merged in chunk order (flash-decoding); the split does not depend on the thread count,
///    and every chunk is computed by the same code whichever thread runs it, so the result is
///    bit-identical for any number of threads.
/// Three instruction sets share this code (simd/attention_simd.hpp): AVX-512 when
/// head_dim is a multiple of 16, AVX2 when a multiple of 8, else (and under KVQ_NO_SIMD) scalar.
/// When head_dim is a multiple of 16, AVX2 and AVX-512 builds alike run the Simd256
/// instance's own tile loop (Unit::run_tiles): tiles gathered over several
/// pages, all kv heads per tile, keys read token-major, odd-width codes unpacked once per tile,
/// rows prefetched ahead into L2, and the 16-channel register-blocked microkernels of
/// simd/attention_avx2.hpp (two 8-lane vectors per 16 channels on AVX2, one 16-lane
/// vector on AVX-512; value group scales folded into the weights; pre-RoPE keys decoded and
/// rotated to f32 rows first). Streams the microkernels do not read (QJL values, value groups
/// that are not a multiple of 16 channels) take the per-head path of the same instance.

#include "kvq/attention/cpu/dispatch.hpp"
