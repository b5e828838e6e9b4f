"""Shared fixtures: the C++ oracle (tests/oracle/kvq_oracle.cpp, compiled from the same headers
with the SIMD flags of the module variant under test) and deterministic KV-like inputs."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

import kvq

HERE = Path(__file__).resolve().parent
REPO = Path(os.environ.get("KVQ_ROOT", HERE.parent.parent)).resolve()

# -march of each module variant (python/CMakeLists.txt); the oracle must run the same kernels.
VARIANT_FLAGS = {
    "avx512": ["-march=x86-64-v4"],
    "avx2": ["-march=x86-64-v3"],
    "baseline": ["-march=x86-64"] if os.uname().machine in ("x86_64", "AMD64") else [],
    "native": ["-march=native"],
}


def _in_ci() -> bool:
    return bool(os.environ.get("CI"))


@pytest.fixture(scope="session")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the compiled C++ oracle. Outside CI a missing compiler skips; in CI it fails."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    src = HERE / "oracle" / "kvq_oracle.cpp"
    include = REPO / "include"
    if not cxx or not (include / "kvq" / "quant" / "quantize.hpp").exists():
        if _in_ci():
            pytest.fail(f"no C++ compiler or kvq headers (CXX={cxx}, include={include})")
        pytest.skip("no C++ compiler or kvq headers for the oracle")
    d = tmp_path_factory.mktemp("oracle")
    exe = d / "kvq_oracle"
    # kvq's compiled-kernels mode (include/kvq/config.hpp): the oracle and the two kernel
    # translation units of REPO/src compile in parallel, then link. KVQ_KERNELS_LIB (set by
    # `./kvq.sh python` when the release build has it): that build's libkvq_kernels.a, the same
    # units compiled with -O3 -march=native from the same headers, is linked instead of compiling
    # them again (only for the "native" module variant, whose flags it shares).
    lib = os.environ.get("KVQ_KERNELS_LIB", "")
    reuse = bool(lib) and Path(lib).is_file() and kvq.variant == "native"
    units = [src] + ([] if reuse else [REPO / "src" / f"kvq_kernels_{u}.cpp"
                                       for u in ("attention", "quantize")])
    flags = ["-std=c++17", "-O3", *VARIANT_FLAGS[kvq.variant], "-DKVQ_EXTERN_KERNELS=1", "-I",
             str(include)]
    cmds = [[cxx, *flags, "-c", str(u), "-o", str(d / (u.stem + ".o"))] for u in units]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in cmds]
    for c, p in zip(cmds, procs):
        _, err = p.communicate()
        assert p.returncode == 0, f"oracle build failed: {' '.join(c)}\n{err[-4000:]}"
    cmd = [cxx, *[c[-1] for c in cmds], *([lib] if reuse else []), "-o", str(exe), "-lpthread"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"oracle link failed: {' '.join(cmd)}\n{r.stderr[-4000:]}"
    return exe


def run_oracle(exe: Path, *args: object) -> tuple[int, dict[str, str], str]:
    """Runs the oracle; returns (exit code, "key value" lines as a dict, raw stdout)."""
    r = subprocess.run([str(exe), *map(str, args)], capture_output=True, text=True)
    assert r.returncode in (0, 3), f"oracle failed ({r.returncode}): {r.stderr}"
    fields = {}
    for line in r.stdout.splitlines():
        k, _, v = line.partition(" ")
        fields[k] = v
    return r.returncode, fields, r.stdout


def kv_data(tokens: int, heads: int, head_dim: int, seed: int = 0, outliers: bool = True) -> np.ndarray:
    """float32 [tokens, heads, head_dim] with per-channel scale spread and a few outlier channels
    (the structure of real keys), deterministic."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, heads, head_dim)).astype(np.float32)
    x *= rng.uniform(0.2, 2.0, size=(1, heads, head_dim)).astype(np.float32)
    if outliers:
        x[:, :, :: max(1, head_dim // 4)] *= 8.0
    return np.ascontiguousarray(x, dtype=np.float32)
