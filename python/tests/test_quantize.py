"""kvq.quantize / QTensor / accountant: equal to the C++ headers run by the oracle, byte for byte."""
from __future__ import annotations

import gc
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvq
from conftest import kv_data, run_oracle

SHAPE = (64, 4, 128)

TERMS = [
    "f32", "f16", "bf16",
    "int2/token/g32", "int3/token/g32", "int4/token/g32", "int8/token/g32",
    "int4/token/g128", "int4/token/g32/f32meta", "sint4/token/g32", "sint8/token/g32",
    "int2/channel/g32", "int4/channel/g32", "int4/channel/g16", "int4/head/g32", "int4/tensor/g64",
    "e4m3/head", "e4m3/token", "e4m3/tensor", "e5m2/head", "e4m3/head/g16",
    "lm1", "lm2", "lm3", "lm4", "lm4/f32meta", "lm3/qjl",
    # dense-and-sparse outliers: their fp16 values and positions are buffers too
    "int4/token/g32/out2", "int2/channel/g32/out1%", "e4m3/head/out4",
    # rotated int / fp8 (/rot): the plain format's bytes of the rotated vectors
    "sint4/token/g32/rot", "int4/channel/g32/rot", "e4m3/head/rot",
]
BUFFERS = ("codes", "scales", "zeros", "norms", "qjl_signs", "qjl_norms", "outlier_values", "outlier_pos")


def _oracle_quantize(oracle: Path, tmp: Path, term: str, x: np.ndarray):
    src = tmp / "x.f32"
    np.ascontiguousarray(x, dtype=np.float32).tofile(src)
    code, fields, out = run_oracle(oracle, "quantize", term, *x.shape, src, tmp / "q")
    if code == 3:
        return None, out.strip().removeprefix("error ")
    bufs = {b: (tmp / f"q.{b}").read_bytes() for b in BUFFERS}
    return (bufs, int(fields["nbytes"]), fields["effective_bits"]), None


@pytest.mark.parametrize("term", TERMS)
def test_packed_bytes_equal_cpp(oracle: Path, tmp_path: Path, term: str) -> None:
    x = kv_data(*SHAPE, seed=1)
    want, err = _oracle_quantize(oracle, tmp_path, term, x)
    assert err is None, f"oracle rejected {term}: {err}"
    bufs, nbytes, ebits = want
    q = kvq.quantize(x, term)
    assert q.buffers() == bufs
    assert q.nbytes == nbytes
    assert f"{q.effective_bits:.17g}" == ebits
    assert q.shape == SHAPE
    assert q.config == kvq.QuantConfig(term)
    # Every stored byte is in a buffer, except the rotation seed older headers count per tensor.
    bd = q.breakdown()
    assert sum(len(b) for b in bufs.values()) + bd.get("seeds", 0) == q.nbytes == bd["total"]
    # The accountant predicts the stored bytes exactly, from Python as from C++.
    assert kvq.account(term, SHAPE)["total"] == q.nbytes
    _, acc, _ = run_oracle(oracle, "account", term, *SHAPE)
    assert f"{kvq.effective_bits(term, SHAPE):.17g}" == acc["effective_bits"]


@pytest.mark.parametrize("term,shape,k", [("int4/token/g32/out3", (16, 2, 384), 3),
                                          ("sint4/token/g32/out1%", (8, 3, 128), 2),
                                          ("e4m3/token/out2", (5, 1, 64), 2)])
def test_outlier_buffers_hold_every_byte(term: str, shape: tuple, k: int) -> None:
    # An outlier config: every byte nbytes counts is in a buffer, and the outlier buffers have
    # the sizes docs/outliers.md gives (k fp16 values and k positions per (token, head) vector,
    # a position 2 bytes when head_dim > 256).
    x = kv_data(*shape, seed=5)
    q = kvq.quantize(x, term)
    bufs = q.buffers()
    vectors = shape[0] * shape[1]
    assert len(bufs["outlier_values"]) == 2 * k * vectors
    assert len(bufs["outlier_pos"]) == (2 if shape[2] > 256 else 1) * k * vectors
    assert sum(len(b) for b in bufs.values()) + q.breakdown().get("seeds", 0) == q.nbytes
    assert q.breakdown()["outliers"] == len(bufs["outlier_values"]) + len(bufs["outlier_pos"])
    # The stored outliers are, per vector, the k entries farthest from their group's mean in
    # units of its standard deviation (docs/outliers.md; token axis: groups of G channels),
    # positions ascending, values the entries in fp16. Recomputed here in numpy (float64).
    G = q.config.group or shape[2]
    xg = x.astype(np.float64).reshape(shape[0], shape[1], shape[2] // G, G)
    sd = xg.std(axis=3, keepdims=True)
    score = np.where(sd > 0, np.abs(xg - xg.mean(axis=3, keepdims=True)) / np.where(sd > 0, sd, 1), 0)
    score = score.reshape(shape)
    want = np.sort(np.argsort(-score, axis=2, kind="stable")[:, :, :k], axis=2)
    pos = np.frombuffer(bufs["outlier_pos"], dtype="<u2" if shape[2] > 256 else np.uint8)
    pos = pos.reshape(shape[0], shape[1], k).astype(np.int64)
    vals = np.frombuffer(bufs["outlier_values"], dtype="<f2").reshape(shape[0], shape[1], k)
    assert np.array_equal(pos, want)
    assert np.array_equal(vals, np.take_along_axis(x, pos, axis=2).astype(np.float16))


@pytest.mark.parametrize("term", ["int4/token/g32", "int2/channel/g32", "e4m3/head", "lm4"])
def test_input_dtypes_and_strides_do_not_change_bytes(term: str) -> None:
    x = kv_data(*SHAPE, seed=2)
    xh = x.astype(np.float16)
    ref_h = kvq.quantize(xh.astype(np.float32), term).buffers()
    assert kvq.quantize(xh, term).buffers() == ref_h  # f16 in == its exact f32 upcast in
    # A head-major (HND) buffer viewed as [tokens, heads, head_dim]: strided, not contiguous.
    hnd = np.ascontiguousarray(x.transpose(1, 0, 2))
    view = hnd.transpose(1, 0, 2)
    assert not view.flags["C_CONTIGUOUS"]
    assert kvq.quantize(view, term).buffers() == kvq.quantize(x, term).buffers()


def test_known_effective_bits() -> None:
    shape = (32, 2, 128)
    assert kvq.effective_bits("int2/token/g32", shape) == 3.0
    assert kvq.effective_bits("sint4/token/g32", shape) == 4.5
    assert kvq.effective_bits("sint8/token/g32", shape) == 8.5
    assert kvq.effective_bits("int4/token/g32", shape) == 5.0
    assert kvq.effective_bits(kvq.QuantConfig.raw("f16"), shape) == 16.0
    assert kvq.effective_bits("int4", (0, 2, 128)) == 0.0


def _rel_mse(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.sum((a64 - b64) ** 2) / np.sum(a64**2))


# Relative MSE bounds by format on kv_data (loose: they catch a broken round trip, not tune it).
def _bound(cfg: kvq.QuantConfig) -> float:
    if cfg.format == "f32":
        return 0.0
    if cfg.format in ("f16", "bf16"):
        return 1e-4
    if cfg.format in ("e4m3", "e5m2"):
        return 5e-3
    return {1: 0.6, 2: 0.5, 3: 0.06, 4: 0.02, 8: 1e-4}[cfg.bits]


@pytest.mark.parametrize("preset", [p[0] for p in kvq.presets()])
def test_round_trip_every_preset(preset: str) -> None:
    pol = kvq.parse_policy(preset)
    x = kv_data(*SHAPE, seed=3)
    for cfg in (pol.key, pol.value):
        q = kvq.quantize(x, cfg)
        y = q.dequantize()
        assert y.dtype == np.float32 and y.shape == SHAPE
        err = _rel_mse(x, y)
        assert err <= _bound(cfg), f"{preset} {cfg.spec}: rel MSE {err}"
        if cfg.format == "f32":
            assert np.array_equal(x, y)
        y16 = q.dequantize(dtype=np.float16)
        assert y16.dtype == np.float16
        assert np.array_equal(y16, y.astype(np.float16))  # both round the same f32 values
        out = np.empty(SHAPE, np.float32)
        assert q.dequantize(out=out) is out and np.array_equal(out, y)
    # The whole-model cache under the preset: read back == what attention sees, bytes add up.
    c = kvq.KVCache(preset, 2, SHAPE[1], SHAPE[2])
    for layer in range(2):
        c.append(layer, x, x)
    for layer in range(2):
        k, v = c.read(layer)
        assert k.shape == SHAPE and c.tokens(layer) == SHAPE[0]
        assert _rel_mse(x, k) <= _bound(c.key_config(layer)) + 1e-12
        assert _rel_mse(x, v) <= _bound(c.value_config(layer)) + 1e-12
    rep = c.memory_report()
    assert rep.total == c.nbytes == rep.keys["total"] + rep.values["total"]
    assert rep.elements == 2 * 2 * math.prod(SHAPE)


def test_quantize_into_out_reuses_and_matches() -> None:
    x = kv_data(*SHAPE, seed=4)
    q = kvq.QTensor()
    assert q.nbytes == 0
    r = kvq.quantize(x, "int4/token/g32", out=q)
    assert r is q
    assert q.buffers() == kvq.quantize(x, "int4/token/g32").buffers()
    bad = x.copy()
    bad[0, 0, 0] = np.inf
    with pytest.raises(kvq.Error):
        kvq.quantize(bad, "int4/token/g32", out=q)
    assert q.nbytes == 0 and q.shape == (0, 0, 0)  # no half-written tensor is left behind


def test_quant_config_builders_equal_parsed() -> None:
    assert kvq.QuantConfig.int(4, "channel", 32) == kvq.QuantConfig("int4/channel/g32")
    assert kvq.QuantConfig.int(4, symmetric=True) == kvq.QuantConfig("sint4")
    assert kvq.QuantConfig.fp8("e5m2", "token") == kvq.QuantConfig("e5m2/token")
    assert kvq.QuantConfig.raw("bf16") == kvq.QuantConfig("bf16")
    assert kvq.QuantConfig.fp4("mxfp4") == kvq.QuantConfig("mxfp4")
    nv = kvq.QuantConfig.fp4("nvfp4")
    assert nv == kvq.QuantConfig("nvfp4") and (nv.format, nv.group, nv.fp4_tensor_scale) == ("nvfp4", 16, 1.0)
    assert kvq.QuantConfig.fp4("nvfp4", 0.5) != nv
    assert kvq.QuantConfig.lloyd_max(3, qjl=True) == kvq.QuantConfig("lm3/qjl")
    c = kvq.QuantConfig("int2/channel/g64/f32meta")
    assert (c.format, c.bits, c.axis, c.group, c.meta) == ("int", 2, "channel", 64, "f32")
    assert kvq.QuantConfig(c.spec) == c and repr(c) == "QuantConfig('int2/channel/g64/f32meta')"
    assert len({c, kvq.QuantConfig(c.spec)}) == 1


def test_policy_matches_cpp(oracle: Path) -> None:
    for spec in ["k8v4", "kivi2,residual=128", "k=int4/channel/g32,v=lm3,skip=1:2,skipas=fp8",
                 "fp8,k@3=int8/token/g32"]:
        p = kvq.parse_policy(spec)
        _, _, out = run_oracle(oracle, "policy", spec)
        assert p.spec == out.strip()
        assert kvq.parse_policy(p.spec) == p == kvq.Policy(spec)
    p = kvq.parse_policy("k8v4,skip=1")
    assert p.key_for(0, 4) == kvq.QuantConfig("f32") and p.key_for(1, 4) == kvq.QuantConfig("e4m3/head")
    assert [name for name, _, _ in kvq.presets()][:4] == ["f32", "f16", "fp8", "k8v4"]
    assert [str(x) for x in kvq.parse_policies("k8v4;kivi2")] == [
        kvq.parse_policy("k8v4").spec, kvq.parse_policy("kivi2").spec]


# ----------------------------------------------------------------------------- bad input

KIND_WORDS = {"invalid_argument": "invalid argument", "shape_mismatch": "shape mismatch",
              "non_finite": "non-finite value", "out_of_range": "out of range", "parse": "parse error",
              "io": "I/O error", "unsupported": "unsupported"}


@pytest.mark.parametrize(
    "term, mutate",
    [
        ("int5", None),                       # unknown format (parse)
        ("int4/g", None),                     # missing group number
        ("int4/channel/g48", None),           # group does not divide the 64 tokens
        ("int4/token/g96", None),             # group does not divide head_dim 128
        ("e4m3/channel", None),               # fp8 has no channel axis
        ("int4/token/g32", "nan"),            # non-finite input, named by position
        ("int4/token/g32", "huge"),           # beyond fp16 metadata
        ("lm4", "huge"),                      # vector norm beyond fp16
    ],
)
def test_errors_equal_cpp(oracle: Path, tmp_path: Path, term: str, mutate: str | None) -> None:
    x = kv_data(*SHAPE, seed=5)
    if mutate == "nan":
        x[7, 2, 33] = np.nan
    elif mutate == "huge":
        x[3, 1, :] = 1e30
    _, err = _oracle_quantize(oracle, tmp_path, term, x)
    assert err is not None, f"the oracle accepted {term}/{mutate}"
    with pytest.raises(kvq.Error) as e:
        kvq.quantize(x, term)
    assert str(e.value) == err
    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith(f"kvq: {KIND_WORDS[e.value.kind]}: ")


def test_bad_python_inputs_raise() -> None:
    x = kv_data(8, 2, 32)
    with pytest.raises(TypeError, match="dtype int32"):
        kvq.quantize(x.astype(np.int32), "int4")
    with pytest.raises(TypeError, match="dtype float64"):
        kvq.quantize(x.astype(np.float64), "int4")
    with pytest.raises(TypeError, match="got list"):
        kvq.quantize([[[1.0]]], "int4")
    with pytest.raises(TypeError, match="QuantConfig or a spec term"):
        kvq.quantize(x, 4)
    with pytest.raises(kvq.Error, match="must have 3 dimensions"):
        kvq.quantize(x[0], "int4")
    with pytest.raises(kvq.Error, match="negative stride"):
        kvq.quantize(x[::-1], "int4")
    with pytest.raises(kvq.Error, match="overlapping strides"):
        kvq.quantize(np.broadcast_to(x[:1], (8, 2, 32)), "int4")
    with pytest.raises(kvq.Error) as e:
        kvq.quantize(x, "k8v4")  # a policy, not a term
    assert e.value.kind == "parse" and "unknown format 'k8v4'" in str(e.value)
    q = kvq.quantize(x, "int4/token/g32")
    with pytest.raises(TypeError, match="dtype must be float32 or float16"):
        q.dequantize(dtype="int8")
    with pytest.raises(kvq.Error, match="dequantize into"):
        q.dequantize(out=np.empty((8, 2, 16), np.float32))
    with pytest.raises(TypeError):
        q.dequantize(out=np.empty((8, 2, 32), np.float64))
    with pytest.raises(kvq.Error, match="integer formats support"):
        kvq.QuantConfig.int(5)
    with pytest.raises(kvq.Error, match="unknown axis"):
        kvq.QuantConfig.int(4, axis="row")
    with pytest.raises(kvq.Error, match="shape must be"):
        kvq.effective_bits("int4", (1, 2))
    with pytest.raises(kvq.Error) as e:
        kvq.parse_policy("k8v4,residual=-1")
    assert e.value.kind == "parse"


# ----------------------------------------------------------------------------- DLPack

class DLPackOnly:
    """A producer that offers nothing but the DLPack protocol (no buffer protocol, no numpy)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        return self._a.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):  # noqa: ANN204
        return self._a.__dlpack_device__()


def test_dlpack_round_trip() -> None:
    x = kv_data(*SHAPE, seed=6)
    ref = kvq.quantize(x, "int4/token/g32")
    q = kvq.quantize(DLPackOnly(x), "int4/token/g32")
    assert q.buffers() == ref.buffers()
    y = q.dequantize()
    # Outputs are numpy arrays and DLPack producers: a consumer shares their memory.
    z = np.from_dlpack(y)
    assert np.shares_memory(y, z) and np.array_equal(y, ref.dequantize())
    assert kvq.quantize(DLPackOnly(y), "int4/token/g32").buffers() == kvq.quantize(y, "int4/token/g32").buffers()


def test_torch_tensors_if_available() -> None:
    torch = pytest.importorskip("torch")
    x = kv_data(*SHAPE, seed=7)
    t = torch.from_numpy(x)
    assert kvq.quantize(t, "int4/token/g32").buffers() == kvq.quantize(x, "int4/token/g32").buffers()
    tt = t.transpose(0, 1).contiguous().transpose(0, 1)  # strided torch view
    assert kvq.quantize(tt, "e4m3/head").buffers() == kvq.quantize(x, "e4m3/head").buffers()
    b = t.to(torch.bfloat16)
    qb = kvq.quantize(b, "int8/token/g32")
    assert qb.buffers() == kvq.quantize(b.float().numpy(), "int8/token/g32").buffers()
    y = torch.from_dlpack(qb.dequantize())
    assert y.dtype == torch.float32 and tuple(y.shape) == SHAPE
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    qb.dequantize(out=out)
    assert torch.equal(out, y.to(torch.bfloat16))
    with pytest.raises(TypeError, match="dtype int64"):
        kvq.quantize(torch.zeros(SHAPE, dtype=torch.int64), "int4")


# ----------------------------------------------------------------------------- resources

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc")
def test_no_memory_growth_over_10k_quantize_calls() -> None:
    x = kv_data(32, 2, 64, seed=8)
    cfgs = [kvq.QuantConfig("int4/token/g32"), "e4m3/head", "lm3/qjl"]

    def work(n: int) -> None:
        for i in range(n):
            q = kvq.quantize(x, cfgs[i % 3])
            q.dequantize()
            q.breakdown()

    work(1000)  # warm: allocator pools, caches
    gc.collect()
    before = _rss_bytes()
    work(10_000)
    gc.collect()
    grown = _rss_bytes() - before
    # 10^4 leaked QTensors would be >= 10^4 x 2 KiB = 20 MiB; allow allocator noise only.
    assert grown < 1 << 20, f"RSS grew by {grown} bytes over 10^4 quantize calls"


def test_gil_released_during_quantize() -> None:
    """Another Python thread runs while kvq.quantize works (it would not if the GIL were held)."""
    x = kv_data(8192, 8, 128, seed=9)  # 32 MiB: tens of milliseconds per call
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    th = threading.Thread(target=ticker)
    th.start()
    try:
        inside = 0
        for _ in range(5):
            time.sleep(0.005)
            t0 = time.perf_counter()
            kvq.quantize(x, "int4/channel/g32")
            t1 = time.perf_counter()
            inside += sum(1 for t in list(ticks) if t0 < t < t1)
            if inside >= 2:
                break
    finally:
        stop.set()
        th.join()
    assert inside >= 2, "no other Python thread ran during kvq.quantize: is the GIL released?"


def test_simd_variants_agree() -> None:
    """The AVX-512, AVX2 and scalar builds of the module store identical bytes (each variant has
    its own nanobind domain, so they load side by side)."""
    import importlib

    from kvq._loader import built_variants, runnable_variants

    runnable = runnable_variants()
    names = [v for v in built_variants() if v in runnable]
    if len(names) < 2:
        pytest.skip(f"only {names} built/runnable here")
    mods = {v: importlib.import_module(f"kvq._kvq_{v}") for v in names}
    assert {m.simd_level() for m in mods.values()} >= {"scalar"} or "baseline" not in mods
    x = kv_data(*SHAPE, seed=10)
    for term in TERMS:
        got = {v: m.quantize(x, term).buffers() for v, m in mods.items()}
        first = got[names[0]]
        for v in names[1:]:
            assert got[v] == first, f"{term}: {v} differs from {names[0]}"
        outs = {v: m.quantize(x, term).dequantize() for v, m in mods.items()}
        for v in names[1:]:
            if term.startswith("lm"):
                # The inverse rotation's float sums run in a different order in the SIMD and
                # scalar paths: same codes, reconstructions equal to float rounding.
                np.testing.assert_allclose(outs[v], outs[names[0]], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{term}: {v} vs {names[0]}")
            else:
                assert np.array_equal(outs[v], outs[names[0]]), f"{term}: {v} dequantizes differently"


def test_rotate_field() -> None:
    c = kvq.QuantConfig("sint4/token/g32/rot")
    assert c.rotate
    assert c.spec == "sint4/token/g32/rot"
    assert not kvq.QuantConfig("sint4/token/g32").rotate
    assert c != kvq.QuantConfig("sint4/token/g32")
    assert not kvq.QuantConfig("lm4").rotate  # Lloyd-Max rotates by itself
