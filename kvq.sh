#!/usr/bin/env bash
# kvq's one entry point for a fresh Debian/Ubuntu machine.
#   ./kvq.sh compare [args]  install what is missing, build, run the geometry-vs-bits comparison
#   ./kvq.sh test            install what is missing, build, run the whole test suite (ctest),
#                            then again under AddressSanitizer + UndefinedBehaviorSanitizer
#   ./kvq.sh bench [args]    build and run kvq_bench (Google Benchmark; args passed through),
#                            5 repetitions, JSON in $build/bench.json, then the median / ratio
#                            to BM_Memcpy table (kvq_bench_report)
#   ./kvq.sh build           install what is missing and build only
# Environment: KVQ_BUILD_DIR (default build), KVQ_JOBS (default nproc),
#              KVQ_SKIP_SANITIZE=1 skips the sanitizer pass of `test`.
set -euo pipefail
cd "$(dirname "$0")"
here=$(pwd)
build=${KVQ_BUILD_DIR:-build}
jobs=${KVQ_JOBS:-$(nproc 2>/dev/null || echo 2)}

need_pkgs() {
  local missing=()
  for p in cmake g++ make libeigen3-dev libgtest-dev libbenchmark-dev; do
    dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "kvq: installing ${missing[*]}" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

configure_build() {  # dir, extra cmake args...   (KVQ_TARGETS: build only these targets)
  local dir=$1
  shift
  cmake -S "$here" -B "$dir" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
  if [ -n "${KVQ_TARGETS:-}" ]; then
    # shellcheck disable=SC2086
    cmake --build "$dir" -j "$jobs" --target $KVQ_TARGETS
  else
    cmake --build "$dir" -j "$jobs"
  fi
}

cmd=${1:-compare}
[ $# -gt 0 ] && shift
case "$cmd" in
  build)
    need_pkgs
    configure_build "$build"
    ;;
  compare)
    need_pkgs
    KVQ_TARGETS=kvq_compare configure_build "$build"
    "$build/examples/kvq_compare" "$@"
    ;;
  bench)
    need_pkgs
    KVQ_TARGETS="kvq_bench kvq_bench_report" configure_build "$build"
    "$build/bench/kvq_bench" --benchmark_repetitions=5 --benchmark_out="$build/bench.json" \
      --benchmark_out_format=json "$@"
    "$build/bench/kvq_bench_report" "$build/bench.json"
    ;;
  test)
    need_pkgs
    configure_build "$build"
    (cd "$build" && ctest --output-on-failure -j "$jobs")
    if [ "${KVQ_SKIP_SANITIZE:-0}" != "1" ]; then
      echo "kvq: sanitizer pass (ASan + UBSan, portable scalar paths)" >&2
      configure_build "${build}-asan" -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g" -DKVQ_SANITIZE=ON \
        -DKVQ_NATIVE=OFF -DKVQ_BUILD_BENCH=OFF -DKVQ_CUDA=OFF
      (cd "${build}-asan" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        ctest --output-on-failure -j "$jobs" -LE "exhaustive|buildsystem")
    fi
    ;;
  *)
    echo "usage: ./kvq.sh {compare|test|bench|build} [args]" >&2
    exit 2
    ;;
esac
