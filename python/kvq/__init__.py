"""kvq: geometry-first KV-cache quantization, from Python.

A thin binding over kvq's C++ headers (nothing here reimplements a quantizer). Tensors are
``[tokens, heads, head_dim]`` numpy arrays or DLPack producers (a torch CPU tensor works) of
float32, float16 or bfloat16; results are numpy arrays (themselves DLPack producers:
``torch.from_dlpack(arr)`` shares their memory). Bad input raises :class:`kvq.Error` (a
``ValueError``) with kvq's message, or ``TypeError`` for a wrong type or dtype.

See docs/python.md in the kvq repository for the API.
"""
from __future__ import annotations

from ._loader import built_variants, load as _load, runnable_variants

_ext = _load()

Error = _ext.Error
QuantConfig = _ext.QuantConfig
Policy = _ext.Policy
QTensor = _ext.QTensor
KVCache = _ext.KVCache
attend_batch = _ext.attend_batch
MemoryReport = _ext.MemoryReport
parse_policy = _ext.parse_policy
parse_policies = _ext.parse_policies
presets = _ext.presets
quantize = _ext.quantize
account = _ext.account
effective_bits = _ext.effective_bits
load_kv_dump = _ext.load_kv_dump
save_kv_dump = _ext.save_kv_dump
calibrate = _ext.calibrate
needs_calibration = _ext.needs_calibration
save_calibration = _ext.save_calibration
load_calibration = _ext.load_calibration
simd_level = _ext.simd_level
worker_pools = _ext.worker_pools
use_worker_pools = _ext.use_worker_pools

__version__: str = _ext.__version__
#: The SIMD variant of the compiled module in use ("avx512", "avx2", "baseline" or "native").
variant: str = _ext.variant


def dequantize(q: QTensor, dtype: object = "float32", out: object = None):  # noqa: ANN201
    """Same as ``q.dequantize(dtype=dtype, out=out)``."""
    return q.dequantize(dtype=dtype, out=out)


__all__ = [
    "Error",
    "QuantConfig",
    "Policy",
    "QTensor",
    "KVCache",
    "attend_batch",
    "MemoryReport",
    "parse_policy",
    "parse_policies",
    "presets",
    "quantize",
    "dequantize",
    "account",
    "effective_bits",
    "load_kv_dump",
    "save_kv_dump",
    "calibrate",
    "needs_calibration",
    "save_calibration",
    "load_calibration",
    "simd_level",
    "worker_pools",
    "use_worker_pools",
    "variant",
    "built_variants",
    "runnable_variants",
    "__version__",
]
