/// \file kvq_cpu.cpp
/// A tiny module (no kvq code) that tells kvq/_loader.py which SIMD variant of the binding this
/// CPU can run. It is compiled for the baseline target, so it imports everywhere; the checks use
/// the compiler's CPU-feature runtime, which also asks the OS whether AVX/AVX-512 state is
/// enabled (a CPU with AVX-512 under an OS that does not save zmm registers reports false).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

namespace nb = nanobind;

namespace {

/// Variants this CPU runs, best first: "avx512" (x86-64-v4), "avx2" (x86-64-v3), "baseline".
std::vector<std::string> runnable_variants() {
  std::vector<std::string> v;
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // x86-64-v3 = AVX, AVX2, BMI1/2, F16C, FMA, LZCNT, MOVBE, XSAVE; v4 adds AVX-512 F/BW/CD/DQ/VL.
  const bool v3 = __builtin_cpu_supports("avx") && __builtin_cpu_supports("avx2") &&
                  __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                  __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("movbe");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl");
  if (v4) v.emplace_back("avx512");
  if (v3) v.emplace_back("avx2");
#endif
  v.emplace_back("baseline");
  return v;
}

}  // namespace

NB_MODULE(_kvq_cpu, m) {
  m.doc() = "CPU feature probe for choosing kvq's SIMD variant";
  m.def("runnable_variants", &runnable_variants,
        "SIMD variants of kvq this CPU can run, best first.");
}
