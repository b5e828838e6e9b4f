"""kvq.hf.KvqCache with a tiny randomly initialized Llama (no download). Skipped unless torch and
transformers are installed, except under ./kvq.sh python-hf (KVQ_REQUIRE_HF=1, what CI runs),
where a missing package fails."""
from __future__ import annotations

import importlib
import os

import pytest

if os.environ.get("KVQ_REQUIRE_HF") == "1":  # ./kvq.sh python-hf: missing packages fail, never skip
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    hf = importlib.import_module("kvq.hf")
else:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = pytest.importorskip("kvq.hf")  # ImportError when transformers lacks the layered Cache API

import kvq  # noqa: E402


@pytest.fixture(scope="module")
def model():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    return m


def _generate(model, cache, n: int = 40, prompt: int = 24, **kw):  # noqa: ANN001, ANN003, ANN202
    name = hf.generate_cache_kwarg()
    ids = (torch.arange(1, prompt + 1).reshape(1, -1) * 7) % 96
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              pad_token_id=0, **{name: cache}, **kw)


def test_f32_policy_equals_default_cache(model) -> None:  # noqa: ANN001
    """kvq's f32 cache stores the states unchanged: greedy tokens equal the default cache's."""
    ref = _generate(model, transformers.DynamicCache())
    cache = hf.KvqCache("f32", model.config)
    out = _generate(model, cache)
    assert torch.equal(out, ref)
    assert cache.get_seq_length() == out.shape[1] - 1
    # f32 storage, plus whatever full-precision copies the cache keeps (e.g. for rollback).
    assert cache.effective_bits() >= 32.0


def _check_device_copy(cache) -> None:  # noqa: ANN001
    """The incremental device copy of every layer equals a full read of kvq's rows, and only the
    tokens after the stable prefix (sinks + packed blocks) are left to re-read."""
    for layer in cache.layers:
        n = layer.get_seq_length()
        for b, row in enumerate(layer._rows):
            kk, vv = row.read(0)
            assert torch.equal(layer._dk[b, :, :n], torch.from_numpy(kk).transpose(0, 1))
            assert torch.equal(layer._dv[b, :, :n], torch.from_numpy(vv).transpose(0, 1))
            assert layer._stable <= row.sink_tokens(0) + row.packed_tokens(0)
            assert n - layer._stable <= row.residual_tokens(0)


def test_kivi2_cache_is_smaller_and_consistent(model) -> None:  # noqa: ANN001
    # Long enough that the packed part dominates the f32 window and the rollback copy.
    ref_cache = transformers.DynamicCache()
    _generate(model, ref_cache, n=16, prompt=240)
    cache = hf.KvqCache("kivi2", model.config, residual_length=0)
    out = _generate(model, cache, n=16, prompt=240)
    assert out.shape[1] == 240 + 16
    assert cache.policy.residual == 0 and cache.policy.key == kvq.QuantConfig("int2/channel/g32")
    assert cache.get_seq_length() == ref_cache.get_seq_length()
    assert cache.nbytes < hf.dynamic_cache_nbytes(ref_cache)
    assert 3.0 <= cache.effective_bits() < 32
    layer = cache.layers[1]
    rep = layer.memory_reports()[0]
    assert rep.layers[0]["packed_tokens"] >= 32
    _check_device_copy(cache)
    cache.crop(-5)
    assert cache.get_seq_length() == ref_cache.get_seq_length() - 5
    _check_device_copy(cache)
    # One more step after the crop re-reads what changed and stays equal to kvq's contents.
    k = torch.randn(1, 2, 1, 16)
    cache.layers[0].update(k, k)
    _check_device_copy(cache)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_per_layer_policy_and_batches(model) -> None:  # noqa: ANN001
    cache = hf.KvqCache("kivi4,skip=1:0", model.config)
    assert cache.layers[0].policy.key == kvq.QuantConfig("f32")
    assert cache.layers[1].policy.key == kvq.QuantConfig("int4/channel/g32")
    ids = torch.stack([torch.arange(1, 21), torch.arange(30, 50)]) % 96
    name = hf.generate_cache_kwarg()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **{name: cache})
    assert out.shape == (2, 28)
    # Beam search reorders (and duplicates) batch rows: kvq copies the row caches.
    beams = hf.KvqCache("k8v4", model.config)
    out = _generate(model, beams, n=6, num_beams=3)
    assert out.shape[1] == 24 + 6
    with pytest.raises(kvq.Error):
        hf.KvqCache("k9v4", model.config)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        hf.KvqCache("k8v4")
