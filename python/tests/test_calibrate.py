"""kvq.calibrate (nuq codebooks from Python): the calibration file equals the C++ headers' (oracle),
the codebook is a fixed point of Lloyd's k-means on the normalized samples (recomputed in numpy),
and the calibrated policy works in kvq.quantize and kvq.KVCache."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvq
from conftest import kv_data, run_oracle

L, H, QH, D, T = 2, 2, 4, 64, 96
SPEC = "k=nuq3/channel/g32,v=nuq4/token/g32"


def _layers(seed: int = 3) -> list[dict]:
    return [
        {
            "k": kv_data(T, H, D, seed=seed + l),
            "v": kv_data(T, H, D, seed=seed + 10 + l, outliers=False),
            "q": kv_data(T, QH, D, seed=seed + 20 + l, outliers=False),
        }
        for l in range(L)
    ]


@pytest.mark.parametrize("weights", ["sensitivity", "uniform"])
def test_calibration_file_equals_cpp(oracle: Path, tmp_path: Path, weights: str) -> None:
    layers = _layers()
    dump = tmp_path / "d.safetensors"
    kvq.save_kv_dump(str(dump), layers)
    cal = kvq.calibrate(SPEC, layers, weights=weights)
    assert isinstance(cal, kvq.Policy)
    kvq.save_calibration(str(tmp_path / "py.json"), cal, L, weights=weights)
    code, _, out = run_oracle(oracle, "calibrate", SPEC, dump, 0, weights, tmp_path / "cpp.json")
    assert code == 0, out
    assert (tmp_path / "py.json").read_text() == (tmp_path / "cpp.json").read_text()
    # A path (str or PathLike) to the same dump gives the same policy.
    assert kvq.calibrate(SPEC, dump, weights=weights) == cal
    # The file loads back onto the uncalibrated policy with the same codebooks.
    back = kvq.load_calibration(str(tmp_path / "py.json"), SPEC, L)
    for l in range(L):
        assert back.key_for(l, L).nuq_levels == cal.key_for(l, L).nuq_levels
        assert back.value_for(l, L).nuq_levels == cal.value_for(l, L).nuq_levels


def test_codebook_is_a_lloyd_fixed_point() -> None:
    # Uniform weights, f32 metadata, token axis, no sinks: the samples are u = (x - min_g) *
    # (1 / (max_g - min_g)) over groups of 32 channels of every vector (float32, as the
    # quantizer normalizes), and a converged 1-D k-means codebook is the mean of its cells
    # (cells split at the midpoints between levels).
    spec = "k=nuq3/token/g32/f32meta,v=nuq3/token/g32/f32meta"
    layers = _layers(seed=8)
    cal = kvq.calibrate(spec, layers, weights="uniform")
    for l in range(L):
        for name, cfg in (("k", cal.key_for(l, L)), ("v", cal.value_for(l, L))):
            levels = np.array(cfg.nuq_levels, dtype=np.float64)
            assert len(levels) == 8 and np.all(np.diff(levels) > 0) and cfg.nuq_ready
            x = layers[l][name].reshape(T, H, D // 32, 32)
            lo = x.min(axis=3, keepdims=True)
            scale = (x.max(axis=3, keepdims=True) - lo).astype(np.float32)
            inv = (np.float32(1) / scale).astype(np.float32)
            u = np.sort(((x - lo) * inv).astype(np.float32).ravel().astype(np.float64))
            mids = 0.5 * (levels[1:] + levels[:-1])
            edges = np.concatenate([[0], np.searchsorted(u, mids, side="left"), [u.size]])
            means = np.array([u[a:b].mean() for a, b in zip(edges[:-1], edges[1:])])
            np.testing.assert_allclose(levels, means, rtol=0, atol=2e-6, err_msg=f"layer {l} {name}")


def test_calibrated_policy_quantizes_and_caches() -> None:
    layers = _layers()
    with pytest.raises(kvq.Error, match="calibrat"):
        kvq.quantize(layers[0]["k"], kvq.Policy(SPEC).key_for(0, L))
    with pytest.raises(kvq.Error, match="calibrat"):
        kvq.KVCache(SPEC, L, H, D)
    assert kvq.needs_calibration(SPEC, L)
    cal = kvq.calibrate(SPEC, layers)
    kc = cal.key_for(0, L)
    assert kc.format == "nuq" and kc.bits == 3 and kc.nuq_ready and len(kc.nuq_levels) == 8
    assert kvq.QuantConfig("int4/token/g32").nuq_levels is None
    q = kvq.quantize(layers[0]["k"], kc)
    y = q.dequantize()
    assert np.isfinite(y).all()
    # Every decoded value is min + level * (max - min) of its group: within the group's range.
    err = np.abs(y - layers[0]["k"]).max()
    assert err < np.abs(layers[0]["k"]).max()
    c = kvq.KVCache(cal, L, H, D)
    for l in range(L):
        c.append(l, layers[l]["k"], layers[l]["v"])
    kr, _ = c.read(0)
    assert kr.shape == (T, H, D) and np.isfinite(kr).all()
    # A policy without nuq comes back unchanged.
    assert kvq.calibrate("k8v4", layers) == kvq.Policy("k8v4")


def test_calibrate_refuses_bad_input() -> None:
    layers = _layers()
    with pytest.raises(kvq.Error, match="weights"):
        kvq.calibrate(SPEC, layers, weights="fisher")
    with pytest.raises(kvq.Error):
        kvq.calibrate(SPEC, [])  # no layers
    with pytest.raises(kvq.Error, match="no complete block|too few"):
        kvq.calibrate(SPEC, [{"k": d["k"][:8], "v": d["v"][:8]} for d in layers])
    bad = [dict(d) for d in layers]
    bad[1]["k"] = bad[1]["k"].copy()
    bad[1]["k"][3, 0, 0] = np.nan
    with pytest.raises(kvq.Error):
        kvq.calibrate(SPEC, bad)
    with pytest.raises(TypeError):
        kvq.calibrate(SPEC, 42)
    with pytest.raises(kvq.Error):
        kvq.calibrate(SPEC, "/nonexistent/dump.safetensors")
    with pytest.raises(kvq.Error):
        kvq.calibrate(SPEC, layers, max_iterations=0)
