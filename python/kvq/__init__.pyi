"""Type stubs of kvq, the Python binding of kvq's C++ headers (see docs/python.md).

Tensors ("ArrayLike" below) are numpy arrays or any DLPack producer (e.g. a torch CPU tensor)
of float32, float16 or bfloat16, laid out [tokens, heads, head_dim] with any non-negative,
non-overlapping strides. Results are numpy arrays, themselves DLPack producers.
"""
import os
from typing import Any, Literal, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

ArrayLike = Any  # numpy.ndarray or an object with __dlpack__ / __dlpack_device__
DTypeLike = Union[str, np.dtype, type, Any]  # "float32" / "float16", numpy or torch dtypes
Shape3 = Sequence[int]  # (tokens, heads, head_dim)
ByteBreakdown = dict[str, int]  # codes, scales, zeros, norms, residual, outliers, codebooks, ..., total

__version__: str
#: SIMD variant of the compiled module in use: "avx512", "avx2", "baseline" or "native".
variant: str

class Error(ValueError):
    """Bad input reported by kvq; str(e) is kvq's message ("kvq: <kind>: ...")."""

    #: invalid_argument, shape_mismatch, non_finite, out_of_range, parse, io or unsupported
    kind: str

def simd_level() -> str:
    """SIMD level kvq's fast paths were compiled for in this module: avx512, avx2 or scalar."""

def worker_pools() -> dict[int, int]:
    """{threads: calls served} of this process's shared worker pools. An attention call with
    threads=n >= 2 runs on a pool of n workers started by the first such call (not on n - 1
    threads started per call), unless another Python thread is using that pool; a fork()ed
    child starts pools of its own."""

def use_worker_pools(on: bool) -> bool:
    """Whether attention calls with threads >= 2 run on the shared worker pools (default True)
    or start threads of their own per call; returns the previous setting. Pools already started
    keep their sleeping workers."""

def built_variants() -> list[str]:
    """SIMD variants present in this installation, best first."""

def runnable_variants() -> list[str]:
    """SIMD variants this CPU and OS can run, best first."""

class QuantConfig:
    """How one tensor is stored: format, bits, grouping axis and size, metadata dtype.

    ``QuantConfig("int4/channel/g32")`` parses one term of the spec grammar (docs/policy.md);
    the static builders make the same configs from arguments. Configs are immutable and compare
    equal when they store tensors identically.
    """

    def __init__(self, spec: str) -> None: ...
    @staticmethod
    def int(bits: int, axis: str = "token", group: int = 32, symmetric: bool = False,
            f32meta: bool = False) -> QuantConfig:
        """Grouped uniform integer (2, 3, 4 or 8 bits), asymmetric or symmetric (absmax)."""
    @staticmethod
    def fp8(format: Literal["e4m3", "e5m2"] = "e4m3", axis: str = "head", group: int = 0,
            f32meta: bool = False) -> QuantConfig:
        """Scaled FP8, one scale per token / head / tensor group (group 0: whole extent)."""
    @staticmethod
    def fp4(format: Literal["nvfp4", "mxfp4"] = "nvfp4", tensor_scale: float = 1.0) -> QuantConfig:
        """FP4 blocks along head_dim: nvfp4 (e2m1 + e4m3 scale per 16, fp32 tensor decode scale)
        or mxfp4 (e2m1 + e8m0 scale per 32; no tensor scale)."""
    @staticmethod
    def raw(format: Literal["f32", "f16", "bf16"]) -> QuantConfig:
        """Unquantized storage."""
    @staticmethod
    def lloyd_max(bits: int, qjl: bool = False, f32meta: bool = False) -> QuantConfig:
        """Rotate + Lloyd-Max codebook (1..4 bits) with a per-vector norm; qjl adds the residual."""
    @property
    def format(self) -> str:
        """f32, f16, bf16, int, sint, e4m3, e5m2, lm, nuq, nvfp4 or mxfp4."""
    @property
    def bits(self) -> int: ...
    @property
    def symmetric(self) -> bool: ...
    @property
    def axis(self) -> str:
        """token, channel, head or tensor."""
    @property
    def group(self) -> int: ...
    @property
    def meta(self) -> str:
        """Metadata storage: f16 or f32."""
    @property
    def fp8_margin(self) -> float: ...
    @property
    def fp4_tensor_scale(self) -> float:
        """nvfp4: the per-tensor fp32 decode scale (1.0 unless calibrated)."""
    @property
    def qjl(self) -> bool: ...
    @property
    def rotate(self) -> bool:
        """int / fp8 / FP4 with /rot: every head vector rotated by the seeded Hadamard rotation
        before quantizing (Lloyd-Max always rotates; docs/formats.md)."""
    @property
    def outliers(self) -> int:
        """Dense-and-sparse outliers kept exactly per vector (/out<k>); 0 when none or a percent."""
    @property
    def outlier_pct(self) -> float:
        """Outliers as a percent of head_dim (/out<P>%); 0 when given as a count."""
    @property
    def nuq_ready(self) -> bool:
        """nuq: whether the config carries a calibrated codebook (kvq.calibrate)."""
    @property
    def nuq_levels(self) -> Optional[list[float]]:
        """nuq: the calibrated codebook (2^bits ascending levels in [0, 1]); None otherwise."""
    @property
    def seed(self) -> int: ...
    @property
    def name(self) -> str:
        """Short name, e.g. int4/token/g32."""
    @property
    def spec(self) -> str:
        """Canonical spec term; QuantConfig(c.spec) == c."""
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

class Policy:
    """A whole model's cache policy (preset or fields; grammar in docs/policy.md)."""

    def __init__(self, spec: str) -> None: ...
    @property
    def key(self) -> QuantConfig: ...
    @property
    def value(self) -> QuantConfig: ...
    @property
    def residual(self) -> int:
        """Newest tokens kept in float32."""
    @property
    def sinks(self) -> int:
        """First tokens kept in float32 forever."""
    @property
    def skip_first(self) -> int: ...
    @property
    def skip_last(self) -> int: ...
    @property
    def skip_config(self) -> QuantConfig: ...
    @property
    def overrides(self) -> dict[int, tuple[QuantConfig, QuantConfig]]: ...
    @property
    def spec(self) -> str:
        """Canonical spec; parse_policy(p.spec) == p."""
    def key_for(self, layer: int, n_layers: int) -> QuantConfig: ...
    def value_for(self, layer: int, n_layers: int) -> QuantConfig: ...
    def skips(self, layer: int, n_layers: int) -> bool: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

def attend_batch(caches: Sequence[KVCache], layer: int, q: ArrayLike,
                 queries: Optional[Sequence[int]] = None, causal: bool = True, *,
                 scale: float = 0.0, softcap: float = 0.0, window: int = 0,
                 positions: Optional[ArrayLike] = None, mask: Optional[ArrayLike] = None,
                 sinks: Optional[ArrayLike] = None, threads: int = 1, split_tokens: int = 0,
                 return_lse: bool = False, dot: str = "exact") -> Any:
    """Attention for a batch of sequences, one cache each, in one call (kvq::attend_batch over
    kvq::CacheBatch): q is [sum(queries), n_heads, head_dim], sequence s owning queries[s]
    rows (default one each: a decode step). Every sequence's rows equal caches[s].attend(...)
    bit for bit; a cache with no tokens in `layer` gives zeros. The options are those of
    KVCache.attend, indexed by the global query row (mask columns: positions within the
    row's sequence). Releases the GIL."""


def parse_policy(spec: str) -> Policy:
    """Parses a policy spec ("k8v4", "kivi2,residual=128", "k=int4/channel/g32,v=int4/token")."""

def parse_policies(specs: str) -> list[Policy]:
    """Parses "spec1;spec2;..." (the tools' --policy argument)."""

def presets() -> list[tuple[str, str, str]]:
    """Every preset as (name, spec, description)."""

class QTensor:
    """A packed, quantized tensor: codes plus metadata, exactly as the C++ library stores it."""

    def __init__(self) -> None:
        """An empty tensor, for quantize(..., out=q)."""
    @property
    def config(self) -> QuantConfig: ...
    @property
    def shape(self) -> tuple[int, int, int]: ...
    @property
    def nbytes(self) -> int:
        """Stored bytes (codes + every byte of metadata); equals account(config, shape)."""
    @property
    def effective_bits(self) -> float:
        """8 * nbytes / elements."""
    def breakdown(self) -> ByteBreakdown:
        """Stored bytes by kind."""
    def buffers(self) -> dict[str, bytes]:
        """Copies of the packed arrays: codes, scales, zeros, norms, qjl_signs, qjl_norms,
        outlier_values (fp16 bits) and outlier_pos (uint8, or little-endian uint16 when
        head_dim > 256), each [tokens, heads, k] for /out<k> configs. Their lengths add up to
        nbytes."""
    def dequantize(self, dtype: DTypeLike = "float32",
                   out: Optional[ArrayLike] = None) -> npt.NDArray[Any]:
        """Reconstructs the tensor as a new float32/float16 numpy array [tokens, heads,
        head_dim], or into `out` (a writable float32/float16/bfloat16 array or DLPack tensor of
        the same shape, any strides), which is then returned. Releases the GIL."""

def quantize(x: ArrayLike, config: Union[QuantConfig, str],
             out: Optional[QTensor] = None) -> QTensor:
    """Stores `x` ([tokens, heads, head_dim], float32/float16/bfloat16) under `config` (a
    QuantConfig or one spec term such as "int4/token/g32"). With `out`, its buffers are reused
    (no allocation when the shape repeats) and `out` is returned. Raises kvq.Error for
    NaN/inf, shapes that do not fit the groups, values out of fp16 range; TypeError for a
    wrong type or dtype. Releases the GIL."""

def dequantize(q: QTensor, dtype: DTypeLike = "float32",
               out: Optional[ArrayLike] = None) -> npt.NDArray[Any]:
    """Same as q.dequantize(dtype, out)."""

def account(config: Union[QuantConfig, str], shape: Shape3) -> ByteBreakdown:
    """Bytes storing a tensor of `shape` under `config` takes, by kind (the accountant)."""

def effective_bits(config: Union[QuantConfig, str], shape: Shape3) -> float:
    """Bits per value of `config` on `shape`, metadata included (0 for an empty shape)."""

class MemoryReport:
    """What a KVCache stores, by layer and kind (str() prints kvq's table)."""

    @property
    def total(self) -> int:
        """Stored bytes: codes, metadata, f32 sinks, residual window (and rollback copy)."""
    @property
    def overhead(self) -> int:
        """Bookkeeping around the data (block headers, unused capacity)."""
    @property
    def scratch(self) -> int:
        """Reusable scratch buffers of the cache (0 where the kvq version has none)."""
    @property
    def elements(self) -> int: ...
    @property
    def effective_bits(self) -> float: ...
    @property
    def compression_vs_f16(self) -> float: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def keys(self) -> dict[str, Any]:
        """{"packed": ByteBreakdown, "sinks": int, "residual": int, "total": int} (plus
        "rollback", the f32 originals kept for exact truncation, where the cache has them)"""
    @property
    def values(self) -> dict[str, Any]: ...
    @property
    def layers(self) -> list[dict[str, Any]]:
        """Per layer: tokens, sink/packed/residual tokens, blocks, configs, keys, values, total."""

class KVCache:
    """kvq's streaming quantized KV cache for a whole model (docs/cache.md).

    Per layer: f32 sinks, packed blocks under the layer's key/value configs, and an f32
    residual window of the newest tokens. Thread-safe: calls on one cache serialize.
    """

    def __init__(self, policy: Union[Policy, str], n_layers: int, kv_heads: int, head_dim: int,
                 max_tokens: int = 0) -> None: ...
    def append(self, layer: int, k: ArrayLike, v: ArrayLike) -> None:
        """Appends keys and values ([tokens, kv_heads, head_dim], one dtype) to `layer`.
        Nothing changes when it raises. Releases the GIL."""
    def read(self, layer: int, begin: int = 0,
             end: Optional[int] = None) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Dequantized keys and values of tokens [begin, end) (end: all) as float32."""
    def attend(self, layer: int, q: ArrayLike, causal: bool = True, *, scale: float = 0.0,
               softcap: float = 0.0, window: int = 0, positions: Optional[ArrayLike] = None,
               mask: Optional[ArrayLike] = None, sinks: Optional[ArrayLike] = None,
               threads: int = 1, split_tokens: int = 0, return_lse: bool = False,
               dot: str = "exact") -> Any:
        """Attention of queries q ([n_q, n_heads, head_dim], the newest n_q positions; n_heads a
        multiple of kv_heads) over the packed cache, computed on the packed codes. Returns
        [n_q, n_heads, head_dim] float32, or (out, lse) with return_lse (lse: [n_q, n_heads]
        float32, natural log, -inf for a row that sees nothing). Options (docs/python.md):
        scale (0: 1/sqrt(head_dim)), softcap (0: off), window (0: none), positions (int64
        [n_q]: each query's position), mask (bool [n_q, >= tokens]: True where a query sees a
        position), sinks (float32 [n_heads] sink logits), threads, split_tokens (flash-decoding
        chunk, 0: by length, T / 8 rounded up to a multiple of 256 within
        [256, 4096]), dot ('exact', or 'int8': the int8 dot-product path where the cache's
        codes allow it). Releases the GIL."""
    def truncate(self, n: int, layer: Optional[int] = None) -> None:
        """Keeps tokens [0, n) of every layer (or of `layer`)."""
    def truncate_is_exact(self, layer: int, n: int) -> bool: ...
    def clear(self) -> None: ...
    def copy(self) -> KVCache:
        """An independent copy (same stored bytes)."""
    def fork(self, n: Optional[int] = None) -> KVCache:
        """A cache that shares this one's packed pages (prefix sharing; docs/cache.md): all
        tokens, or the first n of every layer. Writing either never changes the other; each
        attends exactly as a cache fed its tokens alone. Releases the GIL."""
    def __copy__(self) -> KVCache: ...
    def __deepcopy__(self, memo: Any) -> KVCache: ...
    def tokens(self, layer: int = 0) -> int: ...
    def sink_tokens(self, layer: int) -> int: ...
    def packed_tokens(self, layer: int) -> int: ...
    def residual_tokens(self, layer: int) -> int: ...
    def block_tokens(self, layer: int) -> int: ...
    def key_config(self, layer: int) -> QuantConfig: ...
    def value_config(self, layer: int) -> QuantConfig: ...
    def skipped(self, layer: int) -> bool: ...
    @property
    def policy(self) -> Policy: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """memory_report().total"""
    def memory_report(self) -> MemoryReport: ...

def load_kv_dump(path: str) -> list[dict[str, npt.NDArray[Any]]]:
    """Loads a KV dump (one .safetensors file or a directory of .npy files; docs/dump-format.md)
    as one dict per layer with "k", "v" and, when present, "q" and "k_prerope". float32 and
    float16 keep their dtype; bfloat16 is returned as float32 (exact)."""

def save_kv_dump(path: str, layers: Sequence[dict[str, ArrayLike]],
                 format: Literal["safetensors", "npy"] = "safetensors") -> None:
    """Writes a KV dump from one dict per layer ("k", "v", optional "q", "k_prerope"), each
    [tokens, heads, head_dim] float32/float16/bfloat16 (dtype kept). Validated first."""

def calibrate(policy: Union[Policy, str], data: Union[str, "os.PathLike[str]", Sequence[dict[str, ArrayLike]]],
              *, prerope_keys: bool = False,
              weights: Literal["sensitivity", "uniform"] = "sensitivity",
              max_iterations: int = 1000, max_samples: int = 4 << 20) -> Policy:
    """Learns the nuq codebooks `policy` needs (policy/calibrate.hpp) on a KV dump: a path, or
    one dict per layer as save_kv_dump takes ("k", "v", optional "q" for the sensitivity
    weights, "k_prerope" with prerope_keys=True). Returns the calibrated Policy (per-layer
    overrides carry the codebooks), which KVCache, key_for/value_for and quantize accept. A
    policy without nuq comes back unchanged. Raises kvq.Error for bad data (non-finite values,
    too few tokens for one block, mismatched shapes). Releases the GIL."""
def needs_calibration(policy: Union[Policy, str], n_layers: int) -> bool:
    """True when some layer of an n_layers model stores keys or values as nuq."""
def save_calibration(path: str, policy: Union[Policy, str], n_layers: int, source: str = "",
                     weights: Literal["sensitivity", "uniform"] = "sensitivity") -> None:
    """Writes the calibration file (JSON, docs/policy.md) of a calibrated policy."""
def load_calibration(path: str, policy: Union[Policy, str], n_layers: int) -> Policy:
    """`policy` with the codebooks of a calibration file (learned for the same nuq
    normalization and depth; kvq.Error names the first mismatch)."""
