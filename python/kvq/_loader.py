"""Imports the best SIMD variant of kvq's compiled module that this CPU runs.

The wheel holds one module per variant (``_kvq_avx512``, ``_kvq_avx2``, ``_kvq_baseline``, or
``_kvq_native`` for a local ``-march=native`` build); ``_kvq_cpu`` asks the CPU and OS which of
them can run. ``KVQ_VARIANT=<name>`` forces one (tests use it to compare variants).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

_ORDER = ("native", "avx512", "avx2", "baseline")


def built_variants() -> list[str]:
    """Variants present in this installation, best first."""
    return [v for v in _ORDER if importlib.util.find_spec(f"kvq._kvq_{v}") is not None]


def runnable_variants() -> list[str]:
    """Variants this CPU can run (whether or not they were built), best first."""
    from . import _kvq_cpu  # compiled for the baseline target: imports on every CPU

    return list(_kvq_cpu.runnable_variants())


def load() -> ModuleType:
    built = built_variants()
    if not built:
        raise ImportError(
            f"kvq: no compiled module in {os.path.dirname(__file__)} (a source checkout shadowing "
            "the installed package? install with pip install ./python and import it from elsewhere)"
        )
    forced = os.environ.get("KVQ_VARIANT", "").strip()
    if forced:
        if forced not in built:
            raise ImportError(f"kvq: KVQ_VARIANT={forced!r} is not built here (built: {', '.join(built)})")
        if forced not in ("native", "baseline") and forced not in runnable_variants():
            raise ImportError(f"kvq: KVQ_VARIANT={forced!r} needs CPU features this machine lacks")
        return importlib.import_module(f"kvq._kvq_{forced}")
    if "native" in built:  # a local build for this very machine
        return importlib.import_module("kvq._kvq_native")
    runnable = runnable_variants()
    for v in built:
        if v in runnable:
            return importlib.import_module(f"kvq._kvq_{v}")
    raise ImportError(f"kvq: none of the built variants ({', '.join(built)}) runs on this CPU")
