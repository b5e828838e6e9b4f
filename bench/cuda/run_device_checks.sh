#!/usr/bin/env bash
# Device checks of kvq's CUDA kernel layer (docs/cuda.md), in one go on a machine with a GPU:
# configure only the CUDA targets (KVQ_CUDA_ONLY), build them for the GPU that is present
# (CMAKE_CUDA_ARCHITECTURES=native; override with KVQ_CUDA_ARCH), run the GPU tests
# (test_cuda_kernels, test_cuda_host_device), kvq_bench_cuda and PyTorch's SDPA baseline
# (sdpa_baseline.py, when python3 has torch), then print one summary table.
#
# A bare machine (no apt, no network) needs Eigen's headers and GoogleTest's sources staged
# beforehand on a machine with Debian's packages: bench/cuda/stage_device_deps.sh writes them to
# .device-deps/ (git-ignored; carry it to the GPU machine with the working tree). When that folder
# exists the build uses it and nothing else (system Eigen/GoogleTest are ignored); otherwise it
# needs the packages (./kvq.sh build installs them).
#
# Budget: under 8 minutes on a fresh 16-core machine (each step has its own timeout;
# KVQ_BUILD_TIMEOUT, default 330 s, bounds the build). Exit status: 0 when every test passed
# and the benchmarks ran, 1 otherwise. Logs: $build/device_checks/*.log.
# KVQ_DEVICE_CHECKS_NO_GPU=1: the CPU half only (configure, build, run the host-side tests; the
# GPU tests skip; architectures default to 90), for checking the staged build on a machine
# without a GPU.
# Needs cmake >= 3.24 (for "native"), nvcc, a host C++17 compiler.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${KVQ_DEVICE_BUILD_DIR:-build-device}
no_gpu=${KVQ_DEVICE_CHECKS_NO_GPU:-0}
arch=${KVQ_CUDA_ARCH:-native}
[ "$no_gpu" = 1 ] && arch=${KVQ_CUDA_ARCH:-90}  # "native" needs a GPU to detect
deps=${KVQ_DEPS_DIR:-$(pwd)/.device-deps}
jobs=$(nproc 2>/dev/null || echo 4)
logs="$build/device_checks"
mkdir -p "$logs"
t0=$(date +%s)
status=0
step() { echo "[$(($(date +%s) - t0)) s] $*" >&2; }

dep_args=()
if [ -f "$deps/eigen3/Eigen/Core" ] && [ -f "$deps/googletest/CMakeLists.txt" ]; then
  # Staged: never fall back to the system's packages, so a missing file fails here, not there.
  dep_args=(-DKVQ_DEPS_DIR="$deps" -DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=ON
            -DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON)
  step "dependencies staged in $deps"
else
  step "no staged dependencies in $deps: using the system's Eigen and GoogleTest"
fi
gen=()
if [ ! -f "$build/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi

step "configure ($build, CUDA architectures: $arch)"
if ! timeout 120 cmake -S . -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DKVQ_CUDA=ON -DKVQ_CUDA_ONLY=ON -DKVQ_BUILD_TESTS=ON \
    -DKVQ_BUILD_BENCH=OFF -DKVQ_BUILD_EXAMPLES=OFF -DKVQ_INSTALL=OFF "${dep_args[@]}" \
    >"$logs/configure.log" 2>&1; then
  echo "configure failed: $logs/configure.log" >&2
  tail -20 "$logs/configure.log" >&2
  exit 1
fi
step "build test_cuda_kernels test_cuda_host_device kvq_bench_cuda"
if ! timeout "${KVQ_BUILD_TIMEOUT:-330}" cmake --build "$build" -j "$jobs" --target test_cuda_kernels test_cuda_host_device \
    kvq_bench_cuda >"$logs/build.log" 2>&1; then
  echo "build failed: $logs/build.log" >&2
  grep -E "error" "$logs/build.log" | head -20 >&2
  exit 1
fi

declare -a rows
for t in test_cuda_kernels test_cuda_host_device; do
  step "run $t"
  bin=$(find "$build" -name "$t" -type f -perm -u+x | head -1)
  timeout 150 "$bin" >"$logs/$t.log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  while read -r line; do
    name=$(echo "$line" | sed -E 's/^\[ *([A-Z]+) *\] ([^ ]+).*/\2/')
    res=$(echo "$line" | sed -E 's/^\[ *([A-Z]+) *\].*/\1/')
    rows+=("test	$name	$res")
  done < <(grep -E '^\[ +(OK|FAILED|SKIPPED) +\] [A-Za-z]+\.[A-Za-z]+ \(' "$logs/$t.log")
  if grep -q "SKIPPED" "$logs/$t.log" && grep -q "no CUDA device visible" "$logs/$t.log"; then
    if [ "$no_gpu" = 1 ]; then
      echo "note: $t skipped its GPU tests (no device visible; KVQ_DEVICE_CHECKS_NO_GPU=1)" >&2
    else
      echo "warning: $t skipped its GPU tests (no device visible)" >&2
      status=1
    fi
  fi
  [ $rc -eq 124 ] && rows+=("test	$t	TIMEOUT")
  [ $rc -ne 0 ] && grep -E "Failure|error|Expected|Which is|actual" "$logs/$t.log" | head -40 >&2
done

step "run kvq_bench_cuda"
bench=$(find "$build" -name kvq_bench_cuda -type f -perm -u+x | head -1)
timeout 200 "$bench" ${KVQ_BENCH_ARGS:-} >"$logs/bench.log" 2>&1 || { status=1; tail -5 "$logs/bench.log" >&2; }
if command -v python3 >/dev/null 2>&1; then
  step "run sdpa_baseline.py (PyTorch SDPA over f16 K/V)"
  timeout 150 python3 bench/cuda/sdpa_baseline.py ${KVQ_BENCH_ARGS:-} >"$logs/sdpa.log" 2>"$logs/sdpa.err" \
    || { status=1; tail -5 "$logs/sdpa.err" >&2; }
else
  echo "no python3: the SDPA baseline is not measured" >"$logs/sdpa.log"
fi

echo
echo "== kvq CUDA device checks ($(($(date +%s) - t0)) s) =="
grep -E '^device' "$logs/bench.log" | cut -f2
cat "$logs/bench.log" "$logs/sdpa.log" | grep -vP '\t' | sed 's/^/note: /'
printf '%-8s %-58s %s\n' kind name result
for r in "${rows[@]}"; do
  IFS=$'\t' read -r kind name res <<<"$r"
  printf '%-8s %-58s %s\n' "$kind" "$name" "$res"
done
printf '%-8s %-24s %-6s %-8s %-10s %-9s %-8s %s\n' bench name batch tokens ms GB/s ratio kv_tokens/s
cat "$logs/bench.log" "$logs/sdpa.log" | grep -vE '^device' | grep -P '\t' | while IFS=$'\t' read -r name rest; do
  get() { echo "$rest" | tr '\t' '\n' | sed -n "s|^$1=||p"; }
  b=$(get batch)
  printf '%-8s %-24s %-6s %-8s %-10s %-9s %-8s %s\n' bench "$name" "${b:-1}" "$(get tokens)" "$(get ms)" \
    "$(get GB/s)" "$(get ratio)" "$(get kv_tokens/s)"
done
exit $status
