"""Hugging Face transformers adapter: a KV cache stored by kvq under any kvq policy.

``KvqCache`` is a ``transformers.Cache`` in the style of transformers' ``QuantizedCache``: the
newest tokens (the policy's ``residual`` window, or ``residual_length``) stay in full precision
(float32), older tokens live packed in kvq's streaming cache under the policy's key and value
formats (``k8v4``, ``kivi2``, ``k=int4/channel/g32,v=int4/token/g32``, ...). Every layer holds
one ``kvq.KVCache`` per batch row; ``update`` appends the new states and returns the cache's
contents (what attention then reads is exactly what kvq stores). Unlike ``QuantizedCache``, the
window is not re-quantized wholesale when it fills: kvq packs whole blocks as they leave it.

Cost per step. Each layer keeps the dequantized contents in one tensor on the model's device
and dtype, ``[batch, kv_heads, capacity, head_dim]`` (capacity doubles as needed), and
``update`` re-reads from kvq only what can have changed since the last step: the tokens after
the stable prefix (sinks and packed blocks, which kvq never rewrites), i.e. the new tokens and
the full-precision window. A decode step therefore costs O(new tokens + window), not O(T);
``update`` returns views of that tensor (python/benchmarks/bench_hf_step.py measures it).

Needs torch and transformers >= 4.56 (the layered Cache API); importing ``kvq.hf`` without them
raises ImportError. Tested with torch 2.15.0 and transformers 5.24.0 and 5.25.0 (docs/python.md).

    from kvq.hf import KvqCache
    cache = KvqCache("k8v4", model.config)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64)
    print(cache.nbytes, cache.effective_bits())
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence, Union

try:
    import torch
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError as _e:  # pragma: no cover - exercised only without the packages
    raise ImportError(
        "kvq.hf needs torch and transformers >= 4.56 (the layered Cache API): "
        "pip install torch transformers"
    ) from _e

import kvq

__all__ = ["KvqCache", "KvqLayer", "dynamic_cache_nbytes", "generate_cache_kwarg"]


def generate_cache_kwarg() -> str:
    """Name of generate()'s cache argument: "cache" in transformers versions that renamed it
    (5.x), else "past_key_values"."""
    try:
        from transformers.generation.utils import ALL_CACHE_NAMES
    except ImportError:
        return "past_key_values"
    return "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"

_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _with_residual(policy: kvq.Policy, residual: int) -> kvq.Policy:
    """The policy with its full-precision window set to `residual` tokens."""
    if not isinstance(residual, int) or residual < 0:
        raise ValueError(f"kvq.hf: residual_length must be an int >= 0, got {residual!r}")
    spec = re.sub(r"(^|,)residual=\d+(,|$)", rf"\g<1>residual={residual}\g<2>", policy.spec, count=1)
    return kvq.parse_policy(spec)


def _layer_policy(policy: kvq.Policy, layer: int, n_layers: int) -> kvq.Policy:
    """The one-layer policy of `layer`: its key/value configs (skip and overrides resolved)."""
    k = policy.key_for(layer, n_layers)
    v = policy.value_for(layer, n_layers)
    return kvq.parse_policy(
        f"k={k.spec},v={v.spec},residual={policy.residual},sinks={policy.sinks}"
    )


def _kv_input(t: torch.Tensor) -> torch.Tensor:
    """A CPU, gradient-free tensor in a dtype kvq reads (float32/float16/bfloat16)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype not in _KV_DTYPES:
        t = t.float()
    return t


class KvqLayer(DynamicLayer):
    """One attention layer's cache: a ``kvq.KVCache`` (one layer) per batch row.

    States are ``[batch, kv_heads, seq, head_dim]`` as transformers passes them; kvq stores each
    row as ``[seq, kv_heads, head_dim]`` (a strided view, no copy before kvq reads it).
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, policy: kvq.Policy):
        super().__init__()
        self.policy = policy
        self._rows: list[kvq.KVCache] = []

    # -- transformers' layer protocol -------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, kv_heads, _, head_dim = key_states.shape
        self._rows = [kvq.KVCache(self.policy, 1, kv_heads, head_dim) for _ in range(batch)]
        # The dequantized contents on the model's device: [batch, kv_heads, capacity, head_dim];
        # tokens [0, _stable) equal kvq's and can no longer change (sinks, packed blocks).
        self._dk: Optional[torch.Tensor] = None
        self._dv: Optional[torch.Tensor] = None
        self._stable = 0
        # Placeholders: transformers' generic code may look at .keys/.values; the data is in kvq.
        self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
        self.values = torch.tensor([], dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def _reserve(self, tokens: int, like: torch.Tensor) -> None:
        """Grows the device copy to hold `tokens` (capacity doubles; the stable prefix moves)."""
        cap = 0 if self._dk is None else self._dk.shape[2]
        if tokens <= cap:
            return
        batch, kv_heads, _, head_dim = like.shape
        new_cap = max(tokens, 2 * cap, 64)
        dk = torch.empty((batch, kv_heads, new_cap, head_dim), dtype=self.dtype, device=self.device)
        dv = torch.empty_like(dk)
        if self._dk is not None and self._stable > 0:
            dk[:, :, : self._stable].copy_(self._dk[:, :, : self._stable])
            dv[:, :, : self._stable].copy_(self._dv[:, :, : self._stable])
        self._dk, self._dv = dk, dv

    def _stable_tokens(self) -> int:
        """Tokens of every row that kvq will not rewrite: sinks and packed blocks."""
        return min(row.sink_tokens(0) + row.packed_tokens(0) for row in self._rows)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(
                "kvq.hf: key and value states must both be [batch, kv_heads, seq, head_dim], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if key_states.shape[0] != len(self._rows):
            raise ValueError(
                f"kvq.hf: batch size changed from {len(self._rows)} to {key_states.shape[0]} "
                "(use batch_select_indices / batch_repeat_interleave)"
            )
        k, v = _kv_input(key_states), _kv_input(value_states)
        for b, row in enumerate(self._rows):
            row.append(0, k[b].transpose(0, 1), v[b].transpose(0, 1))
        n = self._rows[0].tokens(0)
        self._reserve(n, key_states)
        # Re-read only what may differ from the device copy: [stable, n) (window + new tokens).
        s = self._stable
        for b, row in enumerate(self._rows):
            kk, vv = row.read(0, s, n)
            self._dk[b, :, s:n].copy_(torch.from_numpy(kk).transpose(0, 1), non_blocking=False)
            self._dv[b, :, s:n].copy_(torch.from_numpy(vv).transpose(0, 1), non_blocking=False)
        self._stable = self._stable_tokens()
        return self._dk[:, :, :n], self._dv[:, :, :n]

    def get_seq_length(self) -> int:
        return self._rows[0].tokens(0) if self.is_initialized and self._rows else 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        for row in self._rows:
            row.clear()
        self._stable = 0

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: drop that many newest tokens; positive (older transformers): keep that many."""
        if not self.is_initialized:
            return
        n = self.get_seq_length()
        keep = n + tokens_to_remove if tokens_to_remove < 0 else min(n, tokens_to_remove)
        keep = max(0, keep)
        for row in self._rows:
            row.truncate(keep)
        # Tokens past `keep` are gone and a truncation may move packed tokens back to the window.
        self._stable = min(self._stable, keep, self._stable_tokens())

    def _select(self, indices: Sequence[int]) -> None:
        used: set[int] = set()
        rows = []
        for i in indices:
            i = int(i)
            rows.append(self._rows[i] if i not in used else self._rows[i].copy())
            used.add(i)
        self._rows = rows
        if self._dk is not None:
            idx = torch.as_tensor([int(i) for i in indices], dtype=torch.long, device=self._dk.device)
            self._dk = self._dk.index_select(0, idx)
            self._dv = self._dv.index_select(0, idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select(beam_idx.tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select([b for b in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select(torch.as_tensor(indices).tolist())

    def offload(self) -> None:  # kvq's data already lives in host memory
        pass

    def prefetch(self) -> None:
        pass

    # -- kvq ----------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes kvq stores for this layer (codes, metadata, full-precision windows)."""
        return sum(row.nbytes for row in self._rows)

    def memory_reports(self) -> list[kvq.MemoryReport]:
        return [row.memory_report() for row in self._rows]


class KvqCache(Cache):
    """A transformers ``Cache`` whose layers are stored by kvq under `policy`.

    Args:
        policy: a kvq policy spec ("k8v4", "kivi2", "k=int4/channel/g32,v=int4/token/g32") or a
            ``kvq.Policy``. Its skip/skipas/k@L/v@L fields pick each layer's formats.
        config: the model's config (``model.config``); gives the number of layers. Or pass
            ``num_hidden_layers``.
        residual_length: newest tokens kept in full precision (overrides the policy's
            ``residual``; None keeps it).
    """

    def __init__(
        self,
        policy: Union[str, kvq.Policy] = "k8v4",
        config: Optional[Any] = None,
        num_hidden_layers: Optional[int] = None,
        residual_length: Optional[int] = None,
    ):
        pol = policy if isinstance(policy, kvq.Policy) else kvq.parse_policy(policy)
        if residual_length is not None:
            pol = _with_residual(pol, residual_length)
        if config is not None:
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            layer_types = getattr(text, "layer_types", None) or []
            bad = sorted(set(layer_types) - {"full_attention"})
            if bad:
                raise ValueError(
                    f"kvq.hf.KvqCache supports full-attention layers only; the model also has {bad}"
                )
            n_layers = int(text.num_hidden_layers)
        elif num_hidden_layers is not None:
            n_layers = int(num_hidden_layers)
        else:
            raise ValueError("kvq.hf.KvqCache needs the model config or num_hidden_layers")
        if n_layers <= 0:
            raise ValueError(f"kvq.hf.KvqCache: num_hidden_layers must be > 0, got {n_layers}")
        self.policy = pol
        super().__init__(layers=[KvqLayer(_layer_policy(pol, i, n_layers)) for i in range(n_layers)])

    @property
    def nbytes(self) -> int:
        """Bytes kvq stores over all layers and batch rows (data; bookkeeping excluded)."""
        return sum(layer.nbytes for layer in self.layers)

    def elements(self) -> int:
        """Key and value elements held (2 x tokens x kv_heads x head_dim, summed)."""
        return sum(
            rep.elements for layer in self.layers for rep in layer.memory_reports()
        )

    def effective_bits(self) -> float:
        """8 x nbytes / elements: bits per cached value, metadata and f32 window included."""
        n = self.elements()
        return 8.0 * self.nbytes / n if n else 0.0


def dynamic_cache_nbytes(cache: Cache) -> int:
    """Bytes of the key/value tensors of a transformers cache that holds them as tensors
    (e.g. the default DynamicCache), for comparison with ``KvqCache.nbytes``."""
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
