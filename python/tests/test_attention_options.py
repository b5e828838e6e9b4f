"""KVCache.attend's options and kvq.attend_batch against a float64 numpy attention written here
(scale, soft-cap, window, positions, mask, sink logits, log-sum-exp), over the rows the cache
itself returns (KVCache.read), so the reference shares no code with kvq's kernels."""
from __future__ import annotations

import numpy as np
import pytest

import kvq
from conftest import kv_data

H, D, QH = 2, 64, 4


def _ref(q, k, v, *, pos=None, causal=True, scale=0.0, softcap=0.0, window=0, mask=None,
         sinks=None):
    """float64 GQA attention; returns (out [n, QH, D], lse [n, QH])."""
    n, qh, d = q.shape
    t, kh, _ = k.shape
    out = np.zeros((n, qh, d))
    lse = np.full((n, qh), -np.inf)
    sc = scale if scale > 0 else 1.0 / np.sqrt(d)
    for i in range(n):
        p = pos[i] if pos is not None else t - n + i
        seen = np.ones(t, dtype=bool)
        if causal:
            seen &= np.arange(t) <= p
        if window > 0:
            end = p if causal else t - 1
            seen &= np.arange(t) > end - window
        if mask is not None:
            seen &= mask[i, :t]
        for h in range(qh):
            g = h // (qh // kh)
            logit = (k[:, g].astype(np.float64) @ q[i, h].astype(np.float64)) * sc
            if softcap > 0:
                logit = softcap * np.tanh(logit / softcap)
            logit = logit[seen]
            extra = [] if sinks is None else [float(sinks[h])]
            allv = np.concatenate([logit, extra])
            if allv.size == 0:
                continue
            m = allv.max()
            w = np.exp(logit - m)
            den = np.exp(allv - m).sum()
            if logit.size:
                out[i, h] = (w / den) @ v[seen, g].astype(np.float64)
            lse[i, h] = m + np.log(den)
    return out, lse


def _cache(spec: str, t: int, seed: int, layers: int = 1) -> kvq.KVCache:
    c = kvq.KVCache(spec, layers, H, D)
    for layer in range(layers):
        if t:
            c.append(layer, kv_data(t, H, D, seed=seed + layer),
                     kv_data(t, H, D, seed=seed + 50 + layer, outliers=False))
    return c


CASES = {
    "plain": {},
    "scale": {"scale": 0.05},
    "softcap": {"softcap": 3.0, "scale": 0.3},
    "window": {"window": 17},
    "sinks": {"sinks": np.array([0.5, -1.0, 2.0, 0.0], dtype=np.float32)},
}


@pytest.mark.parametrize("spec", ["kivi4,sinks=2", "k8v4", "turbo4", "f16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attend_options_match_numpy(spec: str, case: str) -> None:
    c = _cache(spec, 150, seed=3)
    k, v = c.read(0)
    q = kv_data(6, QH, D, seed=9, outliers=False)
    opts = CASES[case]
    out, lse = c.attend(0, q, return_lse=True, **opts)
    want, wl = _ref(q, k, v, **opts)
    assert out.shape == (6, QH, D) and out.dtype == np.float32 and lse.shape == (6, QH)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse, wl, rtol=1e-5, atol=1e-5)
    assert np.array_equal(c.attend(0, q, **opts), out)  # the same output without lse


def test_positions_and_tree_mask() -> None:
    c = _cache("kivi4", 120, seed=4)
    k, v = c.read(0)
    q = kv_data(4, QH, D, seed=10, outliers=False)
    pos = np.array([30, 119, 64, 100], dtype=np.int64)
    rng = np.random.default_rng(1)
    mask = rng.random((4, 130)) < 0.6  # wider than the 120 tokens: the rest is never read
    mask[2, :] = False  # a row that sees nothing: zeros and lse -inf
    out, lse = c.attend(0, q, positions=pos, mask=mask, return_lse=True)
    want, wl = _ref(q, k, v, pos=pos, mask=mask)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)
    assert np.all(out[2] == 0) and np.all(np.isneginf(lse[2]))
    np.testing.assert_allclose(lse[[0, 1, 3]], wl[[0, 1, 3]], rtol=1e-5, atol=1e-5)
    # int32 positions are accepted (converted); non-causal attention sees all tokens
    out32 = c.attend(0, q, positions=pos.astype(np.int32), mask=mask)
    assert np.array_equal(out32, out)
    nc = c.attend(0, q, causal=False)
    np.testing.assert_allclose(nc, _ref(q, k, v, causal=False)[0], rtol=1e-4, atol=2e-5)


def test_int8_dot_product_path() -> None:
    """dot='int8' stays near the float64 reference (int8 queries, uint8 weights: about 1% of a
    row here, against 1e-4 for the exact path) and equals the exact path where no int codes are
    read (f16, turbo4); attend_batch takes it too; a bad value is refused by name."""
    q = kv_data(3, QH, D, seed=9, outliers=False)
    for spec in ("kivi4", "k8v4"):
        c = _cache(spec, 150, seed=3)
        k, v = c.read(0)
        want, _ = _ref(q, k, v)
        got = c.attend(0, q, dot="int8")
        err = np.abs(got - want).max(axis=-1) / np.abs(want).max(axis=-1)
        assert err.max() < 0.2, (spec, err.max())
        if kvq.simd_level() != "scalar":  # scalar builds have no int8 path (exact there)
            assert not np.array_equal(got, c.attend(0, q)), spec
        assert np.array_equal(kvq.attend_batch([c], 0, q[:1], dot="int8"),
                              c.attend(0, q[:1], dot="int8"))
    for spec in ("f16", "turbo4"):
        c = _cache(spec, 150, seed=3)
        assert np.array_equal(c.attend(0, q, dot="int8"), c.attend(0, q))
    with pytest.raises(kvq.Error, match="dot must be 'exact' or 'int8'"):
        _cache("kivi4", 40, seed=5).attend(0, q, dot="int4")


def test_attend_option_errors_name_the_problem() -> None:
    c = _cache("k8v4", 40, seed=5)
    q = kv_data(2, QH, D, seed=11, outliers=False)
    with pytest.raises(kvq.Error, match="sinks must hold one logit per query head"):
        c.attend(0, q, sinks=np.zeros(3, dtype=np.float32))
    with pytest.raises(kvq.Error, match="positions must hold one entry per query row"):
        c.attend(0, q, positions=np.zeros(3, dtype=np.int64))
    with pytest.raises(kvq.Error, match=r"mask must be \[2, >= 40\]"):
        c.attend(0, q, mask=np.ones((2, 39), dtype=bool))
    with pytest.raises(kvq.Error, match="threads must be >= 1"):
        c.attend(0, q, threads=0)
    with pytest.raises(kvq.Error, match="window must be >= 0"):
        c.attend(0, q, window=-1)
    with pytest.raises(kvq.Error):
        c.attend(0, q, scale=float("nan"))
    with pytest.raises(kvq.Error, match="layer 3 out of range"):
        c.attend(3, q)


def test_attend_batch_equals_attend_per_cache() -> None:
    caches = [_cache("kivi4,sinks=2", t, seed=20 + t, layers=2) for t in (200, 0, 77, 33)]
    queries = [2, 1, 1, 3]
    q = kv_data(sum(queries), QH, D, seed=12, outliers=False)
    for layer in range(2):
        for threads in (1, 2):
            out, lse = kvq.attend_batch(caches, layer, q, queries, threads=threads,
                                        split_tokens=64, return_lse=True)
            r = 0
            for c, n in zip(caches, queries):
                if c.tokens(layer) == 0:
                    assert np.all(out[r:r + n] == 0) and np.all(np.isneginf(lse[r:r + n]))
                else:
                    one, ol = c.attend(layer, q[r:r + n], split_tokens=64, return_lse=True)
                    assert np.array_equal(out[r:r + n], one)
                    assert np.array_equal(lse[r:r + n], ol)
                r += n
    # decode: one query per cache by default; the options apply per global row
    sinks = np.array([1.0, 0.0, -1.0, 0.5], dtype=np.float32)
    d = kvq.attend_batch(caches[:1] + caches[2:], 0, q[:3], window=20, sinks=sinks)
    for i, c in enumerate(caches[:1] + caches[2:]):
        assert np.array_equal(d[i:i + 1], c.attend(0, q[i:i + 1], window=20, sinks=sinks))
    # the same cache twice is fine (locked once)
    two = kvq.attend_batch([caches[0], caches[0]], 0, q[:2])
    assert np.array_equal(two[1:2], caches[0].attend(0, q[1:2]))


def test_attend_batch_errors() -> None:
    a = _cache("kivi4", 64, seed=30)
    b = _cache("k8v4", 64, seed=31)
    q = kv_data(2, QH, D, seed=13, outliers=False)
    with pytest.raises(kvq.Error, match="laid out unlike sequence 0"):
        kvq.attend_batch([a, b], 0, q)
    with pytest.raises(kvq.Error, match="the query counts add up to 3 rows but q holds 2"):
        kvq.attend_batch([a, a], 0, q, [1, 2])
    with pytest.raises(kvq.Error, match="2 caches but 1 query counts"):
        kvq.attend_batch([a, a], 0, q, [2])
    with pytest.raises(kvq.Error, match="layer 1 out of range"):
        kvq.attend_batch([a, a], 1, q)


def test_fork_shares_a_prefix_and_attends_as_if_alone() -> None:
    prefix_k, prefix_v = kv_data(100, H, D, seed=40), kv_data(100, H, D, seed=41, outliers=False)
    ext = [(kv_data(30, H, D, seed=42 + i), kv_data(30, H, D, seed=52 + i, outliers=False)) for i in range(2)]
    src = kvq.KVCache("kivi4,sinks=2", 1, H, D)
    src.append(0, prefix_k, prefix_v)
    fork = src.fork()
    src.append(0, *ext[0])
    fork.append(0, *ext[1])
    q = kv_data(3, QH, D, seed=43, outliers=False)
    for c, (ek, ev) in ((src, ext[0]), (fork, ext[1])):
        alone = kvq.KVCache("kivi4,sinks=2", 1, H, D)
        alone.append(0, prefix_k, prefix_v)
        alone.append(0, ek, ev)
        assert [a.tobytes() for a in c.read(0)] == [a.tobytes() for a in alone.read(0)]
        assert np.array_equal(c.attend(0, q), alone.attend(0, q))
        assert c.memory_report().total == alone.memory_report().total
    head = src.fork(64)  # a page boundary of kivi4's 32-token blocks (after 2 sinks: exact)
    assert head.tokens(0) == 64 and src.tokens(0) == 130
    with pytest.raises(kvq.Error):
        src.fork(1000)
