#!/usr/bin/env bash
# Stages what bench/cuda/run_device_checks.sh needs on a bare GPU machine (no apt, no network)
# into one git-ignored folder of this repository, so that it travels with the working tree:
#   .device-deps/eigen3/      Eigen 3.4's headers (from this machine's libeigen3-dev)
#   .device-deps/googletest/  GoogleTest's sources (from this machine's googletest package);
#                             the device build compiles them with the tests
# Both come from Debian's packages (installed here when missing). About 11 MB in all.
# Usage: bench/cuda/stage_device_deps.sh [dir]   (default: .device-deps in the repository root)
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:-.device-deps}
missing=()
[ -f /usr/include/eigen3/Eigen/Core ] || missing+=(libeigen3-dev)
[ -f /usr/src/googletest/CMakeLists.txt ] || missing+=(googletest)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
rm -rf "$dir/eigen3" "$dir/googletest"
mkdir -p "$dir/eigen3"
cp -r /usr/include/eigen3/Eigen "$dir/eigen3/"
cp -r /usr/src/googletest "$dir/googletest"
echo "staged into $dir ($(du -sh "$dir" | cut -f1)): Eigen $(sed -n 's/#define EIGEN_[A-Z]*_VERSION \([0-9]*\)/\1/p' \
  "$dir/eigen3/Eigen/src/Core/util/Macros.h" | paste -sd.), GoogleTest sources $(dpkg-query -W -f '${Version}' googletest 2>/dev/null || echo '?')"
