#!/usr/bin/env bash
# Build (and optionally test) the pagedkv native runner. Idempotent; installs nothing.
#
#   android_demo/native/ci_build.sh host                 build into build/android-host
#   android_demo/native/ci_build.sh cross                aarch64 build into build/android-aarch64 (Debian clang,
#                                                        --target=aarch64-linux-gnu, -Werror, --no-undefined, 16 KB pages)
#   android_demo/native/ci_build.sh test-host FIXTURES   run the host tests on FIXTURES (make_fixtures.py)
#   android_demo/native/ci_build.sh test-cross FIXTURES  run the aarch64 tests under qemu, -cpu max and cortex-a53
#
# Needs: cmake >= 3.20, g++, nlohmann/json's headers (nlohmann-json3-dev; cmake says so when missing), a JDK
# (javac/java); for cross: clang, lld, g++-aarch64-linux-gnu (the aarch64 glibc and libstdc++ clang links
# against), qemu-user-static and the aarch64 executorch 1.5.1 wheel (downloaded with pip into
# build/aarch64-wheel, unzipped once).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
PY="${PAGEDKV_PYTHON:-$REPO/.venv/bin/python}"
CMAKE="${CMAKE:-$(command -v /usr/bin/cmake || command -v cmake)}"
JOBS="${JOBS:-$(nproc)}"
ET_VERSION=1.5.1
APT_LINE="apt-get install -y cmake g++ nlohmann-json3-dev openjdk-17-jdk-headless clang lld g++-aarch64-linux-gnu qemu-user-static adb"

need() {
  for tool in "$@"; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "ci_build.sh: '$tool' is missing. Install the prerequisites with:" >&2
      echo "  $APT_LINE" >&2
      exit 3
    fi
  done
}

aarch64_executorch() {  # prints the unzipped aarch64 wheel's executorch package dir
  local dir="$REPO/build/aarch64-wheel"
  local root="$dir/unpacked/executorch"
  if [ ! -f "$root/lib/libexecutorch.so" ]; then
    mkdir -p "$dir"
    local whl
    whl="$(ls "$dir"/executorch-$ET_VERSION-*manylinux*aarch64.whl 2>/dev/null | head -1 || true)"
    if [ -z "$whl" ]; then
      "$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_aarch64 \
        --python-version 3.11 "executorch==$ET_VERSION" -d "$dir" >&2
      whl="$(ls "$dir"/executorch-$ET_VERSION-*manylinux*aarch64.whl | head -1)"
    fi
    rm -rf "$dir/unpacked.partial"
    "$PY" - "$whl" "$dir/unpacked.partial" >&2 <<'PYEOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(("executorch/include/", "executorch/lib/"))])
PYEOF
    rm -rf "$dir/unpacked" && mv "$dir/unpacked.partial" "$dir/unpacked"
  fi
  echo "$root"
}

# One build at a time: pytest workers (tests/test_android_*.py, test_runner_cli.py) call this
# concurrently, and two makes in one tree race. Held by the builds only, not by the test runs.
build_lock() {
  mkdir -p "$REPO/build"
  exec 9>"$REPO/build/.android-native-build.lock"
  flock 9
}

case "${1:-}" in
  host)
    need g++ javac
    build_lock
    "$CMAKE" -S "$HERE" -B "$REPO/build/android-host" -DPAGEDKV_PYTHON="$PY" >/dev/null
    "$CMAKE" --build "$REPO/build/android-host" -j "$JOBS"
    ;;
  cross)
    need clang clang++ ld.lld aarch64-linux-gnu-g++ qemu-aarch64-static javac
    build_lock
    ET_ROOT="$(aarch64_executorch)"
    "$CMAKE" -S "$HERE" -B "$REPO/build/android-aarch64" \
      -DCMAKE_TOOLCHAIN_FILE="$HERE/toolchain-aarch64-linux-gnu.cmake" -DEXECUTORCH_ROOT="$ET_ROOT" \
      -DPAGEDKV_EXECUTORCH=wheel -DPAGEDKV_WERROR=ON >/dev/null
    "$CMAKE" --build "$REPO/build/android-aarch64" -j "$JOBS"
    ;;
  test-host)
    B="$REPO/build/android-host"
    "$B/kernel_core_test"
    "$B/json_test"
    "$B/block_manager_test"
    "$B/runner_test" "$2" "${@:3}"
    ;;
  test-cross)
    B="$REPO/build/android-aarch64"
    ET_ROOT="$(aarch64_executorch)"
    export QEMU_LD_PREFIX=/usr/aarch64-linux-gnu
    export LD_LIBRARY_PATH="$ET_ROOT/lib:$B"
    qemu-aarch64-static -cpu max "$B/json_test"
    for cpu in max cortex-a53; do
      want=neon-dotprod; [ "$cpu" = cortex-a53 ] && want=neon
      echo "== qemu-aarch64-static -cpu $cpu (expects the $want kernel path)"
      qemu-aarch64-static -cpu "$cpu" "$B/kernel_core_test" | tee "$B/kernel_core_test.$cpu.log"
      grep -qx "active path: $want, threads [0-9]*" "$B/kernel_core_test.$cpu.log" \
        || { echo "kernel core: expected the $want path under -cpu $cpu" >&2; exit 1; }
      qemu-aarch64-static -cpu "$cpu" "$B/block_manager_test"
      # the A53 runs the runner tests whose outcome depends on the kernel path (plain NEON's greedy tokens
      # = HF's); the runner's logic is the same code under -cpu max, which runs them all
      only=(); [ "$cpu" = cortex-a53 ] && only=(--only preallocates_every_arena,greedy_tokens_equal_hf)
      qemu-aarch64-static -cpu "$cpu" "$B/runner_test" "$2" --expect-isa "$want" --no-rss "${only[@]}" "${@:3}"
    done
    ;;
  *)
    echo "usage: $0 host|cross|test-host FIXTURES|test-cross FIXTURES" >&2
    exit 2
    ;;
esac
