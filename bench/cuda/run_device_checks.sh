#!/usr/bin/env bash
# Device checks of kvq's CUDA kernel layer (docs/cuda.md), in one go on a machine with a GPU:
# configure, build only the GPU targets for the GPU that is present (CMAKE_CUDA_ARCHITECTURES
# =native, override with KVQ_CUDA_ARCH), run the GPU tests (test_cuda_kernels,
# test_cuda_host_device) and kvq_bench_cuda, then print one summary table. Budget: under 8
# minutes on a fresh machine (each step has its own timeout; KVQ_BUILD_TIMEOUT, default 330 s,
# bounds the build). Exit status: 0 when every test
# passed and the benchmark ran, 1 otherwise. Logs: $build/device_checks/*.log.
# Needs cmake >= 3.24, nvcc, g++, Eigen 3.4 and GoogleTest (./kvq.sh build installs the last two).
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${KVQ_DEVICE_BUILD_DIR:-build-device}
arch=${KVQ_CUDA_ARCH:-native}
jobs=$(nproc 2>/dev/null || echo 4)
logs="$build/device_checks"
mkdir -p "$logs"
t0=$(date +%s)
status=0
step() { echo "[$(($(date +%s) - t0)) s] $*" >&2; }

step "configure ($build, CUDA architectures: $arch)"
if ! timeout 120 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$arch" \
    -DKVQ_CUDA=ON -DKVQ_BUILD_TESTS=ON -DKVQ_BUILD_BENCH=OFF -DKVQ_BUILD_EXAMPLES=OFF \
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
  grep -q "SKIPPED" "$logs/$t.log" && grep -q "no CUDA device visible" "$logs/$t.log" && {
    echo "warning: $t skipped its GPU tests (no device visible)" >&2; status=1; }
  [ $rc -eq 124 ] && rows+=("test	$t	TIMEOUT")
done

step "run kvq_bench_cuda"
bench=$(find "$build" -name kvq_bench_cuda -type f -perm -u+x | head -1)
timeout 200 "$bench" >"$logs/bench.log" 2>&1 || status=1

echo
echo "== kvq CUDA device checks ($(($(date +%s) - t0)) s) =="
grep -E '^device' "$logs/bench.log" | cut -f2
printf '%-8s %-58s %s\n' kind name result
for r in "${rows[@]}"; do
  IFS=$'\t' read -r kind name res <<<"$r"
  printf '%-8s %-58s %s\n' "$kind" "$name" "$res"
done
printf '%-8s %-22s %-8s %-10s %-9s %-8s %s\n' bench name tokens ms GB/s ratio kv_tokens/s
grep -vE '^device' "$logs/bench.log" | while IFS=$'\t' read -r name rest; do
  get() { echo "$rest" | tr '\t' '\n' | sed -n "s|^$1=||p"; }
  printf '%-8s %-22s %-8s %-10s %-9s %-8s %s\n' bench "$name" "$(get tokens)" "$(get ms)" \
    "$(get GB/s)" "$(get ratio)" "$(get kv_tokens/s)"
done
exit $status
