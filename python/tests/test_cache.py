"""kvq.KVCache, attention and KV dumps: equal to the C++ oracle and to the kvq_quantize_dump tool."""
from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvq
from conftest import REPO, kv_data, run_oracle

L, H, D, T, QH, NQ = 2, 2, 64, 80, 4, 5


def _model_data(seed: int):
    k = np.stack([kv_data(T, H, D, seed=seed + l) for l in range(L)])
    v = np.stack([kv_data(T, H, D, seed=seed + 10 + l, outliers=False) for l in range(L)])
    q = np.stack([kv_data(T, QH, D, seed=seed + 20 + l, outliers=False) for l in range(L)])
    return k, v, q


@pytest.mark.parametrize("spec", ["k8v4", "kivi2", "kivi4,sinks=4", "turbo3", "k=lm3/qjl,v=lm4,residual=8",
                                  "fp8,skip=1:0", "f16"])
def test_cache_equals_cpp(oracle: Path, tmp_path: Path, spec: str) -> None:
    k, v, q = _model_data(seed=len(spec))
    for name, a in (("k", k), ("v", v), ("q", q)):
        a.tofile(tmp_path / f"{name}.f32")
    code, fields, out = run_oracle(oracle, "cache", spec, L, H, D, T, tmp_path / "k.f32",
                                   tmp_path / "v.f32", tmp_path / "q.f32", QH, NQ, tmp_path / "o")
    assert code == 0, out
    c = kvq.KVCache(spec, L, H, D)
    for layer in range(L):
        first = T // 3
        c.append(layer, k[layer, :first], v[layer, :first])
        c.append(layer, k[layer, first:], v[layer, first:])
    rep = c.memory_report()
    assert rep.total == int(fields["total"])
    assert f"{rep.effective_bits:.17g}" == fields["effective_bits"]
    assert rep.keys["total"] == int(fields["keys"]) and rep.values["total"] == int(fields["values"])
    for layer in range(L):
        kr, vr = c.read(layer)
        assert kr.tobytes() == (tmp_path / f"o.k{layer}").read_bytes()
        assert vr.tobytes() == (tmp_path / f"o.v{layer}").read_bytes()
        a = c.attend(layer, q[layer, T - NQ:])
        assert a.shape == (NQ, QH, D)
        # Same kernels, same flags; compared to float rounding rather than bit for bit, because
        # the attention kernels may order their sums by what the compiler vectorizes.
        want = np.fromfile(tmp_path / f"o.a{layer}", dtype=np.float32).reshape(a.shape)
        np.testing.assert_allclose(a, want, rtol=1e-5, atol=1e-6)
    assert "bits/value" in str(rep) and len(rep.layers) == L


def _attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """float64 causal GQA attention of the newest len(q) positions over k, v."""
    n, qh, d = q.shape
    t, kh, _ = k.shape
    out = np.zeros((n, qh, d))
    for i in range(n):
        pos = t - n + i
        for h in range(qh):
            s = k[: pos + 1, h // (qh // kh)].astype(np.float64) @ q[i, h].astype(np.float64) / np.sqrt(d)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[: pos + 1, h // (qh // kh)]
    return out


def test_attend_matches_reference_over_read() -> None:
    k, v, q = _model_data(seed=40)
    c = kvq.KVCache("kivi4", 1, H, D)
    c.append(0, k[0], v[0])
    kr, vr = c.read(0)
    a = c.attend(0, q[0, -NQ:])
    np.testing.assert_allclose(a, _attention_ref(q[0, -NQ:], kr, vr), rtol=1e-4, atol=1e-5)
    assert np.array_equal(c.attend(0, q[0, -NQ:].astype(np.float16)),
                          c.attend(0, q[0, -NQ:].astype(np.float16).astype(np.float32)))


def test_cache_ops_and_bad_input() -> None:
    x = kv_data(40, H, D, seed=50)
    c = kvq.KVCache(kvq.parse_policy("kivi2"), 3, H, D)
    c.append(1, x, x)
    assert (c.tokens(1), c.tokens(0)) == (40, 0)
    assert c.packed_tokens(1) + c.residual_tokens(1) + c.sink_tokens(1) == 40
    assert c.block_tokens(1) == 32 and c.key_config(1) == kvq.QuantConfig("int2/channel/g32")
    d = c.copy()
    assert copy.deepcopy(c).memory_report().total == c.memory_report().total
    assert [a.tobytes() for a in d.read(1)] == [a.tobytes() for a in c.read(1)]
    d.truncate(10, layer=1)
    assert d.tokens(1) == 10 and c.tokens(1) == 40  # the copy is independent
    before = c.memory_report().total
    bad = x[:2].copy()
    bad[1, 0, 3] = np.nan
    with pytest.raises(kvq.Error) as e:
        c.append(1, bad, bad)
    assert e.value.kind == "non_finite"
    assert c.tokens(1) == 40 and c.memory_report().total == before  # nothing changed
    with pytest.raises(TypeError, match="give both in one dtype"):
        c.append(1, x, x.astype(np.float16))
    with pytest.raises(kvq.Error, match="layer"):
        c.append(5, x, x)
    with pytest.raises(kvq.Error):
        c.append(1, x[:, :1], x[:, :1])  # wrong kv_heads
    with pytest.raises(kvq.Error):
        c.read(1, 0, 41)
    # Validated before the output arrays are allocated: never a MemoryError.
    for args in ((1, 0, 2**62), (1, 0, 2**40), (7,), (-1,), (1, 5, 3), (1, -1, 3)):
        with pytest.raises(kvq.Error) as e:
            c.read(*args)
        assert e.value.kind == "out_of_range", args
    with pytest.raises(kvq.Error, match="multiple"):
        c.attend(1, kv_data(1, 3, D))
    with pytest.raises(kvq.Error):
        c.attend(0, kv_data(1, H, D))  # empty layer
    with pytest.raises(kvq.Error):
        kvq.KVCache("k8v4", 0, H, D)
    with pytest.raises(kvq.Error) as e:
        kvq.KVCache("k9v4", 1, H, D)
    assert e.value.kind == "parse"
    with pytest.raises(TypeError, match="kvq.Policy or a spec string"):
        kvq.KVCache(3, 1, H, D)
    c.clear()
    assert c.tokens(1) == 0
    xh = x.astype(np.float16)
    c.append(0, xh, xh)
    assert c.tokens(0) == 40


def test_kv_dump_round_trip(tmp_path: Path) -> None:
    layers = [
        {"k": kv_data(12, 2, 16, seed=i), "v": kv_data(12, 2, 16, seed=10 + i).astype(np.float16),
         "q": kv_data(12, 4, 16, seed=20 + i)}
        for i in range(3)
    ]
    for fmt, path in (("safetensors", tmp_path / "d.safetensors"), ("npy", tmp_path / "npy")):
        kvq.save_kv_dump(str(path), layers, format=fmt)
        back = kvq.load_kv_dump(str(path))
        assert len(back) == 3
        for a, b in zip(layers, back):
            assert set(b) == {"k", "v", "q"}
            for name in a:
                assert b[name].dtype == a[name].dtype and np.array_equal(a[name], b[name])
    with pytest.raises(kvq.Error) as e:
        kvq.load_kv_dump(str(tmp_path / "missing.safetensors"))
    assert e.value.kind == "io"
    with pytest.raises(kvq.Error, match="needs both 'k' and 'v'"):
        kvq.save_kv_dump(str(tmp_path / "x.safetensors"), [{"k": layers[0]["k"]}])
    with pytest.raises(kvq.Error):
        kvq.save_kv_dump(str(tmp_path / "x.safetensors"),
                         [{"k": layers[0]["k"], "v": kv_data(11, 2, 16)}])
    with pytest.raises(TypeError):
        kvq.save_kv_dump(str(tmp_path / "x.safetensors"), "layers")


def _tool() -> Path | None:
    cands = [os.environ.get("KVQ_TOOLS_DIR", ""), str(REPO / "build" / "examples")]
    for d in cands:
        if d and (Path(d) / "kvq_quantize_dump").exists():
            return Path(d) / "kvq_quantize_dump"
    return None


def test_matches_kvq_quantize_dump_tool(tmp_path: Path) -> None:
    """The C++ tool and the Python cache agree on a dump Python wrote: bytes, effective bits,
    key/value error, and the error message for a bad policy."""
    tool = _tool()
    if tool is None:
        if os.environ.get("CI"):
            pytest.fail("kvq_quantize_dump not found (set KVQ_TOOLS_DIR)")
        pytest.skip("kvq_quantize_dump not built (set KVQ_TOOLS_DIR)")
    k, v, _ = _model_data(seed=60)
    path = tmp_path / "dump.safetensors"
    kvq.save_kv_dump(str(path), [{"k": k[l], "v": v[l]} for l in range(L)])
    specs = "k8v4;kivi2;turbo4"
    r = subprocess.run([str(tool), "--policy", specs, "--json", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    rows = doc["results"]
    assert len(rows) == 3
    for spec, row in zip(specs.split(";"), rows):
        c = kvq.KVCache(spec, L, H, D)
        kerr = verr = 0.0
        for layer in range(L):
            c.append(layer, k[layer], v[layer])
            kr, vr = c.read(layer)
            kerr += float(np.sum((k[layer].astype(np.float64) - kr) ** 2) / np.sum(k[layer].astype(np.float64) ** 2))
            verr += float(np.sum((v[layer].astype(np.float64) - vr) ** 2) / np.sum(v[layer].astype(np.float64) ** 2))
        rep = c.memory_report()
        assert row["policy"] == kvq.parse_policy(spec).spec
        assert row["bytes"] == rep.total
        assert row["effective_bits"] == pytest.approx(rep.effective_bits, rel=1e-9)
        assert row["codes_bytes"] == rep.keys["packed"]["codes"] + rep.values["packed"]["codes"]
        assert row["key_rel_mse"] == pytest.approx(kerr / L, rel=1e-6)
        assert row["value_rel_mse"] == pytest.approx(verr / L, rel=1e-6)
    r = subprocess.run([str(tool), "--policy", "k8v5", str(path)], capture_output=True, text=True)
    assert r.returncode != 0
    with pytest.raises(kvq.Error) as e:
        kvq.parse_policy("k8v5")
    assert f"kvq_quantize_dump: {e.value}" in r.stderr.splitlines()
